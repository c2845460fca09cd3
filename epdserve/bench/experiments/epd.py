"""``epd``: does an E/P/D split pay for its extra hop on the same cores?

Arms (each on a fresh server, all on the same two cores; requests one at a time, so TTFT
measures the pipeline and not queueing):

    colocated                 one worker on both cores, encodes images in-process (2 threads)
    epd                       encode | prefill | decode workers, one core each (decode shares
                              core 0 with encode); prefill runs up to the first image not yet
                              embedded
    epd_no_pipeline           the same, but prefill waits for every image of the request
    epd_no_pipeline_chunk256  (full run) epd_no_pipeline with prefill cut into 256-token chunks,
                              about the one-image pieces pipelined prefill runs: what cutting costs
    e_colocated               (full run) encode worker on core 0, colocated worker on core 1
    epd_batch2                (full run) epd with two images per encoder forward pass

Workloads: ``small`` (one small image per request) and ``multi`` (several one-tile images),
each with a short random text prompt and ``ignore_eos``. The images are generated once and
every arm gets the same requests; every image is distinct, so no encoder-cache hits. Byte
counts come from ``/metrics`` before and after each workload's measured requests:

    embedding bytes per image   epdserve_embedding_transfer_bytes_total / epdserve_images_total
    KV bytes per request        epdserve_kv_transfer_bytes_total / requests
"""

from __future__ import annotations

import asyncio
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from epdserve.bench.client import ClientConfig, list_models, send_request
from epdserve.bench.experiments.epd_report import NAME, ImageLoad, Scale, build_report, write_plots
from epdserve.bench.experiments.launch import (
    RunningServer,
    list_workers,
    metric_value,
    start_server,
    stop_server,
)
from epdserve.bench.experiments.report import begin, machine_ticks, process_ticks, write_outputs
from epdserve.bench.metrics import RequestOutput
from epdserve.bench.mm_workloads import random_mm_requests
from epdserve.bench.workloads import SampleRequest, load_tokenizer

EMBED_BYTES_METRIC = "epdserve_embedding_transfer_bytes_total"
KV_BYTES_METRIC = "epdserve_kv_transfer_bytes_total"
IMAGES_METRIC = "epdserve_images_total"
# Server timing keys (milliseconds) averaged per cell; see epdserve/router/timing.py.
BREAKDOWN_KEYS = ("queue_ms", "encode_ms", "embed_transfer_ms", "prefill_overlap_ms", "prefill_ms",
                  "kv_blocking_ms", "exposed_transfer_ms", "first_token_ms", "ttft_ms")
SEED = 0


FULL = Scale((ImageLoad("small", 1, 256, 256), ImageLoad("multi", 8, 512, 512)), 10, 2, 32, 8, 4096, 0.5, 300.0,
             True)
# Quick: one request per cell (two per arm); server starts take most of its time.
QUICK = Scale((ImageLoad("small", 1, 64, 64), ImageLoad("multi", 2, 64, 64)), 1, 0, 16, 2, 1024, 0.05, 60.0,
              False)


def arms(scale: Scale) -> dict[str, list[str]]:
    """Serve flags per arm; every arm runs on the same two cores."""
    common = ["--max-model-len", str(scale.max_model_len), "--kv-cache-memory", str(scale.kv_cache_gib),
              "--no-prefix-caching", "--max-images-per-request", str(max(load.num_images for load in scale.loads))]
    epd = ["--encode-workers", "1", "--prefill-workers", "1", "--decode-workers", "1", "--cores-per-worker", "1"]
    out = {
        "colocated": ["--colocated-workers", "1", "--cores-per-worker", "2", "--vision", "default"],
        "epd": epd,
        "epd_no_pipeline": [*epd, "--no-encode-pipeline"],
    }
    if scale.has_extra_arms:
        out["epd_no_pipeline_chunk256"] = [*epd, "--no-encode-pipeline", "--max-num-batched-tokens", "256"]
        out["e_colocated"] = ["--encode-workers", "1", "--colocated-workers", "1", "--cores-per-worker", "1"]
        out["epd_batch2"] = [*epd, "--encode-batch-images", "2"]
    return {name: [*flags, *common] for name, flags in out.items()}


def workload_requests(scale: Scale) -> dict[str, list[SampleRequest]]:
    """Warm-up plus measured requests per workload, generated once for every arm."""
    tokenizer = load_tokenizer(None)
    return {
        load.name: random_mm_requests(tokenizer, scale.num_warmup + scale.num_requests, scale.prompt_len,
                                      scale.output_len, 0.0, SEED + 100 * i, load.num_images, 0.0,
                                      [(load.width, load.height)])
        for i, load in enumerate(scale.loads)
    }


