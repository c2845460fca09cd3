"""What a JSON-schema constraint costs in serving: output tok/s with and without, epdserve and vLLM.

epdserve and vLLM-CPU, the same client and schema for both, in alternating rounds.

    python benchmarks/structured.py [--rounds 3] [--num-prompts 64] [--concurrency 16]
        [--input-len 256] [--max-tokens 512] [--unconstrained-output-len match|N] [--chat]
        [--skip-vllm] [--vllm-compact-json] [--out DIR] [--json FILE]

The client is vLLM's own (``vllm-cpu.sh bench serve``, as ``benchmarks/serve_vs_vllm.sh``),
against both servers: random dataset, ``--input-len`` tokens in (256), temperature 0,
``--concurrency`` requests in flight, seed 0, /v1/completions (``--chat``: /v1/chat/completions).
Each round starts each server once and runs both of its arms against it:

- constrained: every request carries ``response_format`` {"type": "json_schema", ...} with
  ``SCHEMA`` below (sent by ``--extra-body``, which also sends ``"ignore_eos": false``, since
  vLLM's client sets ``ignore_eos`` for the random dataset and a JSON output ends by itself),
  ``max_tokens`` = ``--max-tokens`` (512: a cap the schema's outputs stay well under, not a
  length target). Every output is parsed and checked against the schema; a failure (an error,
  a truncated or invalid JSON text) is counted in ``failures``.
- unconstrained: the same prompts, EOS ignored, ``max_tokens`` = the mean output length of
  the constrained arm just run on the same server (``--unconstrained-output-len match``) or a
  fixed N. The arms then decode the same number of tokens per prompt on average, so the ratio
  measures the constraint (grammar compile, per-step mask, the constrained sampler) and not a
  different prefill/decode mix: output tok/s falls with shorter outputs, as each prompt's
  prefill is spread over fewer tokens. The constrained arm's lengths vary per request (the JSON
  ends where the model closes it); with ``match`` the unconstrained arm's vary as much
  (``--random-range-ratio`` on the output only, uniform with the constrained arm's standard
  deviation): equal lengths finish a batch in lock step and then run pure decode steps, where
  staggered ones mix a prefill chunk into many decode steps, which alone raised TPOT by a third
  in a first run.

Fairness notes: both servers get the same prompts (vLLM's random dataset, seed 0), the same
request bodies and the same schema; each server's unconstrained length is matched to its own
constrained mean, which is reported beside each arm (the two servers' greedy outputs may
differ: epdserve's model and vLLM's converted copy are not bit-identical). epdserve compiles
JSON with no free whitespace; vLLM's xgrammar by default allows any whitespace between
tokens (``--vllm-compact-json`` starts vLLM with ``disable_any_whitespace`` to match
epdserve); its output lengths and failure counts show whether that mattered. The rounds
alternate which server goes first (the machine is shared and noisy); within a server the
constrained arm runs first because the unconstrained arm's length depends on it. Before the
arms, each server gets one untimed batch of ``--concurrency`` short unconstrained requests; each
arm's first request (vLLM's client's test request) also sends the schema, outside the timing.
The constrained outputs' lengths vary (45-231 tokens in a smoke run, mean ~110): use enough
prompts per slot (the default 64 at 16) to keep the drain at the end small.

Servers: epdserve ``serve --colocated-workers 1 --cores-per-worker 2`` (``--port 0``, the
repo's launcher), vLLM as serve_vs_vllm.sh starts it, on a free port; each is stopped by pid
(SIGINT, then a bounded wait). Reported per arm and round: output tok/s, mean output length,
mean and P99 TPOT, TTFT, failures; the summary has medians and min/max over the rounds and the
ratios epdserve constrained / unconstrained and epdserve constrained / vLLM constrained (the
goals: >= 0.90 and >= 1.0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

from epdserve.bench.experiments.launch import start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent

# An object of a few bounded strings, a bounded array and two bounded integers: outputs of
# about a hundred tokens that always close (every field is required and bounded).
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 48},
        "author": {"type": "string", "maxLength": 32},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "summary": {"type": "string", "maxLength": 160},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 5},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["title", "author", "year", "summary", "tags", "rating"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}

EPDSERVE_ARGS = ["--served-model-name", "smollm2", "--colocated-workers", "1", "--cores-per-worker", "2"]
PEER_DIR = Path(os.environ.get("PEER_DIR", Path.home() / ".cache" / "epdserve-peers"))
VLLM_STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
CLIENT_TIMEOUT_S = 1800.0
WARMUP_TOKENS = 16
SERVERS = ("epdserve", "vllm")
ARMS = ("unconstrained", "constrained")
KEYS = ("output_throughput", "mean_output_len", "mean_tpot_ms", "p99_tpot_ms", "mean_ttft_ms", "failures")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc), so they can be waited for after it exits."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # a zombie another parent reaps
                    return True
        except OSError:
            return True
        time.sleep(0.2)
    return False


def stop_vllm(process: subprocess.Popen) -> None:
    """SIGINT the API server (it stops its engine process), bounded waits, SIGKILL as a last resort."""
    kids = children(process.pid)
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for pid in kids:
        if not wait_gone(pid, STOP_TIMEOUT_S):
            os.kill(pid, signal.SIGKILL)


def start_vllm(model_dir: str, log: Path, compact_json: bool) -> tuple[subprocess.Popen, str]:
    """vLLM-CPU as serve_vs_vllm.sh starts it, on a free port; returns once /health answers."""
    port = free_port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    cmd = [str(PEER_DIR / "vllm-venv" / "bin" / "vllm"), "serve", model_dir, "--served-model-name", "smollm2",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096", "--dtype", "bfloat16",
           "--gpu-memory-utilization", "0.5"]
    if compact_json:
        cmd += ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
    with open(log, "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + VLLM_STARTUP_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {process.returncode}: {tail(log)}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return process, url
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM not healthy after {VLLM_STARTUP_TIMEOUT_S:g} s: {tail(log)}")
    except BaseException:
        stop_vllm(process)
        raise


def tail(path: Path, n: int = 15) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _validator():
    try:
        import jsonschema
    except ImportError:  # a dev dependency; without it outputs are only parsed
        return None
    return jsonschema.Draft202012Validator(SCHEMA)


VALIDATOR = _validator()


def json_failures(texts: list[str], errors: list[str]) -> tuple[int, list[str]]:
    """Outputs that errored, do not parse as JSON, or do not follow SCHEMA; a few examples."""
    bad, examples = 0, []
    for text, error in zip(texts, errors):
        why = error or ""
        if not why:
            try:
                value = json.loads(text)
                if VALIDATOR is not None:
                    problem = next(iter(VALIDATOR.iter_errors(value)), None)
                    why = f"schema: {problem.message}" if problem else ""
            except json.JSONDecodeError as e:
                why = f"not JSON ({e.msg}): {text[-80:]!r}"
        if why:
            bad += 1
            if len(examples) < 3:
                examples.append(why[:300])
    return bad, examples


async def _warm_up(url: str, concurrency: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

        async def one(i: int) -> None:
            body = {"model": "smollm2", "prompt": f"Warm-up request {i}: tell a story.", "max_tokens": WARMUP_TOKENS,
                    "temperature": 0, "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as response:
                await response.read()

        await asyncio.gather(*(one(i) for i in range(concurrency)))


def warm_up(url: str, concurrency: int) -> None:
    """One unconstrained batch of ``concurrency`` short requests, so that neither timed arm (the
    constrained one runs first) pays a fresh server's first-batch costs."""
    asyncio.run(_warm_up(url, concurrency))


