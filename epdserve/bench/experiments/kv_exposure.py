"""``kv-exposure``: how much of the P/D KV hand-off stays on the critical path.

For each arm (transport x layer-wise or bulk) a fresh 1P1D server gets one request at a time
for each prompt length (``max_tokens`` 2, so the second token waits for the hand-off):

    kv_bytes            /metrics ``epdserve_kv_transfer_bytes_total`` before and after
    theoretical_ms      kv_bytes / the transport's measured rate (bandwidth.py)
    exposed_ms          the server's ``timing.exposed_transfer_ms``
    ttft_ms             client-side time to the first token
    ttft_minus_prefill_ms   TTFT less the server's prefill time: queueing, first-token output, HTTP
    handoff_gap_ms      client-side gap between the first and second tokens (the decode worker
                        starts only once the KV has landed)

Arms: shm and tcp on loopback; and, where the machine lets this process create network
namespaces, tcp across a veth pair shaped to 10 Gbit/s (netns.py, ns_workers.py).
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import torch

from epdserve.bench import BenchError
from epdserve.bench.client import ClientConfig, list_models, send_request
from epdserve.bench.experiments import bandwidth
from epdserve.bench.experiments.kv_exposure_report import NAME, build_report, write_plot
from epdserve.bench.experiments.launch import RunningServer, metric_value, start_server, stop_server
from epdserve.bench.experiments.netns import NetnsUnavailable, VethLink, create_veth_link, delete_veth_link
from epdserve.bench.experiments.ns_workers import move_pd_workers, stop_namespaced
from epdserve.bench.experiments.report import begin, write_outputs
from epdserve.bench.workloads import load_tokenizer, random_requests

KV_BYTES_METRIC = "epdserve_kv_transfer_bytes_total"
VETH_RATE = "10gbit"
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Scale:
    prompt_lens: tuple[int, ...]  # tokens
    num_repeats: int  # requests per prompt length; rows hold medians
    max_model_len: int
    kv_cache_gib: float
    bandwidth_bytes: int  # bytes per bandwidth measurement
    use_veth: bool  # also run tcp across a shaped veth link (when the machine allows it)


FULL = Scale((256, 512, 1024, 2048), 3, 4096, 0.5, 64 * 2**20, True)
QUICK = Scale((32, 96), 1, 256, 0.05, 8 * 2**20, False)


@dataclass(frozen=True)
class Arm:
    transport: str  # "shm", "tcp" (loopback) or "tcp-veth-10gbit"
    layerwise: bool

    def serve_flags(self, scale: Scale) -> list[str]:
        flags = ["--prefill-workers", "1", "--decode-workers", "1", "--cores-per-worker", "1",
                 "--kv-transport", "shm" if self.transport == "shm" else "tcp",
                 "--max-model-len", str(scale.max_model_len), "--kv-cache-memory", str(scale.kv_cache_gib),
                 "--no-prefix-caching"]
        return flags if self.layerwise else [*flags, "--no-layerwise"]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


async def measure_arm(server: RunningServer, arm: Arm, scale: Scale, gbps: float) -> list[dict]:
    """One row per prompt length: medians over ``scale.num_repeats`` sequential requests."""
    tokenizer = load_tokenizer(None)
    model = (await list_models(server.url, None))[0]
    config = ClientConfig(api_url=server.url + "/v1/completions", model=model, is_chat=False, ignore_eos=True,
                          return_timing=True, timeout_s=REQUEST_TIMEOUT_S)
    rows = []
    async with aiohttp.ClientSession() as session:
        warmup = random_requests(tokenizer, 1, min(scale.prompt_lens), 2, 0.0, seed=1000)[0]
        await send_request(session, config, warmup, 0.0)  # first connection, first allocation
        for i, prompt_len in enumerate(scale.prompt_lens):
            requests = random_requests(tokenizer, scale.num_repeats, prompt_len, 2, 0.0, seed=i)
            samples: dict[str, list[float]] = {k: [] for k in ("kv_bytes", "exposed_ms", "ttft_ms", "gap_ms",
                                                               "prefill_ms", "kv_transfer_ms", "outside_ms")}
            errors = []
            for request in requests:
                before = metric_value(server, KV_BYTES_METRIC)
                out = await send_request(session, config, request, 0.0)
                if not out.success or not out.timing:
                    errors.append(out.error or "no timing returned")
                    continue
                samples["kv_bytes"].append(metric_value(server, KV_BYTES_METRIC) - before)
                samples["exposed_ms"].append(float(out.timing["exposed_transfer_ms"]))
                samples["prefill_ms"].append(float(out.timing["prefill_ms"]))
                samples["kv_transfer_ms"].append(float(out.timing["kv_transfer_ms"]))
                samples["ttft_ms"].append(out.ttft_s * 1e3)
                samples["outside_ms"].append(out.ttft_s * 1e3 - float(out.timing["prefill_ms"]))
                samples["gap_ms"].extend(gap * 1e3 for gap in out.itl_s[:1])
            rows.append(_row(arm, prompt_len, gbps, samples, errors))
    return rows


def _row(arm: Arm, prompt_len: int, gbps: float, samples: dict[str, list[float]], errors: list[str]) -> dict:
    kv_bytes = _median(samples["kv_bytes"])
    exposed_ms, ttft_ms = _median(samples["exposed_ms"]), _median(samples["ttft_ms"])
    return {
        "transport": arm.transport,
        "layerwise": arm.layerwise,
        "prompt_len": prompt_len,
        "kv_bytes": int(kv_bytes) if kv_bytes is not None else None,
        "bandwidth_gbps": gbps,
        "theoretical_ms": kv_bytes / (gbps * 1e9) * 1e3 if kv_bytes is not None else None,
        "exposed_ms": exposed_ms,
        "ttft_ms": ttft_ms,
        "exposed_share_of_ttft": exposed_ms / ttft_ms if exposed_ms is not None and ttft_ms else None,
        "prefill_ms": _median(samples["prefill_ms"]),
        "ttft_minus_prefill_ms": _median(samples["outside_ms"]),
        "kv_transfer_ms": _median(samples["kv_transfer_ms"]),
        "handoff_gap_ms": _median(samples["gap_ms"]),
        "handoff_gap_max_ms": max(samples["gap_ms"]) if samples["gap_ms"] else None,
        "num_requests": len(samples["ttft_ms"]),
        "errors": errors[:3],
    }


def measure_bandwidths(scale: Scale, link: VethLink | None) -> dict[str, float]:
    """GB/s per transport, on one thread (each worker has one core)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rates = {
            "shm": bandwidth.shm_memcpy_gbps(scale.bandwidth_bytes),
            "tcp": bandwidth.tcp_stream_gbps(scale.bandwidth_bytes),
        }
        if link is not None:
            rates[f"tcp-veth-{link.rate}"] = bandwidth.tcp_stream_gbps(
                scale.bandwidth_bytes, host=link.decode_addr, listen_ns=link.decode_ns, connect_ns=link.prefill_ns
            )
        return rates
    finally:
        torch.set_num_threads(num_threads)


