"""``interference``: how much a long prefill disturbs running decode streams.

N decode requests (prose prompts, long outputs, ``ignore_eos``) are in flight for the whole
window (decode_streams.py); one long prefill arrives every T seconds. Every arm gets the same
two cores: colocated is one worker on both, P/D one prefill and one decode worker on one each.

    t=0          warm-up         T           2T          ...        end
    |streams start|--prefill 0--|--prefill 1--|-- ...            streams stop
                  <------------------ ITL measured here ------------------>

ITL is every gap between successive chunks of a decode request, pooled (vLLM's definition),
counted from the end of the warm-up to the end of the window. The long prefills' prefill time
is the server's ``timing.prefill_ms``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from epdserve.bench.client import ClientConfig, list_models, send_request
from epdserve.bench.experiments.decode_streams import StreamTrace, run_slot
from epdserve.bench.experiments.interference_report import NAME, Scale, build_report, write_plots
from epdserve.bench.experiments.launch import start_server, stop_server
from epdserve.bench.experiments.report import begin, write_json, write_outputs
from epdserve.bench.metrics import RequestOutput
from epdserve.bench.workloads import load_tokenizer, random_requests

STALL_FACTOR = 5.0  # a gap longer than this many times the median counts as a stall


FULL = Scale(8, 256, 1024, 16, 2.0, 8, 3.0, (512, 128), 4096, 1.0, 120.0)
QUICK = Scale(2, 48, 192, 2, 0.8, 2, 0.8, (64, 32), 512, 0.1, 20.0)


def arms(scale: Scale) -> dict[str, list[str]]:
    """Serve flags per arm; every arm uses two cores."""
    common = ["--max-model-len", str(scale.max_model_len), "--kv-cache-memory", str(scale.kv_cache_gib),
              "--no-prefix-caching"]
    colocated = ["--colocated-workers", "1", "--cores-per-worker", "2"]
    out = {"colocated": [*colocated, "--no-chunked-prefill", "--max-num-batched-tokens", str(scale.max_model_len)]}
    for size in scale.chunk_sizes:
        out[f"colocated_chunk_{size}"] = [*colocated, "--max-num-batched-tokens", str(size)]
    out["pd"] = ["--prefill-workers", "1", "--decode-workers", "1", "--cores-per-worker", "1"]
    return {name: [*flags, *common] for name, flags in out.items()}


@dataclass(frozen=True)
class ArmRun:
    streams: tuple[StreamTrace, ...]
    prefills: tuple[RequestOutput, ...]
    prefill_send_s: tuple[float, ...]  # seconds since the run started
    epoch_at_start: float  # time.time() at the run's start, to place server timestamps


async def run_arm_load(url: str, scale: Scale, seed: int) -> ArmRun:
    """The workload against one running server."""
    tokenizer = load_tokenizer(None)
    model = (await list_models(url, None))[0]
    end_s = scale.warmup_s + scale.num_prefills * scale.period_s
    prefills = random_requests(tokenizer, scale.num_prefills, scale.long_prompt_len, scale.long_output_len, 0.0,
                               seed + 1)
    config = ClientConfig(api_url=url + "/v1/completions", model=model, is_chat=False, ignore_eos=True,
                          return_timing=True, timeout_s=scale.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        run_start = time.perf_counter()
        epoch_at_start = time.time()
        slots = [
            asyncio.create_task(run_slot(session, config, tokenizer, slot, scale.num_streams, scale.stream_output_len,
                                         run_start, end_s))
            for slot in range(scale.num_streams)
        ]
        sends, prefill_tasks = [], []
        for i, request in enumerate(prefills):
            await asyncio.sleep(max(0.0, scale.warmup_s + i * scale.period_s - (time.perf_counter() - run_start)))
            sends.append(time.perf_counter() - run_start)
            prefill_tasks.append(asyncio.create_task(send_request(session, config, request, run_start)))
        traces = [trace for slot_traces in await asyncio.gather(*slots) for trace in slot_traces]
        outputs = await asyncio.gather(*prefill_tasks)
    return ArmRun(tuple(traces), tuple(outputs), tuple(sends), epoch_at_start)


def itl_gaps(run: ArmRun, from_s: float) -> list[tuple[float, float]]:
    """(end of gap, gap length) in seconds for every gap of every stream ending after ``from_s``."""
    gaps = []
    for trace in run.streams:
        times = trace.chunk_times_s
        gaps += [(times[i], times[i] - times[i - 1]) for i in range(1, len(times)) if times[i] >= from_s]
    return sorted(gaps)


def summarize_arm(run: ArmRun, scale: Scale) -> dict:
    """The per-arm keys of results.json (milliseconds)."""
    gaps_ms = np.asarray([gap for _, gap in itl_gaps(run, scale.warmup_s)]) * 1e3
    prefill_ms = [float(o.timing["prefill_ms"]) for o in run.prefills if o.success and o.timing]
    errors = [t.error for t in run.streams if t.error] + [o.error for o in run.prefills if not o.success]
    p50 = float(np.percentile(gaps_ms, 50)) if gaps_ms.size else 0.0
    p99 = float(np.percentile(gaps_ms, 99)) if gaps_ms.size else 0.0
    return {
        "itl_p50_ms": p50,
        "itl_p99_ms": p99,
        "itl_p99_over_p50": p99 / p50 if p50 else None,
        "itl_max_ms": float(gaps_ms.max()) if gaps_ms.size else 0.0,
        "itl_mean_ms": float(gaps_ms.mean()) if gaps_ms.size else 0.0,
        "num_itl_samples": int(gaps_ms.size),
        "share_of_gaps_over_5x_p50": float((gaps_ms > STALL_FACTOR * p50).mean()) if gaps_ms.size else 0.0,
        "prefill_ms": statistics.median(prefill_ms) if prefill_ms else None,
        "prefill_ms_each": prefill_ms,
        "long_ttft_ms_each": [o.ttft_s * 1e3 for o in run.prefills if o.success],
        "num_errors": len(errors),
        "errors": errors[:5],
    }


def arm_series(run: ArmRun) -> dict[str, list]:
    """What the plots draw, in seconds since the run started (and ms for gaps): every gap, the
    long prefills' send times and their compute spans from the server's timing."""
    gaps = itl_gaps(run, 0.0)
    spans = [
        (out.timing["prefill_start"] - run.epoch_at_start, out.timing["prefill_end"] - run.epoch_at_start)
        for out in run.prefills
        if out.success and out.timing and out.timing.get("prefill_start") and out.timing.get("prefill_end")
    ]
    return {
        "gap_end_s": [end for end, _ in gaps],
        "gap_ms": [gap * 1e3 for _, gap in gaps],
        "prefill_send_s": list(run.prefill_send_s),
        "prefill_compute_s": spans,
    }


def run(out_dir: Path, quick: bool) -> str:
    """Run every arm on a fresh server, then write results.json, report.md and the plots."""
    experiment = begin(NAME, out_dir, quick)
    scale = QUICK if quick else FULL
    results: dict[str, dict] = {}
    series: dict[str, dict] = {}
    commands: dict[str, str] = {}
    for name, flags in arms(scale).items():
        server = start_server(flags, out_dir / "logs" / name)
        try:
            arm_run = asyncio.run(run_arm_load(server.url, scale, seed=0))
        finally:
            stop_server(server)
        commands[name] = server.command
        results[name] = summarize_arm(arm_run, scale)
        series[name] = arm_series(arm_run)
        print(f"{name}: ITL p50 {results[name]['itl_p50_ms']:.1f} ms, p99 {results[name]['itl_p99_ms']:.1f} ms, "
              f"long prefill {results[name]['prefill_ms']} ms", flush=True)
    plots = write_plots(series, scale.warmup_s, out_dir)
    report = build_report(results, scale, commands, experiment, [p.name for p in plots])
    write_outputs(out_dir, results, report)
    write_json(out_dir / "series.json", series)
    return report