def run_client(args: argparse.Namespace, name: str, url: str, model_dir: str, constrained: bool,
               output_len: int, output_range: float = 0.0) -> dict:
    """vLLM's load client, one arm; the row of numbers this benchmark reports."""
    extra_body = {"response_format": RESPONSE_FORMAT, "ignore_eos": False} if constrained else None
    cmd = [str(args.peer), "bench", "serve", "--backend", "openai-chat" if args.chat else "openai",
           "--base-url", url, "--model", "smollm2", "--tokenizer", model_dir,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.concurrency), "--seed", "0", "--temperature", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", str(args.out), "--result-filename", f"{name}.json"]
    if args.chat:
        cmd += ["--endpoint", "/v1/chat/completions"]
    if constrained:
        cmd += ["--extra-body", json.dumps(extra_body)]
    else:
        cmd += ["--ignore-eos"]
        if output_range > 0:
            cmd += ["--random-range-ratio", json.dumps({"input": 0.0, "output": round(output_range, 3)})]
    log = args.out / f"{name}.log"
    with open(log, "w") as out:
        done = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              timeout=CLIENT_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM's client failed ({done.returncode}) for {name}: {tail(log)}")
    result = json.loads((args.out / f"{name}.json").read_text())
    lens = [n for n in result.get("output_lens", []) if n]
    errors = result.get("errors") or [""] * len(result.get("generated_texts", []))
    row = {k: result.get(k) for k in ("completed", "failed", "duration", "total_output_tokens", "output_throughput",
                                      "mean_tpot_ms", "p99_tpot_ms", "mean_ttft_ms", "p99_ttft_ms", "p99_itl_ms")}
    row.update(max_tokens=output_len, mean_output_len=statistics.fmean(lens) if lens else 0.0,
               min_output_len=min(lens, default=0), max_output_len=max(lens, default=0),
               stdev_output_len=statistics.pstdev(lens) if lens else 0.0, output_range_ratio=output_range)
    if constrained:
        row["failures"], row["failure_examples"] = json_failures(result.get("generated_texts", []), errors)
        row["sample_output"] = next((t for t in result.get("generated_texts", []) if t), "")[:400]
    else:
        row["failures"] = int(result.get("failed") or 0)
    return row


