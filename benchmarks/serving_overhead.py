"""What serving costs beyond the model: served against offline output tokens/s on one workload,
and the CPU time per output token each process spends.

    python benchmarks/serving_overhead.py [--num-prompts 64] [--concurrency 16] [--input-len 256]
        [--output-len 128] [--arms offline,colocated,1p1d] [--profile-dir DIR] [--json FILE]

One run, arms one after another on the same cores:

- offline: the engine in this process, ``max_num_seqs`` = the concurrency (the batch a server
  at that concurrency can form), all cores;
- colocated: ``epdserve serve --colocated-workers 1 --cores-per-worker 2``, loaded by
  epdserve's client (in this process) at that concurrency, random prompts, EOS ignored;
- 1p1d: ``epdserve serve --prefill-workers 1 --decode-workers 1 --cores-per-worker 1``.

For each served arm: output tok/s and its ratio to offline; CPU ms per output token of the
router, of each worker, and of the client (user + system time from /proc, over the load);
the worker's CPU per token less the offline engine's is what a worker spends outside the
model (messages, heartbeats, polling). With ``--profile-dir`` (py-spy installed), the router
and the worker are sampled during the load: a flame graph each, and a table of the router's
samples by what they were doing (HTTP, JSON, the event loop, ZMQ, metrics, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from epdserve.bench.client import ClientConfig, run_benchmark
from epdserve.bench.experiments.launch import start_server, stop_server
from epdserve.bench.workloads import SampleRequest, load_tokenizer, random_requests
from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.sampling import SamplingParams

SERVED = {
    "colocated": ["--colocated-workers", "1", "--cores-per-worker", "2"],
    "1p1d": ["--prefill-workers", "1", "--decode-workers", "1", "--cores-per-worker", "1"],
}
CLK_TCK = os.sysconf("SC_CLK_TCK")

# What a router sample was doing: the first pattern found in its stack, leaf first.
CATEGORIES = [
    ("JSON (SSE chunks, bodies)", ("json/", "json.encoder", "orjson", "dumps")),
    ("msgspec (control messages)", ("msgspec",)),
    ("ZMQ sockets", ("zmq/",)),
    ("Prometheus metrics", ("prometheus_client",)),
    ("tokenizer", ("tokenizers", "tokenizer.py")),
    ("HTTP (uvicorn, h11, starlette, fastapi)", ("uvicorn", "h11", "httptools", "starlette", "fastapi", "anyio")),
    ("router logic (flow, dispatch, api)", ("epdserve/router",)),
    ("event loop (asyncio)", ("asyncio/", "uvloop")),
]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


def run_offline(args: argparse.Namespace, requests: list[SampleRequest]) -> dict:
    engine = LLMEngine(EngineArgs(max_num_seqs=args.concurrency))
    prompts = [engine.tokenizer.encode(r.prompt) for r in requests]  # as the server tokenizes them
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(max_tokens=4))
    cpu0, start = time.process_time(), time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
    num_out = sum(len(r[0].token_ids) for r in results)
    del engine
    return {"arm": "offline", "output_tokens_per_s": num_out / elapsed, "elapsed_s": elapsed,
            "num_output_tokens": num_out, "engine_cpu_ms_per_token": cpu / num_out * 1e3}


def _profile(pid: int, duration_s: int, out: Path) -> list[subprocess.Popen]:
    """py-spy on ``pid``: collapsed stacks to ``out`` (.raw) and a flame graph beside it (.svg)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return []
    return [subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(duration_s), "-r", "100", "--nonblocking",
                              "-f", fmt, "-o", str(out.with_suffix(suffix))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for fmt, suffix in (("raw", ".raw"), ("flamegraph", ".svg"))]


def categorize(raw: Path) -> dict[str, float]:
    """Share of samples per category, from py-spy's collapsed stacks (``frame;frame;... count``)."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        frames = stack.split(";")[::-1]  # leaf first
        for name, patterns in CATEGORIES:
            if any(p in frame for frame in frames for p in patterns):
                counts[name] += int(n)
                break
        else:
            counts["other"] += int(n)
    return {k: v / total for k, v in counts.most_common()} if total else {}


def run_served(arm: str, args: argparse.Namespace, requests: list[SampleRequest], offline: dict | None,
               log_dir: Path) -> dict:
    server = start_server([*SERVED[arm], "--max-num-seqs", str(args.concurrency)], log_dir / arm)
    try:
        workers = httpx.get(f"{server.url}/v1/workers", timeout=10).json()["data"]
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        config = ClientConfig(api_url=server.url + "/v1/completions", model=model, is_chat=False,
                              ignore_eos=True, max_concurrency=args.concurrency)
        asyncio.run(run_benchmark(config, requests[:2], [0.0, 0.0]))  # warm-up
        pids = {"router": server.process.pid, **{w["id"]: w["pid"] for w in workers}}
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        spies = []
        if args.profile_dir:
            expected = args.num_prompts * args.output_len / (0.8 * offline["output_tokens_per_s"]) if offline else 30
            duration = max(5, int(expected * 0.6))
            for name in ("router", workers[-1]["id"]):
                spies += _profile(pids[name], duration, Path(args.profile_dir) / f"{arm}-{name}.raw")
        client0 = time.process_time()
        run = asyncio.run(run_benchmark(config, requests, [0.0] * len(requests)))
        client_cpu = time.process_time() - client0
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        for spy in spies:
            spy.wait(120)
    finally:
        stop_server(server)
    failed = [o.error for o in run.outputs if not o.success]
    num_out = sum(o.output_tokens for o in run.outputs if o.success)
    row = {"arm": arm, "output_tokens_per_s": num_out / run.duration_s, "elapsed_s": run.duration_s,
           "num_output_tokens": num_out, "errors": failed[:3],
           "cpu_ms_per_token": {name: (after[name] - before[name]) / num_out * 1e3 for name in pids},
           "client_cpu_ms_per_token": client_cpu / num_out * 1e3}
    if offline:
        row["served_over_offline"] = row["output_tokens_per_s"] / offline["output_tokens_per_s"]
        worker_cpu = sum(v for k, v in row["cpu_ms_per_token"].items() if k != "router")
        row["worker_cpu_outside_model_ms_per_token"] = worker_cpu - offline["engine_cpu_ms_per_token"]
    if args.profile_dir:
        raw = Path(args.profile_dir) / f"{arm}-router.raw"
        if raw.exists():
            row["router_samples_by_category"] = categorize(raw)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--arms", default="offline,colocated,1p1d")
    parser.add_argument("--profile-dir", default=None, help="sample router and worker with py-spy into DIR")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    requests = random_requests(load_tokenizer(None), args.num_prompts, args.input_len, args.output_len, 0.0, seed=0)
    rows, offline = [], None
    log_dir = Path(tempfile.mkdtemp(prefix="serving-overhead-"))
    if "offline" in arms:
        offline = run_offline(args, requests)
        rows.append(offline)
        print(f"offline: {offline['output_tokens_per_s']:.1f} output tok/s", flush=True)
    for arm in arms:
        if arm in SERVED:
            row = run_served(arm, args, requests, offline, log_dir)
            rows.append(row)
            ratio = f" ({row['served_over_offline']:.0%} of offline)" if offline else ""
            print(f"{arm}: {row['output_tokens_per_s']:.1f} output tok/s{ratio}", flush=True)
    result = {"workload": vars(args), "rows": rows}
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