def run_arm(arm: Arm, scale: Scale, gbps: float, link: VethLink | None, log_dir: Path) -> tuple[list[dict], str]:
    """Start the arm's server (moving its workers across the veth link when given one), measure
    it, stop it; returns the rows and the serve command."""
    flags = arm.serve_flags(scale)
    server = start_server(flags, log_dir)
    moved = None
    try:
        if link is not None:
            moved = move_pd_workers(server, link, flags, arm.layerwise)
        rows = asyncio.run(measure_arm(server, arm, scale, gbps))
    finally:
        if moved is not None:
            stop_namespaced(moved)
        stop_server(server)
    return rows, server.command


def run(out_dir: Path, quick: bool) -> str:
    """Every arm, then results.json (a list of rows), report.md and kv_exposure.png."""
    experiment = begin(NAME, out_dir, quick)
    scale = QUICK if quick else FULL
    link: VethLink | None = None
    veth_note = "the quick mode skips it"
    if scale.use_veth:
        try:
            link = create_veth_link(VETH_RATE)
            veth_note = ""
        except NetnsUnavailable as e:
            veth_note = f"this machine refused the namespace set-up: {e}"
    rows: list[dict] = []
    commands: dict[str, str] = {}
    try:
        rates = measure_bandwidths(scale, link)
        arms = [Arm(t, lw) for t in ("shm", "tcp") for lw in (True, False)]
        if link is not None:
            arms += [Arm(f"tcp-veth-{link.rate}", lw) for lw in (True, False)]
        for arm in arms:
            label = f"{arm.transport} {'layer-wise' if arm.layerwise else 'bulk'}"
            arm_link = link if arm.transport.startswith("tcp-veth") else None
            try:
                arm_rows, commands[label] = run_arm(arm, scale, rates[arm.transport], arm_link,
                                                    out_dir / "logs" / label.replace(" ", "_"))
            except BenchError as e:
                if arm_link is None:
                    raise
                veth_note = f"{label}: {e}"  # the namespaced workers did not come up
                continue
            rows += arm_rows
            print(f"{label}: " + ", ".join(f"{r['prompt_len']} tok exposed {r['exposed_ms']} ms" for r in arm_rows),
                  flush=True)
    finally:
        if link is not None:
            delete_veth_link(link)
    plot = write_plot(rows, out_dir)
    report = build_report(rows, rates, commands, veth_note, experiment, plot.name)
    write_outputs(out_dir, rows, report)
    return report
