"""Soak test of ``epdserve serve``: thousands of mixed requests against P/D with two decode workers.

    python benchmarks/soak.py [--num-requests 10000] [--concurrency 16] [--seed 0] [--warmup 500]
                              [--max-tokens 16] [--out out/soak.json]

One prefill and two decode workers (``SERVE_ARGS``: 512-token context, a KV pool small enough
that decode reservations are sometimes refused with a 503, ``--max-pending`` below the client's
concurrency so admission sometimes answers 429). The client (aiohttp, plus raw sockets for
clients that hang up right after sending) draws every request from one seeded RNG: valid
completions and chat completions, streamed or not, ``n=2``, invalid bodies (out-of-range fields,
an empty prompt, a lone surrogate, malformed JSON, a body over the size limit, a prompt over the
context) and clients that disconnect before the first token, mid-stream or by a short read
timeout.

The first ``--warmup`` requests run first; once the server has drained, the RSS of the router
and of each worker is read (``/proc/PID/status`` VmRSS), and again after the rest. At the end,
after a bounded drain wait, the invariants are checked: no KV block, reservation, transfer or
request left on any worker, no embedding-slab row held (encode workers only), the router's
``epdserve_router_requests_pending`` and ``epdserve_router_request_paths`` at 0, every worker
ready under its original pid, no 5xx but 503, every status >= 400 an OpenAI-shaped error body,
every response and stream well-formed, no request the client had to give up on, invalid
requests refused, and every process's RSS within 10 % of its post-warm-up value. It prints a
report, writes ``--out`` and exits 1 when an invariant fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import re
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import httpx

from epdserve.bench.experiments.launch import RunningServer, list_workers, start_server, stop_server

MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 64 << 10  # small, so a body over the limit is cheap to send
SERVE_ARGS = [
    "--prefill-workers", "1", "--decode-workers", "2",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--num-kv-blocks", "48",  # per worker, 16 tokens each: a few long prompts fill a decode pool
    "--max-pending", "14",
    "--max-request-bytes", str(MAX_REQUEST_BYTES),
]
REQUEST_TIMEOUT_S = 180.0  # a valid request's whole life, client side; past it the request hung
CONNECT_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 60.0  # after the last request, for the workers' loads and the router's gauges to reach 0
POLL_S = 0.25
NUM_SAMPLES_SHOWN = 12  # RSS samples printed per process (all are in --out)
MAX_BACKOFF_S = 1.0  # a client refused with 429/503 waits up to this long before its next request
RSS_TOLERANCE = 0.10  # relative growth allowed between the post-warm-up and the final RSS
OK_OVERLOAD = frozenset({200, 429, 503})  # what a valid request may be answered with
WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing about rivers mountains "
         "cities music science history winter summer coffee bread stone light water garden window table "
         "story number market train paper letter forest island doctor teacher engine signal").split()

# kind -> weight. "invalid:*" must be refused with a 4xx; "gone:*" hang up on purpose.
KINDS = {
    "completion": 14, "completion-stream": 14, "chat": 10, "chat-stream": 10, "n2": 4, "n2-stream": 4,
    "invalid:stop_token_ids": 2, "invalid:seed": 2, "invalid:top_p": 2, "invalid:n0": 2,
    "invalid:empty-prompt": 2, "invalid:surrogate": 2, "invalid:malformed-json": 2, "invalid:too-large": 1,
    "invalid:prompt-too-long": 1,
    "gone:before-first-token": 7, "gone:mid-stream": 7, "gone:read-timeout": 7,
}


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int
    concurrency: int
    seed: int
    warmup: int
    max_tokens: int  # the most output tokens a valid request asks for (1 .. this)
    out: Path
    log_dir: Path
    serve_args: tuple[str, ...]  # appended to SERVE_ARGS (e.g. --dtype float32, --step-trace-dir DIR)
    rss_every_s: float  # period of the RSS time series


@dataclass(frozen=True)
class Spec:
    """One request, drawn before the run from the seeded RNG."""

    kind: str
    path: str  # /v1/completions or /v1/chat/completions
    body: bytes
    stream: bool
    n: int = 1
    chunked: bool = False  # send the body with chunked transfer encoding (no Content-Length)
    chunks_before_leaving: int = 0  # gone:mid-stream: SSE events read before hanging up
    read_timeout_s: float = 0.0  # gone:read-timeout: how long the client waits for the answer


@dataclass
class Outcome:
    kind: str
    status: str  # the HTTP status, "gone" (the client left on purpose) or "client-error:<Type>"
    sse_error: bool = False
    refusal: str | None = None  # the message of a 429/503 or an SSE error event, digits masked
    problems: list[str] = field(default_factory=list)  # contract breaches seen by the client


# ---------------------------------------------------------------------------------------------
# Drawing the requests


def _prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def _num_words(rng: random.Random) -> int:
    """Mostly short prompts, one in ten long (the decode pools fill with those); at most ~1.3
    tokens a word, so a prompt and its output stay under MAX_MODEL_LEN."""
    return rng.randint(150, 300) if rng.random() < 0.1 else rng.randint(1, 60)


def _sampling(rng: random.Random, max_tokens: int) -> dict:
    body: dict = {"max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice([0.0, 0.7, 1.0])}
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.5, 0.9, 1.0])
    if rng.random() < 0.2:
        body["top_k"] = rng.choice([1, 20, 50])
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.1:
        body["stop"] = [rng.choice(WORDS)]
    return body


def _valid_body(rng: random.Random, model: str, chat: bool, max_tokens: int) -> dict:
    body = {"model": model, **_sampling(rng, max_tokens)}
    if chat:
        messages = [{"role": "user", "content": _prompt(rng, _num_words(rng))}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": _prompt(rng, rng.randint(1, 20))})
        body["messages"] = messages
        if rng.random() < 0.2:
            body["max_completion_tokens"] = body.pop("max_tokens")
        if rng.random() < 0.1:
            body |= {"logprobs": True, "top_logprobs": 2}
    else:
        body["prompt"] = ([rng.randrange(1000, 40000) for _ in range(rng.randint(1, 60))]
                          if rng.random() < 0.1 else _prompt(rng, _num_words(rng)))
        if rng.random() < 0.1:
            body["logprobs"] = 2
    return body


def _invalid(rng: random.Random, kind: str, model: str) -> tuple[bytes, bool]:
    """The body of an invalid request (raw bytes: some are not JSON, one holds a lone surrogate
    escaped as JSON text) and whether to send it chunked."""
    base = {"model": model, "prompt": _prompt(rng, rng.randint(1, 20)), "max_tokens": 4}
    match kind:
        case "invalid:stop_token_ids":
            return json.dumps(base | {"stop_token_ids": [rng.choice([49152, 10**9, 2**63])]}).encode(), False
        case "invalid:seed":
            return json.dumps(base | {"seed": rng.choice([2**64, -(2**64)])}).encode(), False
        case "invalid:top_p":
            return json.dumps(base | {"top_p": rng.choice([7, 7.0, -0.5])}).encode(), False
        case "invalid:n0":
            return json.dumps(base | {"n": 0}).encode(), False
        case "invalid:empty-prompt":
            return json.dumps(base | {"prompt": rng.choice(["", []])}).encode(), False
        case "invalid:surrogate":
            return ('{"model": "%s", "prompt": "hi \\ud800 there", "max_tokens": 2}' % model).encode(), False
        case "invalid:malformed-json":
            return rng.choice([b'{"model": "x", "prompt": "a"', b"not json", b'{"prompt": "a",}', b"\xff\xfe{}"]), False
        case "invalid:too-large":
            return json.dumps(base | {"prompt": "a " * MAX_REQUEST_BYTES}).encode(), rng.random() < 0.5
        case "invalid:prompt-too-long":
            return json.dumps(base | {"prompt": _prompt(rng, 2 * MAX_MODEL_LEN)}).encode(), False
    raise ValueError(kind)


def draw_spec(rng: random.Random, model: str, max_tokens: int) -> Spec:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    if kind.startswith("invalid:"):
        body, chunked = _invalid(rng, kind, model)
        return Spec(kind, "/v1/completions", body, stream=rng.random() < 0.3, chunked=chunked)
    chat = kind.startswith("chat") or (not kind.startswith("completion") and rng.random() < 0.5)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _valid_body(rng, model, chat, max_tokens)
    n = 2 if kind.startswith("n2") else 1
    if n == 2:
        body["n"] = 2
    stream = kind.endswith("-stream") or kind == "gone:mid-stream" or (kind == "gone:before-first-token"
                                                                       and rng.random() < 0.5)
    if stream:
        body["stream"] = True
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
    if kind == "gone:mid-stream":
        body["ignore_eos"] = True
        body["max_tokens" if "max_tokens" in body else "max_completion_tokens"] = max_tokens
    return Spec(kind, path, json.dumps(body).encode(), stream, n,
                chunks_before_leaving=rng.randint(1, 8) if kind == "gone:mid-stream" else 0,
                read_timeout_s=rng.uniform(0.01, 0.5) if kind == "gone:read-timeout" else 0.0)


# ---------------------------------------------------------------------------------------------
# Sending them


def error_shape_problem(payload: object) -> str | None:
    """None when ``payload`` is OpenAI's error body ``{"error": {"message","type","param","code"}}``."""
    if not isinstance(payload, dict) or not isinstance(payload.get("error"), dict):
        return "error body is not {'error': {...}}"
    error = payload["error"]
    if not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return "error body lacks a message or type string"
    if "param" not in error or "code" not in error:
        return "error body lacks param or code"
    return None


