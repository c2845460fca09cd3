"""1P1D on one host against 1P1D across a shaped 10 Gbit/s link, side by side.

    python benchmarks/cross_host.py [--prompt-len 2048] [--output-len 32] [--requests 6] [--rate 10gbit]

Same host: ``epdserve serve --prefill-workers 1 --decode-workers 1`` with the default
``--kv-transport auto`` (the two workers share a node: KV goes through shared memory).
Cross host: the same server, its prefill and decode workers then replaced by two started by
hand in two network namespaces joined by a veth pair shaped to ``--rate`` (tc), each proving
the cluster secret from the server's key file; KV crosses the link over TCP, layer by layer.
Both arms run the same requests one at a time (random prompts of ``--prompt-len`` tokens,
``--output-len`` tokens each, EOS ignored) and report TTFT, the transfer time left exposed
(the server's ``timing.exposed_transfer_ms``) and its share of TTFT, and ITL P50/P99.

Needs root (ip netns, tc). Prints one JSON object; the table in docs/benchmarks.md comes from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import aiohttp
import httpx

from epdserve.bench.client import ClientConfig, list_models, send_request
from epdserve.bench.experiments.launch import metric_value, start_server, stop_server
from epdserve.bench.experiments.netns import create_veth_link, delete_veth_link
from epdserve.bench.experiments.ns_workers import move_pd_workers, stop_namespaced
from epdserve.bench.workloads import load_tokenizer, random_requests

KV_BYTES = "epdserve_kv_transfer_bytes_total"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(url: str, prompt_len: int, output_len: int, num_requests: int) -> dict:
    tokenizer = load_tokenizer(None)
    model = (await list_models(url, None))[0]
    config = ClientConfig(api_url=url + "/v1/completions", model=model, is_chat=False, ignore_eos=True,
                          return_timing=True, timeout_s=600)
    ttft, exposed, share, itl, errors = [], [], [], [], []
    async with aiohttp.ClientSession() as session:
        warmup = random_requests(tokenizer, 1, prompt_len, 2, 0.0, seed=99)[0]
        await send_request(session, config, warmup, 0.0)
        for request in random_requests(tokenizer, num_requests, prompt_len, output_len, 0.0, seed=1):
            out = await send_request(session, config, request, 0.0)
            if not out.success or not out.timing:
                errors.append(out.error or "no timing")
                continue
            ttft.append(out.ttft_s * 1e3)
            exposed.append(float(out.timing["exposed_transfer_ms"]))
            share.append(exposed[-1] / ttft[-1])
            itl.extend(gap * 1e3 for gap in out.itl_s)
    return {
        "ttft_ms_median": statistics.median(ttft) if ttft else None,
        "exposed_ms_median": statistics.median(exposed) if exposed else None,
        "exposed_share_of_ttft_median": statistics.median(share) if share else None,
        "itl_ms_p50": _pct(itl, 0.5) if itl else None,
        "itl_ms_p99": _pct(itl, 0.99) if itl else None,
        "num_requests": len(ttft),
        "errors": errors[:3],
    }


def run_arm(name: str, args: argparse.Namespace, log_root: Path) -> dict:
    flags = ["--prefill-workers", "1", "--decode-workers", "1", "--cores-per-worker", "1",
             "--max-model-len", str(max(4096, 2 * args.prompt_len)), "--kv-cache-memory", "0.5",
             "--no-prefix-caching"]
    server = start_server(flags, log_root / name)
    link = moved = None
    try:
        if name == "cross-host":
            link = create_veth_link(args.rate)
            moved = move_pd_workers(server, link, flags, layerwise=True)
        before = metric_value(server, KV_BYTES)
        row = asyncio.run(measure(server.url, args.prompt_len, args.output_len, args.requests))
        # The warm-up request's KV counts too (its prompt has the same length).
        row["kv_bytes_per_request"] = (metric_value(server, KV_BYTES) - before) / (row["num_requests"] + 1)
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        row["kv_transports"] = sorted({line.split('transport="')[1].split('"')[0] for line in text.splitlines()
                                       if line.startswith(KV_BYTES + "{")})
    finally:
        if moved is not None:
            stop_namespaced(moved)
        stop_server(server)
        if link is not None:
            delete_veth_link(link)
    return {"arm": name, **row, "command": server.command + (f" (workers moved across a {args.rate} veth link)"
                                                             if name == "cross-host" else "")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--rate", default="10gbit", help="tc rate of the cross-host link")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args()
    log_root = Path(args.log_dir or tempfile.mkdtemp(prefix="cross-host-"))
    rows = [run_arm(name, args, log_root) for name in ("same-host", "cross-host")]
    print(json.dumps({"prompt_len": args.prompt_len, "output_len": args.output_len, "rate": args.rate,
                      "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