def run_server_arms(args: argparse.Namespace, server: str, r: int, model_dir: str) -> dict[str, dict]:
    """Start ``server``, run its constrained then its unconstrained arm, stop it."""
    name = f"{server}_r{r}"
    start = time.perf_counter()
    if server == "epdserve":
        running = start_server(list(EPDSERVE_ARGS), args.out / f"{name}.server")
        url = running.url

        def stop() -> None:
            stop_server(running)

    else:
        process, url = start_vllm(model_dir, args.out / f"{name}.server.log", args.vllm_compact_json)

        def stop() -> None:
            stop_vllm(process)

    print(f"{name}: ready after {time.perf_counter() - start:.1f} s at {url}", flush=True)
    rows = {}
    try:
        warm_up(url, args.concurrency)
        rows["constrained"] = run_client(args, f"{name}_constrained", url, model_dir, True, args.max_tokens)
        match = args.unconstrained_output_len == "match"
        length = round(rows["constrained"]["mean_output_len"]) if match else int(args.unconstrained_output_len)
        # The same spread of lengths too: uniform over mean * [1 - r, 1 + r] has the constrained
        # arm's standard deviation when r = sqrt(3) * std / mean. Equal lengths would finish a
        # batch in lock step (one burst of prefills, then pure decode), staggered ones mix a
        # prefill chunk into many decode steps: TPOT differs by that alone.
        c = rows["constrained"]
        spread = min(0.95, math.sqrt(3) * c["stdev_output_len"] / c["mean_output_len"]) if match and c[
            "mean_output_len"] else 0.0
        rows["unconstrained"] = run_client(args, f"{name}_unconstrained", url, model_dir, False,
                                           max(1, length or args.max_tokens), spread)
    finally:
        stop()
    for arm in ("constrained", "unconstrained"):
        row = rows[arm]
        print(f"  {arm:13s} {row['output_throughput']:8.1f} out tok/s  mean len {row['mean_output_len']:6.1f} "
              f"(sd {row['stdev_output_len']:5.1f})  "
              f"TPOT {row['mean_tpot_ms']:6.1f} ms (P99 {row['p99_tpot_ms']:6.1f})  failures {row['failures']}"
              + (f"  e.g. {row['failure_examples'][0]}" if row.get("failure_examples") else ""), flush=True)
    return rows