def _refusal(payload: object) -> str | None:
    try:
        return re.sub(r"\d+", "N", str(payload["error"]["message"]))[:120]  # type: ignore[index]
    except (KeyError, TypeError):
        return None


def _check_error(status: int, text: bytes, headers: Mapping[str, str], outcome: Outcome) -> None:
    try:
        payload = json.loads(text)
        problem = error_shape_problem(payload)
    except ValueError:
        payload, problem = None, f"error body is not JSON: {text[:80]!r}"
    if status in (429, 503):
        outcome.refusal = _refusal(payload)
    if problem:
        outcome.problems.append(f"{status}: {problem}")
    if status in (429, 503) and "Retry-After" not in headers:
        outcome.problems.append(f"{status} without Retry-After")


def _check_full(payload: object, n: int, outcome: Outcome) -> None:
    if not isinstance(payload, dict) or not isinstance(payload.get("choices"), list):
        outcome.problems.append("200 body has no choices")
    elif len(payload["choices"]) != n or "usage" not in payload:
        outcome.problems.append(f"200 body has {len(payload['choices'])} choices for n={n} or no usage")


async def _read_stream(response: aiohttp.ClientResponse, spec: Spec, outcome: Outcome) -> None:
    """Read SSE events to ``[DONE]``, an error event, or (gone:mid-stream) the chosen count."""
    num_events = 0
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return
        num_events += 1
        try:
            event = json.loads(data)
        except ValueError:
            outcome.problems.append(f"SSE event is not JSON: {data[:80]!r}")
            return
        if "error" in event:
            outcome.sse_error = True
            outcome.refusal = _refusal(event)
            if problem := error_shape_problem(event):
                outcome.problems.append(f"SSE error event: {problem}")
            return
        if spec.chunks_before_leaving and num_events >= spec.chunks_before_leaving:
            outcome.status = "gone"
            return
    outcome.problems.append("stream ended without [DONE] or an error event")


