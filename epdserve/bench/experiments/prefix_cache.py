"""``prefix-cache``: what prefix-aware routing and the KV tiers below the pool buy on real
multi-turn traffic, and where loading a cached prefix stops paying against recomputing it.

Part 1, the trace. From the Mooncake conversation trace, the first conversations with at
least ``min_turns`` turns (a turn extends an earlier turn's block hashes: the history is its
prefix) whose prompts all fit, in the trace's own arrival order, lengths scaled down and time
compressed to a replay duration per request rate. Each arm is a fresh server on the
same two cores with a deliberately small pool per worker, so that a conversation's history is
usually evicted before its next turn arrives:

    arm                     routing         KV tiers below the pool
    least-prefill           least-prefill   none
    prefix-aware            prefix-aware    none
    prefix-aware+tiers      prefix-aware    host (shared memory) + disk
    least-prefill-no-decode-cache (P/D only) least-prefill, none, and decode workers without a
                            prefix cache: the P/D path before decode kept one, a second baseline

on the split ``epdserve plan`` gives for this trace and SLO on this host: the experiment profiles
the host (``epdserve profile``, every role at one thread), plans with a budget of one instance per
core and the baseline's routing, and runs every arm on the plan's configuration (on two cores:
two colocated workers or one prefill and one decode worker, one core each). ``MACHINES`` keeps
the layout of earlier runs on 2P1D, machines per role (CPU quotas from ``cpu_quota.py`` and each
worker's threads pinned to its core after start), applied when the plan's topology is one of them. With every worker
held to two thirds of a core, 2P1D was decode-bound at the TPOT SLO whatever the routing (TPOT
P50 105-174 ms at 1.62-3.24 req/s against the 100 ms SLO); with decode alone on one core and the
prefill workers held to half of the other each, it was prefill-bound (TTFT P50 3.0-9.2 s at
3.24-5.93 req/s, 3-19 % within the SLO in every arm), so the cache could not show in either. On
1P1D the decode worker's own prefix cache already served 51-58 % of prompt tokens, leaving the
tiers 13-15 points of the trace's 71.

The rates: the baseline (least-prefill, no tiers) is replayed first, from the ladder's rate
nearest the plan's predicted rate: up the ladder while it keeps 90 % of its requests within the
SLO (until two rates in a row do not), down it until it does when the first miss; the highest rate
that kept them is its knee, and every arm runs at multiples of it (below the knee no arm can reach
1.5x the baseline's goodput). The TTFT SLO is sized to the host by the plan (``plan_split``: a
host without a fast bf16 matmul prefills about five times slower than one with AMX).
Every arm at every rate runs ``rounds`` times (two at full scale; this host's speed moves
within minutes, and one run near the knee can differ from the next by a third), the arms'
order rotated each round; the tables hold the rounds' means and the goals each round's own
ratio. Reported per arm and rate:
goodput at the SLO, TTFT P50/P99, prompt tokens served from each tier (the server's
per-request ``timing``), KV bytes P -> D and the bytes not sent (decode held them).

Part 2, the crossover. One worker (one core) with a pool that holds one prompt: a prefix of
L tokens is computed once, pushed out of the pool by a filler, then requested again with a
new suffix. Per L the TTFT when it is recomputed (no tier), loaded from the host tier and
loaded from the disk tier (the rule pinned to load), and what the rule chose with the
bandwidths the worker measured at start.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
import numpy as np

from epdserve.bench import BenchError
from epdserve.bench.experiments import cpu_quota
from epdserve.bench.experiments.launch import (
    RunningServer,
    auth_headers,
    epdserve_cmd,
    list_workers,
    run_command,
    start_server,
    stop_server,
)
from epdserve.bench.experiments.prefix_cache_report import BASELINE, BEFORE, NAME, build_report, goals, write_plots
from epdserve.bench.experiments.report import begin, write_outputs
from epdserve.bench.traces import TRACE_BLOCK_TOKENS, TraceRecord, read_trace
from epdserve.cluster.local import available_cores
from epdserve.envs import EPDSERVE_TRACES_DIR, get_traces_dir
from epdserve.errors import ConfigError
from epdserve.roles import Role, parse_role_counts

TRACE_FILE = "mooncake_conversation.jsonl"
BLOCK_SIZE = 16  # the engine's default --block-size
HTTP_TIMEOUT_S = 300.0
PINNED_LOAD_GBPS = "1000"  # a read bandwidth so high that the rule always loads
ARMS = {  # name -> (routing, with tiers, decode workers keep a prefix cache)
    "least-prefill": ("least-prefill", False, True),
    "prefix-aware": ("prefix-aware", False, True),
    "prefix-aware+tiers": ("prefix-aware", True, True),
    # P/D only: the baseline as P/D served before decode kept a prefix cache (every request's
    # whole prompt KV reserved on decode and sent to it).
    BEFORE: ("least-prefill", False, False),
}


def arms_for(topology: str) -> list[str]:
    """The arms a topology runs: the decode-cache arm only where there are decode workers."""
    return [arm for arm in ARMS if arm != BEFORE or Role.DECODE in parse_role_counts(topology)]
SERVE_ROLE_FLAGS = {"colocated": "--colocated-workers", "prefill": "--prefill-workers", "decode": "--decode-workers"}


def topology_flags(spec: str) -> list[str]:
    """serve's flags for a topology as ``epdserve plan`` names it (``colocated=2``,
    ``prefill=2,decode=1``), one core per worker."""
    try:
        counts = parse_role_counts(spec)
    except ConfigError as e:
        raise BenchError(f"topology {spec!r}: want role=N pairs ({e})") from None
    if Role.ENCODE in counts:
        raise BenchError(f"prefix-cache serves text only; the topology {spec!r} has encode workers")
    flags = [f for role, n in counts.items() for f in (SERVE_ROLE_FLAGS[role], str(n))]
    return [*flags, "--cores-per-worker", "1"]


@dataclass(frozen=True)
class Machine:
    """What each worker of a role runs on: ``share`` of a core (a CPU quota) on ``cores``
    (indices into the host's cores)."""

    share: float
    cores: tuple[int, ...]


# Machines per role for topologies with more workers than the host has cores; the others run
# one core per worker as serve pins them. Decode on a core of its own; the prefill workers
# split the other.
MACHINES = {"prefill=2,decode=1": {"prefill": Machine(0.5, (0,)), "decode": Machine(1.0, (1,))}}


@dataclass(frozen=True)
class Scale:
    num_conversations: int
    min_turns: int
    max_input_len: int  # trace tokens, before length_scale
    length_scale: float
    probe_rates: tuple[float, ...]  # req/s, rising: the baseline's knee is looked for on this ladder
    slo_ttft_ms: float | None  # None: sized to the host by ``epdserve plan`` (``ttft_p90:auto``)
    slo_tpot_ms: float
    num_kv_blocks: int  # per worker
    decode_num_kv_blocks: int  # per decode worker: it holds every running sequence's whole context
    host_tier_gib: float
    disk_tier_gib: float
    max_model_len: int
    crossover_lengths: tuple[int, ...]  # prefix tokens
    crossover_reps: int
    rounds: int = 1  # every arm at every rate this many times, on fresh servers, arms rotated per round
    rate_multiples: tuple[float, ...] = (1.0,)  # the rates every arm runs at, as multiples of the knee
    knee_share: float = 0.9  # the knee: the highest probed rate at which this share of requests meets the SLO
    knee_misses: int = 2  # probing up the ladder stops after this many rates in a row below knee_share
    quick_profile: bool = False  # epdserve profile --quick (rough numbers, seconds)


# Rates: a knee probe of the baseline (``find_knee``) on a ladder from 0.1 req/s up by about 1.2x
# (a host without a fast bf16 matmul, e.g. AVX-512 without AMX, prefills ~5x slower: 1P1D's
# predicted knee 0.26 req/s against 4.4 on AMX), entered at the plan's predicted rate; the arms at 1.15, 1.3 and 1.5x the knee (fixed rates tuned on one day's host were all past the
# knee on a slower day). The decode worker's pool is small for the trace (512 blocks, about 20
# conversations' contexts): the memory-pressed regime the tiers are for; with 2048 blocks the
# decode worker's own prefix cache, pulled from by the prefill worker, served 69 % of prompt
# tokens without tiers and the tiers added 5 %. TPOT SLO 200 ms: five times a one-sequence decode
# step (38-40 ms in the decode worker's step trace here; sim_fidelity's rule): a burst of the
# trace puts 20-30 sequences on the decode worker's one core, 75-105 ms a step, in every arm.
PROBE_RATES = (0.1, 0.12, 0.15, 0.18, 0.22, 0.27, 0.33, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0, 1.2, 1.4, 1.6, 1.9, 2.3, 2.8,
               3.3, 4.0, 4.8, 5.8, 7.0)
FULL = Scale(32, 4, 9600, 0.1, PROBE_RATES, None, 200.0,
             128, 512, 0.25, 1.0, 2048, (32, 64, 128, 256, 512, 1024, 1536), 3, rounds=2,
             rate_multiples=(1.15, 1.3, 1.5))
QUICK = Scale(3, 4, 9600, 0.05, (0.8,), 20000.0, 2000.0, 64, 128, 0.1, 0.2, 1024, (32, 128), 1, quick_profile=True)


# ---------------------------------------------------------------- part 1: the trace


def conversations(records: list[TraceRecord]) -> list[list[int]]:
    """Indices of ``records`` (sorted by arrival) grouped into conversations: a record joins
    the conversation of the earlier record sharing the longest run of leading block hashes
    (at least two: the trace's first block is one system prompt every request shares)."""
    owner: dict[tuple[int, ...], int] = {}
    groups: list[list[int]] = []
    for i, record in enumerate(records):
        h = record.hash_ids
        found = next((owner[h[:n]] for n in range(len(h), 1, -1) if h[:n] in owner), None)
        if found is None:
            found = len(groups)
            groups.append([])
        groups[found].append(i)
        for n in range(2, len(h) + 1):
            owner.setdefault(h[:n], found)
    return groups


def conversation_subset(trace: Path, scale: Scale) -> list[TraceRecord]:
    """The first ``num_conversations`` conversations with enough turns, every prompt at most
    ``max_input_len`` tokens, in arrival order, timestamps from 0."""
    records = read_trace(str(trace))
    chosen = [g for g in conversations(records)
              if len(g) >= scale.min_turns and all(records[i].input_length <= scale.max_input_len for i in g)]
    if len(chosen) < scale.num_conversations:
        raise BenchError(f"{trace}: only {len(chosen)} conversations with >= {scale.min_turns} turns fit")
    picked = sorted(i for g in chosen[:scale.num_conversations] for i in g)
    t0 = records[picked[0]].arrival_s
    return [TraceRecord(records[i].arrival_s - t0, records[i].input_length, records[i].output_length,
                        records[i].hash_ids) for i in picked]


def write_subset(records: list[TraceRecord], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


def subset_stats(records: list[TraceRecord], scale: Scale) -> dict:
    """What the workload offers: requests, scaled lengths, and the share of prompt tokens that
    an earlier request already had (the ceiling of any prefix cache's hit rate)."""
    block_len = max(1, round(TRACE_BLOCK_TOKENS * scale.length_scale))
    seen: set[int] = set()
    shared = total = 0
    for r in records:
        n = max(1, round(r.input_length * scale.length_scale))
        prefix = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            prefix += 1
        shared += min(n, prefix * block_len) // BLOCK_SIZE * BLOCK_SIZE
        total += n
        seen.update(r.hash_ids)
    return {"num_requests": len(records), "num_conversations": scale.num_conversations,
            "span_s": records[-1].arrival_s, "prompt_tokens": total,
            "mean_prompt_tokens": total / len(records),
            "mean_output_tokens": float(np.mean([max(1, round(r.output_length * scale.length_scale))
                                                 for r in records])),
            "reusable_prompt_share": shared / total if total else 0.0}


def serve_flags(topology: str, arm: str, scale: Scale, disk_dir: Path) -> list[str]:
    routing, with_tiers, decode_cache = ARMS[arm]
    flags = [*topology_flags(topology), "--routing", routing, "--num-kv-blocks", str(scale.num_kv_blocks),
             "--max-model-len", str(scale.max_model_len)]
    if "--decode-workers" in flags:
        flags += ["--decode-num-kv-blocks", str(scale.decode_num_kv_blocks)]
        if not decode_cache:
            flags.append("--decode-no-prefix-caching")
    if with_tiers:
        flags += ["--kv-host-tier-gib", f"{scale.host_tier_gib:g}", "--kv-disk-tier-gib", f"{scale.disk_tier_gib:g}",
                  "--kv-disk-tier-dir", str(disk_dir)]
    return flags


def bench_cmd(server: RunningServer, subset: Path, time_scale: float, scale: Scale, out: Path) -> list[str]:
    return epdserve_cmd("bench", "serve", "--base-url", server.url,
            "--dataset", "trace", "--dataset-path", str(subset), "--trace-time-scale", f"{time_scale:.6g}",
            "--trace-length-scale", f"{scale.length_scale:g}", "--ignore-eos", "--return-timing",
            "--goodput", f"ttft:{scale.slo_ttft_ms:g}", f"tpot:{scale.slo_tpot_ms:g}",
            "--result-json", str(out), "--disable-tqdm")


def summarize_level(result: dict, duration_s: float) -> dict:
    """One arm at one rate, from ``bench serve``'s result file."""
    timings = [t for t in result.get("timings") or [] if t]
    prompt = sum(result["input_lens"])
    host = sum((t.get("kv_load") or {}).get("num_host_tokens", 0) for t in timings)
    disk = sum((t.get("kv_load") or {}).get("num_disk_tokens", 0) for t in timings)
    cached = sum(t.get("num_cached_tokens", 0) for t in timings)
    ttfts = [v * 1e3 for v, err in zip(result["ttfts"], result["errors"]) if not err]
    return {
        "duration_s": duration_s,
        "request_rate": result["num_prompts"] / duration_s,
        "completed": result["completed"],
        "failed": result["failed"],
        "request_goodput": result["request_goodput"],
        "request_throughput": result["request_throughput"],
        "goodput_share": result["request_goodput"] / result["request_throughput"] if result["request_throughput"] else 0,
        "ttft_p50_ms": float(np.percentile(ttfts, 50)) if ttfts else None,
        "ttft_p99_ms": float(np.percentile(ttfts, 99)) if ttfts else None,
        "tpot_p99_ms": result.get("p99_tpot_ms"),
        "prompt_tokens": prompt,
        "hit_share": {"pool": (cached - host - disk) / prompt, "host": host / prompt, "disk": disk / prompt},
        "decode_cached_share": sum(t.get("num_decode_cached_tokens", 0) for t in timings) / prompt,
        "kv_bytes_p_to_d": sum(t.get("kv_bytes", 0) for t in timings),
        "kv_bytes_not_sent": sum(t.get("kv_bytes_skipped", 0) for t in timings),
        "num_timings": len(timings),
    }


def run_trace_arm(topology: str, arm: str, durations: tuple[float, ...], subset: Path, span_s: float,
                  scale: Scale, out_dir: Path, commands: list[str], use_quota: bool, round_index: int = 0,
                  label: str = "") -> list[dict]:
    """A fresh server per rate (a rate's cache must not warm the next), the trace replayed once;
    with ``use_quota`` each worker held to the topology's share of a core."""
    levels = []
    for duration in durations:
        tag = f"{label}{topology}_{arm}_{duration:g}s_r{round_index + 1}".replace("=", "").replace(",", "_").replace("+", "_")
        disk_dir = Path(tempfile.mkdtemp(prefix="kv-disk-", dir=out_dir))
        server = start_server(serve_flags(topology, arm, scale, disk_dir), out_dir / "logs" / tag)
        commands.append(server.command)
        result_path = out_dir / "runs" / f"{tag}.json"
        result_path.parent.mkdir(parents=True, exist_ok=True)
        machines = MACHINES.get(topology) if use_quota else None
        quotas = cpu_quota.CpuQuotas() if machines else None
        try:
            if quotas is not None:
                for worker in list_workers(server):
                    machine = machines[worker["role"]]
                    cpu_quota.pin(worker["pid"], machine.cores)
                    quotas.limit(worker["pid"], worker["id"], machine.share)
            run_command(bench_cmd(server, subset, duration / span_s, scale, result_path), commands)
        finally:
            stop_server(server)
            if quotas is not None:
                quotas.close()
            shutil.rmtree(disk_dir, ignore_errors=True)
        level = summarize_level(json.loads(result_path.read_text(encoding="utf-8")), duration)
        print(f"{label}round {round_index + 1} {topology} {arm} {level['request_rate']:.2f} req/s: goodput {level['request_goodput']:.2f}, "
              f"TTFT p50 {level['ttft_p50_ms']:.0f} p99 {level['ttft_p99_ms']:.0f} ms, hits "
              + ", ".join(f"{k} {100 * v:.0f} %" for k, v in level["hit_share"].items()), flush=True)
        levels.append(level)
    return levels


def find_knee(scale: Scale, probe: Callable[[float], dict], start_rate: float | None = None) -> dict:
    """The baseline's knee: ``probe(rate)`` (least-prefill without tiers replayed at that rate)
    on the ladder ``scale.probe_rates``, entered at its highest rate not above ``start_rate`` (the
    plan's prediction; the lowest rate without one). While the probes keep ``knee_share`` of their
    requests within the SLO it climbs, until ``knee_misses`` probes in a row do not; when the
    first probe misses above the ladder's first rate it descends until one keeps them. The knee is the highest probed rate that
    kept them (the ladder's first when none did: ``is_below_ladder``). One run near the knee can
    miss where the next rate up does not (a burst that fills the decode worker's pool queues every
    reservation behind it), so one miss does not end the climb. Below the knee no arm can have
    1.5x the baseline's goodput (it already serves nearly every request in time), so the arms run
    past it, at ``rate_multiples`` of it. The probes come back sorted by rate."""
    ladder = scale.probe_rates
    entry = 0 if start_rate is None else max([i for i, r in enumerate(ladder) if r <= start_rate], default=0)
    probes: list[dict] = []

    def kept(rate: float) -> bool:
        level = probe(rate)
        probes.append(level)
        return level["goodput_share"] >= scale.knee_share

    knee = None
    first_kept = kept(ladder[entry])
    if first_kept or entry == 0:
        knee, misses = (ladder[entry], 0) if first_kept else (None, 1)
        for rate in ladder[entry + 1:]:
            if misses >= scale.knee_misses:
                break
            if kept(rate):
                knee, misses = rate, 0
            else:
                misses += 1
    else:
        for rate in reversed(ladder[:entry]):
            if kept(rate):
                knee = rate
                break
    probes.sort(key=lambda lv: lv["request_rate"])
    return {"probes": probes, "rate": ladder[0] if knee is None else knee, "is_below_ladder": knee is None,
            "entry_rate": None if start_rate is None else ladder[entry], "share": scale.knee_share, "misses": scale.knee_misses,
            "rate_multiples": list(scale.rate_multiples)}


def merge_rounds(rounds: list[dict[str, list[dict]]]) -> dict[str, list[dict]]:
    """Per arm and rate, the rounds' mean of every number (hit shares per tier too); failures
    summed. One round: that round."""
    merged: dict[str, list[dict]] = {}
    for arm in rounds[0]:
        merged[arm] = []
        for at_rate in zip(*(r[arm] for r in rounds)):
            level: dict = {}
            for key, value in at_rate[0].items():
                values = [lv[key] for lv in at_rate]
                if key == "hit_share":
                    level[key] = {t: float(np.mean([v[t] for v in values])) for t in value}
                elif key in ("failed", "completed"):
                    level[key] = sum(values)
                elif all(isinstance(v, (int, float)) for v in values):
                    level[key] = float(np.mean(values))
                else:
                    level[key] = value
            merged[arm].append(level)
    return merged


# ---------------------------------------------------------------- part 2: the crossover

CROSSOVER_ARMS = {  # name -> tier flags (the disk directory is added)
    "recompute": [],
    "host, load": ["--kv-host-tier-gib", "0.5", "--kv-host-tier-read-gbps", PINNED_LOAD_GBPS],
    "disk, load": ["--kv-disk-tier-gib", "1", "--kv-disk-tier-read-gbps", PINNED_LOAD_GBPS],
    "host, rule": ["--kv-host-tier-gib", "0.5"],
    "disk, rule": ["--kv-disk-tier-gib", "1"],
}


def token_prompt(seed: int, n: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(1000, 40000, size=n).tolist()


def model_name(server: RunningServer) -> str:
    r = httpx.get(f"{server.url}/v1/models", headers=auth_headers(server), timeout=HTTP_TIMEOUT_S)
    return r.json()["data"][0]["id"]


def crossover_arm(name: str, scale: Scale, out_dir: Path, commands: list[str]) -> list[dict]:
    longest = max(scale.crossover_lengths) + BLOCK_SIZE
    num_blocks = -(-longest // BLOCK_SIZE) + 2  # the pool holds one prompt
    disk_dir = Path(tempfile.mkdtemp(prefix="kv-disk-", dir=out_dir))
    flags = ["--colocated-workers", "1", "--cores-per-worker", "1", "--num-kv-blocks", str(num_blocks),
             "--max-model-len", str(max(scale.max_model_len, num_blocks * BLOCK_SIZE)), *CROSSOVER_ARMS[name]]
    if "--kv-disk-tier-gib" in flags:
        flags += ["--kv-disk-tier-dir", str(disk_dir)]
    server = start_server(flags, out_dir / "logs" / ("crossover_" + name.replace(", ", "_")))
    commands.append(server.command)
    points = []
    try:
        model = model_name(server)
        filler = token_prompt(999, num_blocks * BLOCK_SIZE - 2 * BLOCK_SIZE)
        for length in scale.crossover_lengths:
            prefix = token_prompt(length, length)
            _request(server, model, prefix + token_prompt(length + 1, BLOCK_SIZE))  # computed, written down
            for rep in range(scale.crossover_reps):
                _request(server, model, filler)  # pushes the prefix out of the pool
                ttft_ms, timing = _request(server, model, prefix + token_prompt(length + 2 + rep, BLOCK_SIZE))
                load = timing.get("kv_load") or {}
                points.append({"prefix_tokens": length, "rep": rep, "ttft_ms": ttft_ms,
                               "prefill_ms": timing.get("prefill_ms"),
                               "num_cached_tokens": timing.get("num_cached_tokens", 0),
                               "num_found_tokens": load.get("num_found_tokens", 0),
                               "num_chosen_tokens": load.get("num_chosen_tokens", 0),
                               "num_host_tokens": load.get("num_host_tokens", 0),
                               "num_disk_tokens": load.get("num_disk_tokens", 0),
                               "predicted_load_ms": 1e3 * load.get("predicted_load_s", 0.0),
                               "predicted_compute_ms": 1e3 * load.get("predicted_compute_s", 0.0),
                               "read_ms": 1e3 * load.get("read_s", 0.0)})
    finally:
        stop_server(server)
        shutil.rmtree(disk_dir, ignore_errors=True)
    return points


def _request(server: RunningServer, model: str, prompt: list[int]) -> tuple[float, dict]:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "return_timing": True}
    start = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth_headers(server), timeout=HTTP_TIMEOUT_S)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    if r.status_code != 200:
        raise BenchError(f"crossover request failed ({r.status_code}): {r.text[:200]}")
    return elapsed_ms, r.json().get("timing") or {}


# ---------------------------------------------------------------- the split


def profile_host(scale: Scale, out_dir: Path, commands: list[str]) -> Path:
    """Profile this host (``epdserve profile``, every role at one thread) and write a copy of the
    profile with the pools the arms serve with (``num_kv_blocks`` per worker,
    ``decode_num_kv_blocks`` per decode worker: the profile's own are the default pools); its path."""
    measured, profile_path = out_dir / "profile.json", out_dir / "profile_served_pools.json"
    quick = ["--quick"] if scale.quick_profile else []
    run_command(epdserve_cmd("profile", "--roles", "colocated,prefill,decode", "--threads", "colocated=1",
                             "--max-model-len", str(scale.max_model_len), "--out", str(measured),
                             "--disable-tqdm", *quick), commands)
    profile = json.loads(measured.read_text(encoding="utf-8"))
    for role, spec in profile["roles"].items():
        spec["num_kv_blocks"] = scale.decode_num_kv_blocks if role == "decode" else scale.num_kv_blocks
    profile_path.write_text(json.dumps(profile, indent=1), encoding="utf-8")
    return profile_path


def plan_split(scale: Scale, subset: Path, profile_path: Path, out_dir: Path, commands: list[str]) -> dict:
    """Ask ``epdserve plan`` for the best configuration of one instance per core, all on this
    host, on the subset at the experiment's SLO (90 % of requests within it, the knee's share),
    routed as the baseline routes, on ``profile_path`` (``profile_host``); its verdict's topology
    is where every arm runs. Without a TTFT SLO of its own (``scale.slo_ttft_ms`` None) the plan
    sizes it to the host (``ttft_p90:auto``: a multiple of the prefill alone of the subset's
    90th-percentile prompt on the profile; about the fixed 1 s of earlier runs on a host with AMX, where a host
    without a fast bf16 matmul prefills about five times slower and a fixed 1 s would be missed by
    the longer prompts' own prefill at any load); ``slo_ttft_ms`` in the result is the one used.
    The TPOT SLO stays as set: decode steps cost about the same on both kinds of host."""
    plan_path = out_dir / "plan.json"
    instances = len(available_cores())
    max_model_len = min(scale.max_model_len, (scale.num_kv_blocks - 1) * BLOCK_SIZE)  # what the pool holds
    ttft = "auto" if scale.slo_ttft_ms is None else f"{scale.slo_ttft_ms:g}"
    slo = f"ttft_p90:{ttft},tpot_p90:{scale.slo_tpot_ms:g}"
    run_command(epdserve_cmd("plan", "--profile", str(profile_path), "--slo", slo,
                             "--attainment", f"{scale.knee_share:g}", "--instances", str(instances),
                             "--instances-per-host", str(instances),
                             "--workload", "trace", str(subset), "--length-scale", f"{scale.length_scale:g}",
                             "--routing", ARMS[BASELINE][0],
                             "--seqs-choices", "0",  # the profile's max_num_seqs: what the servers run with
                             "--max-model-len", str(max_model_len), "--out", str(plan_path)), commands)
    result = json.loads(plan_path.read_text(encoding="utf-8"))
    verdict = result["verdict"]
    if "configuration" not in verdict:
        raise BenchError(f"epdserve plan found no configuration for the trace on this host ({verdict['reason']}); "
                         f"see {plan_path}")
    topology = verdict["configuration"]["topology"]
    chosen = [c for c in result.get("candidates", []) if c.get("topology") == topology]
    predicted = max((c.get("max_rate", 0.0) for c in chosen), default=0.0) or result.get("max_rate") or None
    return {"topology": topology, "choice": verdict["choice"], "reason": verdict["reason"],
            "predicted_max_rate": predicted, "slo": result["slo"],
            "slo_ttft_ms": result["slo_thresholds_ms"]["ttft_p90"], "instances": result["instances"],
            "candidates": [{k: c.get(k) for k in ("topology", "max_rate", "goodput", "goodput_per_instance")}
                           for c in result.get("candidates", [])]}


# ---------------------------------------------------------------- the experiment


def run(out_dir: Path, quick: bool) -> str:
    experiment = begin(NAME, out_dir, quick)
    scale = QUICK if quick else FULL
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = get_traces_dir() / TRACE_FILE
    if not trace.is_file():
        raise BenchError(f"the Mooncake conversation trace is not at {trace} (set ${EPDSERVE_TRACES_DIR})")
    records = conversation_subset(trace, scale)
    subset = out_dir / "mooncake_conversation_subset.jsonl"
    write_subset(records, subset)
    stats = subset_stats(records, scale)
    commands: list[str] = []
    profile_path = profile_host(scale, out_dir, commands)
    slo_sized = scale.slo_ttft_ms is None
    split = plan_split(scale, subset, profile_path, out_dir, commands)
    scale = replace(scale, slo_ttft_ms=split["slo_ttft_ms"])
    print(f"SLO: TTFT <= {scale.slo_ttft_ms:g} ms, TPOT <= {scale.slo_tpot_ms:g} ms", flush=True)
    topology = split["topology"]
    print(f"plan: {topology} ({split['reason']}); predicted max rate {split['predicted_max_rate']}", flush=True)
    wants_quota = topology in MACHINES
    why = cpu_quota.available() if wants_quota else None
    if wants_quota and why is not None and not quick:
        raise BenchError(f"prefix-cache holds each worker of {topology} to a CPU quota and cannot here: {why}")
    use_quota = wants_quota and why is None

    def probe(rate: float) -> dict:
        return run_trace_arm(topology, BASELINE, (round(stats["num_requests"] / rate, 3),), subset,
                             stats["span_s"], scale, out_dir, commands, use_quota, label="probe_")[0]

    knee = find_knee(scale, probe, split["predicted_max_rate"])
    durations = tuple(round(stats["num_requests"] / (m * knee["rate"]), 3) for m in scale.rate_multiples)
    arms = arms_for(topology)
    rounds = []
    for k in range(scale.rounds):  # the arms rotate, so no arm always runs first or last in a round
        order = arms[k % len(arms):] + arms[:k % len(arms)]
        ran = {arm: run_trace_arm(topology, arm, durations, subset, stats["span_s"], scale, out_dir, commands,
                                  use_quota, k) for arm in order}
        rounds.append({arm: ran[arm] for arm in arms})
    trace_results = {topology: merge_rounds(rounds)}
    crossover = {name: crossover_arm(name, scale, out_dir, commands) for name in CROSSOVER_ARMS}
    results = {"scale": asdict(scale), "slo_ttft_sized": slo_sized, "workload": stats, "topology": topology, "plan": split,
               "machines": ({role: asdict(m) for role, m in MACHINES[topology].items()} if use_quota else None),
               "quota_wanted": wants_quota,
               "knee": knee, "trace": trace_results,
               "goals": goals(trace_results[topology]),
               "goals_by_round": [goals(levels) for levels in rounds], "rounds": rounds,
               "goals_before": goals(trace_results[topology], baseline=BEFORE),
               "crossover": crossover, "commands": commands}
    plots = write_plots(results, out_dir)
    report = build_report(results, experiment, [p.name for p in plots])
    write_outputs(out_dir, results, report)
    return report