def summarize(runs: dict[str, dict[str, list[dict]]], rounds: int) -> dict:
    summary: dict = {}
    print(f"\nmedian [min, max] of {rounds} round(s)")
    head = f"{'server':9s} {'arm':13s}" + "".join(f"{k:>26s}" for k in KEYS)
    print(head)
    for server, arms in runs.items():
        for arm in ("constrained", "unconstrained"):
            rows = arms[arm]
            if not rows:
                continue
            stats = {}
            cells = ""
            for k in KEYS:
                vals = [float(row[k]) for row in rows if row.get(k) is not None]
                if not vals:
                    cells += f"{'-':>26s}"
                    continue
                stats[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
                cells += f"{stats[k]['median']:>9.1f} [{stats[k]['min']:6.1f},{stats[k]['max']:7.1f}]"
            summary.setdefault(server, {})[arm] = stats
            print(f"{server:9s} {arm:13s}" + cells)

    def med(server: str, arm: str) -> float | None:
        return summary.get(server, {}).get(arm, {}).get("output_throughput", {}).get("median")

    ratios = {}
    for server in runs:
        c, u = med(server, "constrained"), med(server, "unconstrained")
        if c and u:
            per_round = [a["output_throughput"] / b["output_throughput"]
                         for a, b in zip(runs[server]["constrained"], runs[server]["unconstrained"])]
            ratios[f"{server}_constrained_over_unconstrained"] = c / u
            goal = "  (goal >= 0.90: " + ("met" if c / u >= 0.9 else "NOT met") + ")" if server == "epdserve" else ""
            print(f"{server} constrained / unconstrained output tok/s (medians): {c / u:.3f}; per round "
                  f"{', '.join(f'{x:.3f}' for x in per_round)}{goal}")
    c, v = med("epdserve", "constrained"), med("vllm", "constrained")
    if c and v:
        ratios["epdserve_over_vllm_constrained"] = c / v
        print(f"epdserve constrained / vllm constrained output tok/s (medians): {c / v:.3f}  "
              f"(goal >= 1.0: {'met' if c / v >= 1.0 else 'NOT met'})")
    u, vu = med("epdserve", "unconstrained"), med("vllm", "unconstrained")
    if u and vu:
        ratios["epdserve_over_vllm_unconstrained"] = u / vu
        print(f"epdserve unconstrained / vllm unconstrained output tok/s (medians): {u / vu:.3f}")
    summary["ratios"] = ratios
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=512, help="max_tokens of the constrained arm (a cap)")
    parser.add_argument("--unconstrained-output-len", default="match",
                        help="'match': the constrained arm's mean output length on the same server; or N tokens")
    parser.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions")
    parser.add_argument("--skip-vllm", action="store_true", help="epdserve only")
    parser.add_argument("--vllm-compact-json", action="store_true",
                        help="start vLLM with disable_any_whitespace, as epdserve compiles JSON")
    parser.add_argument("--peer", type=Path, default=Path(os.environ.get("PEER", ROOT.parent / "shared/peers/vllm-cpu.sh")))
    parser.add_argument("--out", type=Path, default=None, help="client results and logs (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write every round's numbers and the summary here")
    args = parser.parse_args()
    if args.unconstrained_output_len != "match" and not args.unconstrained_output_len.isdigit():
        parser.error("--unconstrained-output-len takes 'match' or a number of tokens")
    args.out = args.out or Path(tempfile.mkdtemp(prefix="structured-"))
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = subprocess.run([str(args.peer), "model-dir"], capture_output=True, text=True, check=True).stdout.strip()
    servers = ["epdserve"] if args.skip_vllm else list(SERVERS)
    runs: dict[str, dict[str, list[dict]]] = {s: {a: [] for a in ARMS} for s in servers}
    print(f"results and logs: {args.out}", flush=True)
    for r in range(1, args.rounds + 1):
        order = servers if r % 2 else servers[::-1]  # alternate who goes first
        for server in order:
            rows = run_server_arms(args, server, r, model_dir)
            for arm, row in rows.items():
                runs[server][arm].append({"round": r, **row})
    summary = summarize(runs, args.rounds)
    if args.json:
        workload = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        Path(args.json).write_text(json.dumps({"workload": workload, "schema": SCHEMA, "runs": runs,
                                               "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