async def _send_http(session: aiohttp.ClientSession, url: str, spec: Spec) -> Outcome:
    outcome = Outcome(spec.kind, "")
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S,
                                    sock_read=spec.read_timeout_s or None)
    data: bytes | AsyncIterator[bytes] = _chunks(spec.body) if spec.chunked else spec.body
    try:
        async with session.post(url + spec.path, data=data, timeout=timeout,
                                headers={"Content-Type": "application/json"}) as response:
            outcome.status = str(response.status)
            if response.status >= 400:
                _check_error(response.status, await response.read(), response.headers, outcome)
            elif response.status == 200 and spec.stream:
                await _read_stream(response, spec, outcome)
                if outcome.status == "gone":
                    response.close()  # hang up mid-stream: the server must abort the request
            elif response.status == 200:
                try:
                    _check_full(json.loads(await response.read()), spec.n, outcome)
                except ValueError:
                    outcome.problems.append("200 body is not JSON")
    except (asyncio.TimeoutError, aiohttp.ServerTimeoutError) as e:
        outcome.status = "gone" if spec.read_timeout_s else f"client-error:{type(e).__name__}"
    except aiohttp.ClientError as e:
        outcome.status = f"client-error:{type(e).__name__}"
    return outcome


async def _chunks(body: bytes, size: int = 8192) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


async def _send_and_hang_up(url: str, spec: Spec) -> Outcome:
    """Write the whole request on a fresh connection and close it at once, before any answer."""
    parts = urlsplit(url)
    head = (f"POST {spec.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(spec.body)}\r\n\r\n").encode()
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port), CONNECT_TIMEOUT_S)
        writer.write(head + spec.body)
        await asyncio.wait_for(writer.drain(), CONNECT_TIMEOUT_S)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as e:
        return Outcome(spec.kind, f"client-error:{type(e).__name__}")
    return Outcome(spec.kind, "gone")