@dataclass(frozen=True)
class CellRun:
    outputs: tuple[RequestOutput, ...]  # the measured requests, in order
    embedding_bytes: float  # /metrics deltas over the measured requests
    kv_bytes: float
    num_images: float
    other_cpu_share: float  # of all CPU time during the measured requests, used outside this experiment


def cpu_ticks(pids: list[int]) -> tuple[int, int, int]:
    """(all CPU time, busy CPU time, CPU time of ``pids`` so far), in clock ticks. Two readings
    give the share of the machine that other work took in between."""
    return (*machine_ticks(), process_ticks(pids))


def other_share(before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
    total, busy, ours = (a - b for a, b in zip(after, before))
    return max(0.0, (busy - ours) / total) if total > 0 else 0.0


def _counters(server: RunningServer) -> tuple[float, float, float]:
    return (metric_value(server, EMBED_BYTES_METRIC), metric_value(server, KV_BYTES_METRIC),
            metric_value(server, IMAGES_METRIC))


async def run_arm_load(server: RunningServer, requests: dict[str, list[SampleRequest]], scale: Scale
                       ) -> dict[str, CellRun]:
    """Every workload against one running server, one request at a time."""
    model = (await list_models(server.url, None))[0]
    config = ClientConfig(api_url=server.url + "/v1/chat/completions", model=model, is_chat=True, ignore_eos=True,
                          return_timing=True, timeout_s=scale.request_timeout_s)
    pids = [os.getpid(), server.process.pid, *(w["pid"] for w in list_workers(server))]
    cells = {}
    async with aiohttp.ClientSession() as session:
        for name, load_requests in requests.items():
            for request in load_requests[: scale.num_warmup]:
                await send_request(session, config, request, 0.0)
            before, ticks_before = _counters(server), cpu_ticks(pids)
            outputs = [await send_request(session, config, request, 0.0)
                       for request in load_requests[scale.num_warmup :]]
            after, ticks_after = _counters(server), cpu_ticks(pids)
            embedding_bytes, kv_bytes, num_images = (a - b for a, b in zip(after, before))
            cells[name] = CellRun(tuple(outputs), embedding_bytes, kv_bytes, num_images,
                                  other_share(ticks_before, ticks_after))
    return cells


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize_cell(cell: CellRun) -> dict:
    """One (arm, workload) entry of results.json; times in milliseconds."""
    ok = [o for o in cell.outputs if o.success and o.timing]
    errors = [o.error or "no timing returned" for o in cell.outputs if not (o.success and o.timing)]
    ttft_ms = [o.ttft_s * 1e3 for o in ok]
    breakdown = {key: _mean([float(o.timing.get(key, 0.0)) for o in ok]) for key in BREAKDOWN_KEYS}
    num_requests = len(cell.outputs)
    return {
        "ttft_p50_ms": _percentile(ttft_ms, 50),
        "ttft_p99_ms": _percentile(ttft_ms, 99),
        "ttft_mean_ms": _mean(ttft_ms),
        "e2e_p50_ms": _percentile([o.latency_s * 1e3 for o in ok], 50),
        "ttft_ms_each": ttft_ms,
        "breakdown_mean_ms": breakdown,
        # client TTFT beyond the server's: HTTP, image upload and parsing before ``arrived``.
        "client_minus_server_ms": _mean([o.ttft_s * 1e3 - float(o.timing.get("ttft_ms", 0.0)) for o in ok]),
        "num_requests": num_requests,
        "other_cpu_share": cell.other_cpu_share,
        "num_errors": len(errors),
        "errors": errors[:5],
        "prompt_tokens": _mean([float(o.prompt_len) for o in ok]),
        "num_images_per_request": _mean([float(o.timing.get("num_images", 0)) for o in ok]),
        "num_encoder_cache_hits": sum(int(o.timing.get("num_encoder_cache_hits", 0)) for o in ok),
        "embedding_bytes_per_image": cell.embedding_bytes / cell.num_images if cell.num_images else None,
        "kv_bytes_per_request": cell.kv_bytes / num_requests if num_requests else None,
        "e_to_p_over_p_to_d": cell.embedding_bytes / cell.kv_bytes if cell.kv_bytes else None,
        "timeline": _median_timeline(ok),
    }


def _median_timeline(ok: list[RequestOutput]) -> dict | None:
    """The median-TTFT request's server spans in ms since it arrived, for the timeline plot."""
    if not ok:
        return None
    out = sorted(ok, key=lambda o: o.ttft_s)[len(ok) // 2]
    t = out.timing
    arrived = t.get("arrived") or 0.0

    def since(key: str) -> float | None:
        value = t.get(key) or 0.0
        return (value - arrived) * 1e3 if value and arrived else None

    spans = {key: since(key) for key in ("encode_start", "encode_end", "prefill_start", "prefill_end", "first_token")}
    return spans | {"client_ttft_ms": out.ttft_s * 1e3}


def summarize_arm(cells: dict[str, dict], runs: dict[str, CellRun]) -> dict:
    """Per-arm totals over every workload's measured requests."""
    embedding_bytes = sum(r.embedding_bytes for r in runs.values())
    kv_bytes = sum(r.kv_bytes for r in runs.values())
    num_images = sum(r.num_images for r in runs.values())
    num_requests = sum(len(r.outputs) for r in runs.values())
    return {
        **cells,
        "embedding_bytes_per_image": embedding_bytes / num_images if num_images else None,
        "kv_bytes_per_request": kv_bytes / num_requests if num_requests else None,
        "e_to_p_over_p_to_d": embedding_bytes / kv_bytes if kv_bytes else None,
    }


def expected_bytes(scale: Scale) -> dict:
    """What the formulas give: embedding bytes per image = image tokens x hidden x dtype bytes,
    KV bytes per token = 2 (K and V) x layers x KV heads x head dim x dtype bytes, in the dtype
    the servers' ``--dtype auto`` takes here (bf16: 2 B; float32 on a CPU without bf16: 4 B)."""
    import torch

    from epdserve.config import resolve_device_name, resolve_dtype_name
    from epdserve.models.image_processing import image_grid
    from epdserve.models.loader import load_model_info
    from epdserve.models.multimodal import load_multimodal_spec

    dtype = resolve_dtype_name("auto", resolve_device_name("auto"))
    dtype_bytes = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    spec = load_multimodal_spec(None, "default")
    model = load_model_info(None).spec
    loads = {}
    for load in scale.loads:
        grid = image_grid(load.width, load.height, spec.policy)
        loads[load.name] = {"num_tiles": grid.num_tiles, "num_image_tokens": spec.num_image_tokens(grid),
                            "embedding_bytes_per_image": spec.embedding_bytes(grid, dtype_bytes)}
    return {
        "dtype": dtype,
        "hidden_size": spec.hidden_size,
        "tokens_per_tile": spec.vision.tokens_per_tile,
        "kv_bytes_per_token": 2 * model.num_layers * model.num_kv_heads * model.head_dim * dtype_bytes,
        "loads": loads,
    }


def _ratio(results: dict, numerator: str, denominator: str, load: str) -> float | None:
    top = results.get(numerator, {}).get(load, {}).get("ttft_p50_ms")
    bottom = results.get(denominator, {}).get(load, {}).get("ttft_p50_ms")
    return top / bottom if top is not None and bottom else None


def add_ratios(results: dict, scale: Scale) -> dict:
    """The top-level TTFT P50 ratios (the loads are named small and multi in every scale)."""
    small, multi = scale.loads[0].name, scale.loads[-1].name
    return {
        **results,
        "pipelined_over_unpipelined_multi": _ratio(results, "epd", "epd_no_pipeline", multi),
        "epd_over_colocated_small": _ratio(results, "epd", "colocated", small),
        "epd_over_colocated_multi": _ratio(results, "epd", "colocated", multi),
    }


def run(out_dir: Path, quick: bool) -> str:
    """Run every arm on a fresh server, then write results.json, report.md and the plots."""
    experiment = begin(NAME, out_dir, quick)
    scale = QUICK if quick else FULL
    requests = workload_requests(scale)
    results: dict[str, dict] = {}
    commands: dict[str, str] = {}
    for name, flags in arms(scale).items():
        server = start_server(flags, out_dir / "logs" / name)
        try:
            runs = asyncio.run(run_arm_load(server, requests, scale))
        finally:
            stop_server(server)
        commands[name] = server.command
        results[name] = summarize_arm({load: summarize_cell(r) for load, r in runs.items()}, runs)
        print(name + ": " + ", ".join(
            f"{load} TTFT p50 {_fmt_ms(results[name][load]['ttft_p50_ms'])}" for load in runs), flush=True)
    results = add_ratios(results, scale) | {"expected": expected_bytes(scale)}
    plots = write_plots(results, scale, out_dir)
    report = build_report(results, scale, commands, experiment, [p.name for p in plots])
    write_outputs(out_dir, results, report)
    return report


def _fmt_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f} ms"