async def send(session: aiohttp.ClientSession, url: str, spec: Spec) -> Outcome:
    if spec.kind == "gone:before-first-token":
        return await _send_and_hang_up(url, spec)
    return await _send_http(session, url, spec)


async def run_phase(url: str, specs: list[Spec], concurrency: int, seed: int) -> list[Outcome]:
    """Send ``specs`` with ``concurrency`` clients, each taking the next spec when it is done."""
    outcomes: list[Outcome] = []
    queue: asyncio.Queue[Spec] = asyncio.Queue()
    for spec in specs:
        queue.put_nowait(spec)
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def client(session: aiohttp.ClientSession, rng: random.Random) -> None:
        while not queue.empty():
            outcome = await send(session, url, queue.get_nowait())
            outcomes.append(outcome)
            if outcome.status in ("429", "503") or outcome.refusal:
                await asyncio.sleep(rng.uniform(0, MAX_BACKOFF_S))  # a refused client backs off a little

    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session, random.Random(seed * 1000 + i)) for i in range(concurrency)))
    return outcomes


# ---------------------------------------------------------------------------------------------
# Reading the server


def rss_mb(pid: int) -> float | None:
    """VmRSS of ``pid`` in MB (None when the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else None


def rss_snapshot(server: RunningServer) -> dict[str, dict]:
    """Router (the serve process) and each worker: pid and RSS in MB."""
    snapshot = {"router": {"pid": server.process.pid, "rss_mb": rss_mb(server.process.pid)}}
    for worker in list_workers(server):
        snapshot[worker["id"]] = {"pid": worker["pid"], "rss_mb": rss_mb(worker["pid"])}
    return snapshot


def router_gauges(server: RunningServer) -> dict[str, float | None]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    gauges: dict[str, float | None] = {}
    for name in ("epdserve_router_requests_pending", "epdserve_router_request_paths"):
        match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
        gauges[name] = float(match.group(1)) if match else None
    return gauges


LOAD_KEYS = ("num_used_blocks", "num_reserved", "num_transferring", "num_requests")


def _held(workers: list[dict], gauges: dict[str, float | None]) -> bool:
    """Whether the server still holds anything of a request."""
    slabs = [w["embedding_slab"] for w in workers if "embedding_slab" in w]
    return (any(w["load"][k] for w in workers for k in LOAD_KEYS)
            or any(s["num_free_rows"] != s["num_rows"] for s in slabs)
            or any(v != 0 for v in gauges.values()))


def drain(server: RunningServer, timeout_s: float) -> tuple[list[dict], dict[str, float | None], float]:
    """Wait (bounded) until nothing of any request is held; the last reading and the seconds waited."""
    start = time.monotonic()
    while True:
        workers, gauges = list_workers(server), router_gauges(server)
        waited = time.monotonic() - start
        if not _held(workers, gauges) or waited > timeout_s:
            return workers, gauges, waited
        time.sleep(POLL_S)


# ---------------------------------------------------------------------------------------------
# Judging and reporting


def tally(outcomes: list[Outcome]) -> dict[str, dict]:
    by_kind: dict[str, dict] = defaultdict(lambda: {"count": 0, "status": Counter(), "sse_errors": 0, "problems": Counter()})
    for o in outcomes:
        row = by_kind[o.kind]
        row["count"] += 1
        row["status"][o.status] += 1
        row["sse_errors"] += o.sse_error
        row["problems"].update(o.problems)
    return {kind: {**row, "status": dict(row["status"]), "problems": dict(row["problems"])}
            for kind, row in sorted(by_kind.items())}


def _status_breaches(kinds: dict[str, dict]) -> list[str]:
    """Statuses a kind must never get: any 5xx but 503; a 4xx but 429 for a valid request; a 2xx
    for an invalid one; a client error (a hang past REQUEST_TIMEOUT_S, a reset) for any."""
    breaches = []
    for kind, row in kinds.items():
        for status, count in row["status"].items():
            bad = (status.startswith("client-error")
                   or (status.isdigit() and int(status) >= 500 and status != "503")
                   or (kind.startswith("invalid:") and status.isdigit() and int(status) < 400)
                   or (not kind.startswith("invalid:") and status.isdigit() and int(status) not in OK_OVERLOAD))
            if bad:
                breaches.append(f"{kind}: {count} x {status}")
    return breaches


def _rss_rows(warm: dict[str, dict], end: dict[str, dict]) -> dict[str, dict]:
    rows = {}
    for name, first in warm.items():
        last = end.get(name, {"pid": None, "rss_mb": None})
        growth = (None if first["rss_mb"] is None or last["rss_mb"] is None
                  else (last["rss_mb"] - first["rss_mb"]) / first["rss_mb"])
        rows[name] = {"pid_warm": first["pid"], "pid_end": last["pid"], "rss_warm_mb": first["rss_mb"],
                      "rss_end_mb": last["rss_mb"], "growth": growth,
                      "flat": growth is not None and growth <= RSS_TOLERANCE and first["pid"] == last["pid"]}
    return rows


def invariants(kinds: dict, rss: dict, workers: list[dict], gauges: dict, alive: bool) -> dict[str, list[str]]:
    """Each invariant -> what breaks it (an empty list: it holds)."""
    slabs = {w["id"]: w["embedding_slab"] for w in workers if "embedding_slab" in w}
    return {
        "server process alive": [] if alive else ["the serve process exited"],
        "no KV blocks, reservations, transfers or requests left on a worker": [
            f"{w['id']}: {k}={w['load'][k]}" for w in workers for k in LOAD_KEYS if w["load"][k]],
        "no embedding-slab rows held": [
            f"{wid}: {s['num_rows'] - s['num_free_rows']} rows" for wid, s in slabs.items()
            if s["num_free_rows"] != s["num_rows"]],
        "router holds no request (pending and path gauges 0)": [
            f"{name}={value}" for name, value in gauges.items() if value != 0],
        "every worker ready": [f"{w['id']}: {w['state']}" for w in workers if w["state"] != "ready"],
        "no worker restarted": [f"{name}: pid {r['pid_warm']} -> {r['pid_end']}" for name, r in rss.items()
                                if r["pid_warm"] != r["pid_end"]],
        "statuses allowed for each kind (no 5xx but 503, no client-side failure)": _status_breaches(kinds),
        "every error OpenAI-shaped, every response and stream well-formed": [
            f"{kind}: {count} x {problem}" for kind, row in kinds.items() for problem, count in row["problems"].items()],
        f"RSS within {RSS_TOLERANCE:.0%} of its post-warm-up value": [
            f"{name}: {r['rss_warm_mb']} -> {r['rss_end_mb']} MB" for name, r in rss.items() if not r["flat"]],
    }


def host() -> dict:
    flags = set()
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
    return {"cpu": model, "avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx": "amx_tile" in flags, "python": platform.python_version()}


def print_report(result: dict) -> None:
    print(f"\nserver: {result['server']}\nclient: {result['client']}")
    print(f"{result['num_requests']} requests, concurrency {result['concurrency']}, seed {result['seed']}: "
          f"{result['seconds']:.0f} s ({result['num_requests'] / result['seconds']:.1f} req/s); "
          f"drained in {result['drain_seconds']:.1f} s")
    print(f"\n{'kind':28}{'count':>7}  statuses (gone: the client left on purpose)   SSE errors  problems")
    for kind, row in result["kinds"].items():
        statuses = " ".join(f"{s}:{c}" for s, c in sorted(row["status"].items()))
        print(f"{kind:28}{row['count']:>7}  {statuses:44}{row['sse_errors']:>5}  {sum(row['problems'].values())}")
    print("\nrefusals (429/503) by message:")
    for message, count in result["refusals"].items():
        print(f"  {count:>6}  {message}")
    print(f"\n{'process':12}{'pid':>8}{'RSS after warm-up MB':>22}{'RSS at end MB':>16}{'growth':>9}")
    for name, r in result["rss"].items():
        growth = "-" if r["growth"] is None else f"{r['growth']:+.1%}"
        print(f"{name:12}{r['pid_end'] or '-':>8}{r['rss_warm_mb'] or 0:>22.0f}{r['rss_end_mb'] or 0:>16.0f}{growth:>9}")
    samples = result["rss_samples"]
    if samples:
        shown = samples[::max(1, len(samples) // NUM_SAMPLES_SHOWN)]
        print("\nRSS over time, MB (s since the first request: " + " ".join(f"{s['t']:.0f}" for s in shown) + ")")
        for name in result["rss"]:
            print(f"{name:12}" + " ".join(f"{s[name]:.0f}" if s.get(name) else "-" for s in shown))
    print()
    for name, breaches in result["invariants"].items():
        print(f"{'ok  ' if not breaches else 'FAIL'} {name}" + ("" if not breaches else ": " + "; ".join(breaches[:8])))


# ---------------------------------------------------------------------------------------------


def parse_args() -> SoakConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=500, help="requests before the first RSS reading")
    parser.add_argument("--max-tokens", type=int, default=16, help="most output tokens of a valid request")
    parser.add_argument("--out", type=Path, default=Path("out/soak.json"))
    parser.add_argument("--log-dir", type=Path, default=Path("out/soak_logs"))
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="one more flag for epdserve serve (repeat; --serve-arg=--dtype --serve-arg=float32)")
    parser.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples (time series)")
    ns = parser.parse_args()
    return SoakConfig(ns.num_requests, ns.concurrency, ns.seed, min(ns.warmup, ns.num_requests), ns.max_tokens,
                      ns.out, ns.log_dir, tuple(ns.serve_arg), ns.rss_every)


class RssSampler:
    """Samples the RSS of the processes of a snapshot every ``period_s`` seconds, from a thread."""

    def __init__(self, pids: dict[str, int], period_s: float) -> None:
        self.pids = pids
        self.period_s = period_s
        self.samples: list[dict[str, float | None]] = []
        self._stop = threading.Event()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            now = time.monotonic()  # t_monotonic: comparable with step traces (--step-trace-dir)
            sample: dict[str, float | None] = {"t": round(now - self._start, 1), "t_monotonic": round(now, 3)}
            sample |= {name: rss_mb(pid) for name, pid in self.pids.items()}
            self.samples.append(sample)

    def stop(self) -> list[dict[str, float | None]]:
        self._stop.set()
        self._thread.join(self.period_s + 1.0)
        return self.samples


def soak(server: RunningServer, config: SoakConfig) -> dict:
    """Warm-up, RSS reading, the rest of the requests, drain, RSS reading; the raw results."""
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    rng = random.Random(config.seed)
    specs = [draw_spec(rng, model, config.max_tokens) for _ in range(config.num_requests)]
    sampler = RssSampler({k: v["pid"] for k, v in rss_snapshot(server).items()}, config.rss_every_s)
    start = time.monotonic()
    try:
        outcomes = asyncio.run(run_phase(server.url, specs[:config.warmup], config.concurrency, config.seed))
        drain(server, DRAIN_TIMEOUT_S)
        warm = rss_snapshot(server)
        print(f"warm-up: {config.warmup} requests in {time.monotonic() - start:.0f} s; RSS "
              + ", ".join(f"{k} {v['rss_mb']:.0f} MB" for k, v in warm.items() if v["rss_mb"]), flush=True)
        outcomes += asyncio.run(run_phase(server.url, specs[config.warmup:], config.concurrency, config.seed + 1))
        seconds = time.monotonic() - start
        workers, gauges, waited = drain(server, DRAIN_TIMEOUT_S)
        end = rss_snapshot(server)
    finally:
        samples = sampler.stop()
    return {"outcomes": outcomes, "seconds": seconds, "warm": warm, "end": end, "workers": workers,
            "gauges": gauges, "drain_seconds": waited, "rss_samples": samples,
            "alive": server.process.poll() is None}


def main() -> int:
    config = parse_args()
    serve_args = [*SERVE_ARGS, *config.serve_args]
    server = start_server(serve_args, config.log_dir)
    try:
        raw = soak(server, config)
    finally:
        stop_server(server)
    outcomes, workers, gauges = raw["outcomes"], raw["workers"], raw["gauges"]
    kinds = tally(outcomes)
    rss = _rss_rows(raw["warm"], raw["end"])
    client = (f"benchmarks/soak.py --num-requests {config.num_requests} --concurrency {config.concurrency} "
              f"--seed {config.seed} --warmup {config.warmup} --max-tokens {config.max_tokens}"
              + "".join(f" --serve-arg={a}" for a in config.serve_args))
    result = {
        "server": server.command, "client": client,
        "host": host(), "num_requests": len(outcomes), "concurrency": config.concurrency, "seed": config.seed,
        "seconds": raw["seconds"], "drain_seconds": raw["drain_seconds"], "kinds": kinds,
        "refusals": dict(Counter(o.refusal for o in outcomes if o.refusal).most_common()),
        "rss": rss, "rss_samples": raw["rss_samples"], "workers": workers, "router_gauges": gauges,
        "embedding_slabs": "not applicable: text-only server, no encode workers"
        if not any("embedding_slab" in w for w in workers) else "checked",
        "invariants": invariants(kinds, rss, workers, gauges, raw["alive"]),
    }
    print_report(result)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\nwrote {config.out}")
    return 1 if any(result["invariants"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
