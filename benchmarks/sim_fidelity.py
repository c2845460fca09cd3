"""Simulator fidelity: real epdserve against ``epdserve simulate`` on the same arrivals.

    python benchmarks/sim_fidelity.py [--profile P] [--out out/sim_fidelity] [--quick] [--rounds N] [--no-calibrate]
        [--slo-ttft-ms MS] [--slo-tpot-ms MS]

1. Profile this machine (``epdserve profile``, colocated workers at 1 thread: in both
   topologies every worker has one core), unless ``--profile`` is given.
2. Estimate each topology's capacity with the simulator: the highest rate whose SLO
   attainment is >= 90 % on the random workload (256 in / 96 out tokens, +-25 %). The SLO is
   the flags' or, without them, scaled to this machine from the profile (``slo_from_profile``).
3. For each topology (colocated x2: two colocated workers on one core each; 1P1D: one prefill
   and one decode worker on one core each), start ``epdserve serve`` with step tracing, send
   an unscored warm-up, then (unless ``--no-calibrate``) unscored calibration runs at 0.75 x
   and 1.25 x capacity with seeds of their own, and ``epdserve calibrate --window`` the profile
   on the steps the workers traced in them (not the warm-up's). Then run ``epdserve bench serve``
   at 0.5, 1.0 and 1.5 x capacity, in three rounds through the levels (every run has prompts of
   its own seed, so none hits the prefix cache), with one more calibration run between rounds.
4. Write each run's requests as a Mooncake trace (send time, prompt tokens as the server
   counted them, output tokens) and replay it with ``epdserve simulate`` on the profile
   calibrated before the levels; for comparison, on the offline profile and on one calibrated
   on every calibration run (before and between the rounds: the host's speed over the same
   minutes as the levels, which drifts by up to 9 % from one minute to the next here).
5. Per (topology, load): TTFT P50/P99, TPOT P50/P99 and goodput, real vs simulated (each side
   pooling the level's runs), the relative error of each cell, whether it is within 10 %, and
   how far the level's real runs are from each other.

Both sides are scored by the same function from per-request records: TTFT, TPOT =
(E2E - TTFT)/(output - 1), goodput = requests meeting every SLO / (last finish - first send),
for a cell of several runs their good requests over their spans, each summed.
Writes ``results.json`` and ``report.md`` into the output directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from epdserve.bench.experiments.launch import list_workers, start_server, stop_server
from epdserve.bench.experiments.report import (
    cpu_busy_share,
    machine_summary,
    machine_ticks,
    markdown_table,
    process_ticks,
)
from epdserve.engine.step_shape import StepShape
from epdserve.sim.cost_model import CostModel

TOPOLOGIES = {  # simulator topology -> serve flags (every worker on one core)
    "colocated=2": ["--colocated-workers", "2", "--cores-per-worker", "1"],
    "prefill=1,decode=1": ["--prefill-workers", "1", "--decode-workers", "1", "--cores-per-worker", "1"],
}
MAX_MODEL_LEN = 1024
INSTANCES_PER_HOST = 2  # both topologies: two workers on this one machine
ENGINE_FLAGS = ["--kv-cache-memory", "1", "--max-model-len", str(MAX_MODEL_LEN)]  # the profile records the same pool
METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "goodput")
GOAL = 0.10  # |relative error| per cell
TARGET_ATTAINMENT = 0.9
WARMUP_SEED = 1000
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
IDLE_SHARE = 0.05  # other work below this share of the CPUs counts as idle
IDLE_WINDOW_S = 3.0
# The calibration runs: rates as multiples of the offline capacity estimate (a light and a heavy
# load, so that steps with the other worker idle and busy are both traced), each with its seed.
CALIBRATION_LOADS = (0.75, 1.25)
CALIBRATION_SEED = 500
CAPACITY_RATES = tuple(round(0.25 * 1.25**k, 3) for k in range(20))  # 0.25 .. ~17 requests/s


@dataclass(frozen=True)
class Scale:
    num_prompts: int  # per load level
    num_warmup_prompts: int  # sent before the first level, not scored
    num_calibration_prompts: int  # the calibration run (not scored)
    input_len: int
    output_len: int
    range_ratio: float
    load_levels: tuple[float, ...]  # multiples of the estimated capacity
    slo_ttft_ms: float
    slo_tpot_ms: float
    profile_quick: bool
    cycle_kv_pool: bool  # warm up until every worker's KV pool has been allocated once
    rounds: int  # real runs per level, in rounds through the levels; a cell pools its rounds' requests


FULL = Scale(160, 16, 150, 256, 96, 0.25, (0.5, 1.0, 1.5), 1000.0, 80.0, False, True, 3)
QUICK = Scale(10, 4, 24, 64, 8, 0.25, (0.5, 1.0), 1000.0, 80.0, True, False, 1)
# SLO from the profile (no --slo-ttft-ms / --slo-tpot-ms): TTFT within this many times one
# prompt's prefill alone, TPOT within this many times a decode step of one sequence, on the
# colocated role's cost. Runs 1-11 (docs/benchmarks.md) used a fixed 1000 / 80 ms
# (--slo-ttft-ms 1000 --slo-tpot-ms 80), set for their AVX-512 host; on a slower host a decode
# step of one sequence alone can take longer than 80 ms, and no rate would meet that SLO.
SLO_TTFT_PREFILLS = 4.0
SLO_TPOT_STEPS = 5.0


def slo_from_profile(profile: Path, scale: Scale) -> tuple[float, float]:
    """(TTFT, TPOT) SLO in ms, rounded to 10 ms, from the profile's colocated step cost."""
    step = CostModel.load(profile).role("colocated").step
    n = scale.input_len
    prefill_s = step.time_s(StepShape(n, n * (n + 1) // 2, 0, 0))
    decode_s = step.time_s(StepShape(0, 0, 1, scale.input_len + scale.output_len // 2))
    return (round(SLO_TTFT_PREFILLS * prefill_s * 100) * 10.0, round(SLO_TPOT_STEPS * decode_s * 100) * 10.0)


def epdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "epdserve.cli", *args]


def run_logged(cmd: list[str], log: list[str]) -> subprocess.CompletedProcess:
    """Run a command (its output captured), note it in ``log``; exit on failure."""
    shown = "epdserve " + shlex.join(cmd[3:]) if cmd[:3] == epdserve() else shlex.join(cmd)
    log.append(shown)
    print(f"$ {shown}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {shown}\n{proc.stderr.strip()[-2000:]}")
    return proc


def score(result: dict | list[dict], slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """The compared metrics from bench-shaped results' per-request lists. Several results (runs
    of one level) are pooled: percentiles over all their requests, goodput = all requests meeting
    the SLO / the runs' summed spans (each from its first send to its last finish)."""
    results = result if isinstance(result, list) else [result]
    ttft_parts, tpot_parts, has_tpot_parts = [], [], []
    num_requests = num_ok = num_good = 0
    span_s = 0.0
    for r in results:
        ok = [i for i, err in enumerate(r["errors"]) if not err]
        ttft = np.array([r["ttfts"][i] for i in ok]) * 1e3
        e2e = np.array([r["latencies"][i] for i in ok]) * 1e3
        out = np.array([r["output_lens"][i] for i in ok])
        tpot = np.where(out > 1, (e2e - ttft) / np.maximum(out - 1, 1), 0.0)
        starts = np.array(r["start_times"])
        if len(starts):
            ends = np.array([r["start_times"][i] + r["latencies"][i] for i in range(len(starts))])
            span_s += float(ends.max() - starts.min())
        num_requests += len(starts)
        num_ok += len(ok)
        num_good += int(np.sum((ttft <= slo_ttft_ms) & (tpot <= slo_tpot_ms)))
        ttft_parts.append(ttft)
        tpot_parts.append(tpot)
        has_tpot_parts.append(out > 1)
    ttft, tpot, has_tpot = np.concatenate(ttft_parts), np.concatenate(tpot_parts), np.concatenate(has_tpot_parts)
    return {
        "ttft_p50_ms": float(np.percentile(ttft, 50)) if num_ok else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) if num_ok else None,
        "tpot_p50_ms": float(np.percentile(tpot[has_tpot], 50)) if has_tpot.any() else None,
        "tpot_p99_ms": float(np.percentile(tpot[has_tpot], 99)) if has_tpot.any() else None,
        "goodput": num_good / span_s if span_s > 0 else 0.0,
        "attainment": num_good / num_requests if num_requests else 0.0,
        "num_failed": num_requests - num_ok,
        "span_s": span_s,
    }


def relative_error(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None:
        return None
    if real == 0:
        return 0.0 if sim == 0 else float("inf")
    return (sim - real) / real


def write_trace(result: dict, path: Path) -> None:
    """The real run's requests as a Mooncake trace: send time (ms), prompt and output tokens."""
    records = zip(result["start_times"], result["input_lens"], result["output_lens"])
    lines = [json.dumps({"timestamp": t * 1e3, "input_length": n_in, "output_length": n_out}) for t, n_in, n_out in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def simulate(profile: Path, topology: str, workload: list[str], scale: Scale, out: Path, log: list[str]) -> dict:
    run_logged(epdserve("simulate", "--profile", str(profile), "--topology", topology, *workload,
                        "--goodput", f"ttft:{scale.slo_ttft_ms:g}", f"tpot:{scale.slo_tpot_ms:g}",
                        "--max-model-len", str(MAX_MODEL_LEN), "--instances-per-host", str(INSTANCES_PER_HOST),
                        "--out", str(out), "--quiet"), log)
    return json.loads(out.read_text())


def estimate_capacity(profile: Path, topology: str, scale: Scale, out_dir: Path, log: list[str]) -> float:
    """Highest ladder rate whose simulated SLO attainment is >= TARGET_ATTAINMENT."""
    best = CAPACITY_RATES[0]
    for rate in CAPACITY_RATES:
        workload = ["--workload", "random", "--rate", f"{rate:g}", "--num-requests", str(scale.num_prompts),
                    "--random-input-len", str(scale.input_len), "--random-output-len", str(scale.output_len),
                    "--random-range-ratio", f"{scale.range_ratio:g}", "--seed", "0"]
        name = topology.replace("=", "").replace(",", "_")
        result = simulate(profile, topology, workload, scale, out_dir / f"capacity_{name}_{rate:g}.json", log)
        if score(result, scale.slo_ttft_ms, scale.slo_tpot_ms)["attainment"] < TARGET_ATTAINMENT:
            break
        best = rate
    return best


def bench_serve(url: str, rate: float, num_prompts: int, seed: int, scale: Scale, out: Path, log: list[str]) -> dict:
    run_logged(epdserve("bench", "serve", "--base-url", url, "--dataset", "random",
                        "--num-prompts", str(num_prompts), "--random-input-len", str(scale.input_len),
                        "--random-output-len", str(scale.output_len), "--random-range-ratio", f"{scale.range_ratio:g}",
                        "--request-rate", f"{rate:.4g}", "--seed", str(seed), "--return-timing",
                        "--goodput", f"ttft:{scale.slo_ttft_ms:g}", f"tpot:{scale.slo_tpot_ms:g}",
                        "--result-json", str(out), "--disable-tqdm"), log)
    return json.loads(out.read_text())


def own_ticks(pids: list[int]) -> int:
    """CPU ticks used by ``pids`` (the server and its workers) and by this script's waited-for
    children (the bench client)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return process_ticks(pids) + round((children.ru_utime + children.ru_stime) * CLOCK_TICKS)


@dataclass
class Share:
    value: float = 0.0  # fraction of all CPU time


@contextlib.contextmanager
def other_work(pids: list[int]) -> Iterator[Share]:
    """Share of all CPU time that processes other than the server, its workers and the bench
    client used while the body ran: other work on the machine skews every real timing."""
    share = Share()
    total0, busy0 = machine_ticks()
    own0 = own_ticks(pids)
    yield share
    total, busy = machine_ticks()
    other = (busy - busy0) - (own_ticks(pids) - own0)
    share.value = max(0.0, other / (total - total0)) if total > total0 else 0.0


def wait_for_idle(pids: list[int], max_wait_s: float) -> float:
    """Wait (up to ``max_wait_s``) until other work uses under IDLE_SHARE of the CPUs over a
    short window; returns the last window's share."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with other_work(pids) as other:
            time.sleep(IDLE_WINDOW_S)
        if other.value < IDLE_SHARE or time.monotonic() >= deadline:
            return other.value
        print(f"other work uses {100 * other.value:.0f} % of the CPUs; waiting", flush=True)


def pool_cycling_prompts(profile: Path, topology: str, scale: Scale) -> int:
    """Requests that allocate every block of every worker's KV pool at least once (requests
    spread evenly over the workers; each takes its prompt's and output's blocks)."""
    data = json.loads(profile.read_text())
    block_size = data["block_size"]
    counts = {part.split("=")[0]: int(part.split("=")[1]) for part in topology.split(",")}
    blocks_per_request = -(-(scale.input_len + scale.output_len) // block_size)
    prefill_blocks = -(-scale.input_len // block_size)
    need = 0
    for role, count in counts.items():
        per_request = prefill_blocks if role == "prefill" else blocks_per_request
        need = max(need, count * -(-data["roles"][role]["num_kv_blocks"] // per_request))
    return need


def run_topology(topology: str, profile: Path, capacities: dict[str, float], scale: Scale, out_dir: Path,
                 log: list[str], max_wait_idle_s: float, calibrate: bool) -> list[dict]:
    """Serve the topology, run its load levels, simulate each on the same arrivals.

    With ``calibrate``, a calibration run (its own seed and rate, not scored) comes first, and
    ``epdserve calibrate`` scales the profile to the step times the workers traced in it; each
    level is then simulated on the calibrated profile and, for comparison, on the offline one.
    """
    name = topology.replace("=", "").replace(",", "_")
    capacity = capacities[topology]
    cells = []
    trace_dir = out_dir / f"steps_{name}"
    if trace_dir.exists():
        for old in trace_dir.glob("*.jsonl"):
            old.unlink()
    server = start_server([*TOPOLOGIES[topology], *ENGINE_FLAGS, "--step-trace-dir", str(trace_dir)],
                          out_dir / "logs" / name)
    log.append(server.command)
    pids = [server.process.pid, *(w["pid"] for w in list_workers(server))]
    try:
        # Warm-up (not scored): first-use costs (kernels, page faults on the KV pool) are not
        # in the profile, and a fresh pool hands out each request's pages in one contiguous
        # run, on which decode steps run faster than over the scattered pages of a pool whose
        # free list requests have churned (benchmarks/scattered_pages.py). The warm-up cycles
        # every worker's pool once, so calibration and levels all see a churned pool. Every
        # level then has prompts of its own seed: with one seed the later levels would find
        # the earlier levels' prompts in the prefix cache.
        num_warmup = scale.num_warmup_prompts
        if scale.cycle_kv_pool:
            num_warmup = max(num_warmup, pool_cycling_prompts(profile, topology, scale))
        bench_serve(server.url, capacity, num_warmup, WARMUP_SEED, scale, out_dir / f"warmup_{name}.json", log)
        sim_profile = profile
        windows: list[tuple[float, float]] = []  # the calibration runs' spans (the traces' clock)
        offline_capacity = capacity

        def calibration_run(k: int, load: float, path: Path) -> None:
            wait_for_idle(pids, max_wait_idle_s)
            start = time.monotonic()
            bench_serve(server.url, load * offline_capacity, scale.num_calibration_prompts, CALIBRATION_SEED + k,
                        scale, path, log)
            windows.append((start, time.monotonic()))

        def calibrate_on(out: Path) -> None:
            # The workers' trace files are line-buffered: every step of the calibration runs is
            # on disk. Only their steps are fitted: not the warm-up's (it starts on a fresh KV
            # pool, whose steps ran faster until its free list had churned), not the levels'.
            spans = [f"--window={a:.6f}:{b:.6f}" for a, b in windows]
            run_logged(epdserve("calibrate", "--profile", str(profile), "--step-trace-dir", str(trace_dir), *spans,
                                "--out", str(out)), log)

        if calibrate:
            for k, load in enumerate(CALIBRATION_LOADS):
                calibration_run(k, load, out_dir / f"calibration_{name}_x{load:g}.json")
            sim_profile = out_dir / f"profile_calibrated_{name}.json"
            calibrate_on(sim_profile)
            # The levels are multiples of what the calibrated simulator says this deployment holds.
            capacity = estimate_capacity(sim_profile, topology, scale, out_dir / "capacity_calibrated", log)
            capacities[topology] = capacity
        # Rounds through the levels (0.5x, 1x, 1.5x, 0.5x, ...): the host's speed drifts from one
        # minute to the next (benchmarks/served_step_drift.py), and each level's runs are spread
        # over the whole stretch instead of sitting in one part of it.
        runs: dict[float, list[tuple[dict, dict, dict | None, str]]] = {level: [] for level in scale.load_levels}
        other_shares: dict[float, list[float]] = {level: [] for level in scale.load_levels}
        for round_index in range(scale.rounds):
            if calibrate and round_index > 0:
                # One more calibration run between rounds (loads alternating): the interleaved
                # calibration below fits these with the first ones, spanning the whole stretch.
                k = len(windows)
                load = CALIBRATION_LOADS[k % len(CALIBRATION_LOADS)]
                calibration_run(k, load, out_dir / f"calibration_{name}_r{round_index + 1}_x{load:g}.json")
            for index, level in enumerate(scale.load_levels):
                rate = level * capacity
                tag = f"{name}_x{level:g}" + (f"_r{round_index + 1}" if scale.rounds > 1 else "")
                seed = index + 1 + 100 * round_index  # prompts of their own: no run hits another's prefix cache
                wait_for_idle(pids, max_wait_idle_s)
                with other_work(pids) as other:
                    real = bench_serve(server.url, rate, scale.num_prompts, seed, scale, out_dir / f"real_{tag}.json",
                                       log)
                other_shares[level].append(other.value)
                trace = ["--workload", "trace", str(out_dir / f"trace_{tag}.jsonl")]
                write_trace(real, out_dir / f"trace_{tag}.jsonl")
                sim = simulate(sim_profile, topology, trace, scale, out_dir / f"sim_{tag}.json", log)
                offline = (simulate(profile, topology, trace, scale, out_dir / f"sim_offline_{tag}.json", log)
                           if calibrate else None)
                runs[level].append((real, sim, offline, tag))
                print(format_rows([compare(topology, level, rate, [real], [sim], scale)]), flush=True)
        interleaved_profile = None
        if calibrate and len(windows) > len(CALIBRATION_LOADS):
            # The calibration runs of the whole stretch, before and between the rounds: the
            # host's speed over the same minutes as the levels (still other requests than theirs).
            interleaved_profile = out_dir / f"profile_calibrated_{name}_interleaved.json"
            calibrate_on(interleaved_profile)
        for level in scale.load_levels:
            reals, sims, offlines, tags = (list(x) for x in zip(*runs[level]))
            rate = level * capacity
            cell = {**compare(topology, level, rate, reals, sims, scale), "other_work_share": max(other_shares[level]),
                    "profile": str(sim_profile)}
            if calibrate:
                cell["offline"] = compare(topology, level, rate, reals, offlines, scale)
            if interleaved_profile is not None:
                inter = [simulate(interleaved_profile, topology,
                                  ["--workload", "trace", str(out_dir / f"trace_{tag}.jsonl")], scale,
                                  out_dir / f"sim_interleaved_{tag}.json", log) for tag in tags]
                cell["interleaved"] = {**compare(topology, level, rate, reals, inter, scale),
                                       "profile": str(interleaved_profile)}
            cells.append(cell)
    finally:
        stop_server(server)
    return cells


def compare(topology: str, level: float, rate: float, reals: list[dict], sims: list[dict], scale: Scale) -> dict:
    """One cell: the level's real runs pooled against the simulator's runs on their arrivals."""
    real_m = score(reals, scale.slo_ttft_ms, scale.slo_tpot_ms)
    sim_m = score(sims, scale.slo_ttft_ms, scale.slo_tpot_ms)
    errors = {k: relative_error(sim_m[k], real_m[k]) for k in METRICS}
    per_run = [score(r, scale.slo_ttft_ms, scale.slo_tpot_ms) for r in reals] if len(reals) > 1 else []
    # How far the real runs of this level are from each other: (max - min) / pooled, per metric.
    spread = {k: (max(r[k] for r in per_run) - min(r[k] for r in per_run)) / real_m[k]
              for k in METRICS if per_run and real_m[k] and all(r[k] is not None for r in per_run)}
    return {
        "topology": topology, "load": level, "rate": rate, "num_runs": len(reals), "real": real_m, "sim": sim_m,
        "rel_error": errors, "is_within_goal": all(e is not None and abs(e) <= GOAL for e in errors.values()),
        "real_runs": per_run, "real_spread": spread,
        "real_ttft_breakdown_ms": [r.get("ttft_breakdown_ms") for r in reals],
        "sim_ttft_breakdown_ms": [s.get("ttft_breakdown_ms") for s in sims],
    }


HEADERS = ["topology", "load", "req/s", *(f"{m} real / sim (err)" for m in METRICS), "≤10 %", "other work"]


def format_rows(cells: list[dict]) -> str:
    rows = []
    for c in cells:
        row = [c["topology"], f"{c['load']:g}x", f"{c['rate']:.2f}"]
        for m in METRICS:
            real, sim, err = c["real"][m], c["sim"][m], c["rel_error"][m]
            digits = 2 if m == "goodput" else 0
            row.append(f"{real:.{digits}f} / {sim:.{digits}f} ({100 * err:+.1f} %)" if err is not None else "—")
        row.append("pass" if c["is_within_goal"] else "FAIL")
        row.append(f"{100 * c.get('other_work_share', 0.0):.0f} %")
        rows.append(row)
    return markdown_table(HEADERS, rows)


def format_spread(cells: list[dict]) -> str:
    rows = []
    for c in cells:
        row = [c["topology"], f"{c['load']:g}x"]
        for m in METRICS:
            values = [r[m] for r in c["real_runs"] if r[m] is not None]
            if m not in c["real_spread"] or not values:
                row.append("—")
                continue
            digits = 2 if m == "goodput" else 0
            inside = "in" if min(values) <= c["sim"][m] <= max(values) else "out"
            row.append(f"{min(values):.{digits}f}–{max(values):.{digits}f} ({100 * c['real_spread'][m]:.0f} %) {inside}")
        rows.append(row)
    return markdown_table(["topology", "load", *(f"{m} real runs (spread) sim" for m in METRICS)], rows)


def count_inside_spread(cells: list[dict]) -> tuple[int, int]:
    """Cells whose simulated value lies between the lowest and highest of the real runs."""
    inside = total = 0
    for c in cells:
        for m in METRICS:
            values = [r[m] for r in c.get("real_runs", []) if r[m] is not None]
            if len(values) > 1 and c["sim"][m] is not None:
                total += 1
                inside += min(values) <= c["sim"][m] <= max(values)
    return inside, total


def count_within(cells: list[dict]) -> tuple[int, int]:
    errors = [e for c in cells for e in c["rel_error"].values() if e is not None]
    return sum(1 for e in errors if abs(e) <= GOAL), len(errors)


def build_report(cells: list[dict], capacities: dict[str, float], scale: Scale, commands: list[str],
                 busy: float, profile: Path, offline_capacities: dict[str, float]) -> str:
    num_within, num_cells = count_within(cells)
    offline = [{**c["offline"], "other_work_share": c["other_work_share"]} for c in cells if "offline" in c]
    calibrated = bool(offline)
    lines = [
        "# sim_fidelity",
        "",
        (f"Random workload: {scale.rounds} run(s) of {scale.num_prompts} requests per level, in rounds through the "
         f"levels (the seed of level k in round r: k + 100 (r - 1)); a cell pools its runs' requests (percentiles "
         f"over all of them, goodput over the runs' summed spans); {scale.input_len} prompt tokens and "
         f"{scale.output_len} output tokens (±{100 * scale.range_ratio:.0f} %), Poisson arrivals; "
         f"after {scale.num_warmup_prompts} unscored warm-up requests per server"
         + (" or as many as cycle every worker's KV pool once (`warmup_*.json`). " if scale.cycle_kv_pool else ". ")
         + f"SLO: TTFT ≤ {scale.slo_ttft_ms:g} ms and TPOT ≤ {scale.slo_tpot_ms:g} ms. Loads are multiples of the "
         f"capacity the simulator estimates from the {'calibrated' if calibrated else 'offline'} profile (highest "
         "rate with ≥ 90 % SLO attainment): " + ", ".join(f"{t}: {r:g} req/s" for t, r in capacities.items())
         + "; from the offline profile: " + ", ".join(f"{t}: {r:g} req/s" for t, r in offline_capacities.items())
         + "."),
        "",
        f"Machine: {machine_summary(busy)}  ",
        f"Offline profile: `{profile}`",
        "",
    ]
    if calibrated:
        lines += [
            (f"Simulated on the calibrated profile: before the levels, each server ran {scale.num_calibration_prompts} "
             "unscored requests at each of " + " and ".join(f"{x:g}x" for x in CALIBRATION_LOADS)
             + f" the offline capacity estimate (seeds {CALIBRATION_SEED}+) with its workers tracing "
             "their steps, and `epdserve calibrate --window` (the calibration runs' steps, not the warm-up's) "
             "fitted each role's traced step times against the profile's prediction for the same shapes: per "
             "term group (base, prefill terms, decode terms) a factor for a step while the other worker is "
             "idle, and the extra while it is mid-step (simulated with `--instances-per-host 2`):"),
            "",
            *format_factors(calibration_factors(cells)),
            "",
        ]
    lines += [format_rows(cells), "", f"Cells within {100 * GOAL:.0f} %: {num_within} of {num_cells}.", ""]
    if any(c.get("real_runs") for c in cells):
        num_inside, num_spread = count_inside_spread(cells)
        lines += [("The real runs of each level against each other: each metric's lowest and highest over the runs, "
                  "their spread ((highest - lowest) / pooled), and whether the simulator's pooled value lies "
                  "between them:"), "", format_spread(cells), "",
                  f"Simulated value within the real runs' range: {num_inside} of {num_spread}.", ""]
    interleaved = [{**c["interleaved"], "other_work_share": c["other_work_share"]} for c in cells if "interleaved" in c]
    if interleaved:
        in_within, in_cells = count_within(interleaved)
        lines += [("The same real runs simulated on a profile calibrated on every calibration run of the stretch: "
                   "the two before the levels and one between each two rounds (alternating loads, seeds of their "
                   "own), so that the calibrated speed is the host's over the same minutes as the levels' runs "
                   "(never their requests):"), "", *format_factors(calibration_factors(interleaved)), "",
                  format_rows(interleaved), "", f"Cells within {100 * GOAL:.0f} %: {in_within} of {in_cells}.", ""]
    if calibrated:
        off_within, off_cells = count_within(offline)
        lines += ["The same real runs simulated on the offline profile (no calibration):", "", format_rows(offline), "",
                  f"Cells within {100 * GOAL:.0f} %: {off_within} of {off_cells}.", ""]
    lines += ["Commands:", "",
              *[f"- `{c}`" for c in commands if not c.startswith("epdserve simulate") or "trace" in c], ""]
    return "\n".join(lines)


def format_factors(factors: dict[str, dict]) -> list[str]:
    """One bullet per topology: each role's calibrated factors."""
    return [f"- {topology}: " + "; ".join(
        f"{role}: " + ", ".join(f"{term} × {cal['alone'][term]:.3f} (+{cal['busy'][term]:.3f} next to a busy worker)"
                                for term in cal["alone"])
        + f" ({cal['num_steps']} steps; served / predicted overall {cal['factor']:.3f})"
        for role, cal in roles.items()) for topology, roles in factors.items()]


def calibration_factors(cells: list[dict]) -> dict[str, dict]:
    """Per topology, the calibrated profile's ``calibration.roles`` record."""
    out = {}
    for c in cells:
        if c["topology"] not in out and c.get("profile"):
            raw = json.loads(Path(c["profile"]).read_text())
            out[c["topology"]] = raw.get("calibration", {}).get("roles", {})
    return {t: f for t, f in out.items() if f}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, default=None, help="profile.json (default: measure one first)")
    parser.add_argument("--out", type=Path, default=Path("out/sim_fidelity"))
    parser.add_argument("--only", choices=list(TOPOLOGIES), default=None, help="run just this topology")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks that everything runs")
    parser.add_argument("--rounds", type=int, default=None,
                        help="real runs per level, in rounds through the levels (default: 3; --quick: 1)")
    parser.add_argument("--busy-neighbours", action="store_true",
                        help="profile each role next to a busy worker on the other core (epdserve profile flag)")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="simulate on the offline profile only (no calibration run)")
    parser.add_argument("--max-wait-idle-s", type=float, default=600.0,
                        help="before each level, wait up to this long for other work to leave the CPUs")
    parser.add_argument("--slo-ttft-ms", type=float, default=None,
                        help=f"TTFT SLO (default: {SLO_TTFT_PREFILLS:g} x one prompt's prefill on the profile)")
    parser.add_argument("--slo-tpot-ms", type=float, default=None,
                        help=f"TPOT SLO (default: {SLO_TPOT_STEPS:g} x a decode step of one sequence on the profile)")
    ns = parser.parse_args(argv)
    scale = QUICK if ns.quick else FULL
    if ns.rounds is not None:
        if ns.rounds < 1:
            parser.error("--rounds must be at least 1")
        scale = replace(scale, rounds=ns.rounds)
    for flag, value in (("--slo-ttft-ms", ns.slo_ttft_ms), ("--slo-tpot-ms", ns.slo_tpot_ms)):
        if value is not None and value <= 0:
            parser.error(f"{flag} must be positive")
    out_dir: Path = ns.out
    out_dir.mkdir(parents=True, exist_ok=True)
    busy = cpu_busy_share()
    print(f"CPU busy with other work before the start: {100 * busy:.0f} %", flush=True)
    commands: list[str] = []
    profile = ns.profile
    if profile is None:
        wait_for_idle([], ns.max_wait_idle_s)
        profile = out_dir / "profile.json"
        run_logged(epdserve("profile", "--roles", "colocated,prefill,decode", "--threads", "colocated=1",
                            *ENGINE_FLAGS, "--out", str(profile), "--disable-tqdm",
                            *(["--busy-neighbours"] if ns.busy_neighbours else []),
                            *(["--quick"] if scale.profile_quick else [])), commands)
    auto_ttft_ms, auto_tpot_ms = slo_from_profile(profile, scale)
    scale = replace(scale, slo_ttft_ms=ns.slo_ttft_ms or auto_ttft_ms, slo_tpot_ms=ns.slo_tpot_ms or auto_tpot_ms)
    print(f"SLO: TTFT <= {scale.slo_ttft_ms:g} ms, TPOT <= {scale.slo_tpot_ms:g} ms", flush=True)
    topologies = [ns.only] if ns.only else list(TOPOLOGIES)
    started = time.time()
    capacities = {t: estimate_capacity(profile, t, scale, out_dir / "capacity", commands) for t in topologies}
    print("capacity (simulated): " + ", ".join(f"{t} {r:g} req/s" for t, r in capacities.items()), flush=True)
    offline_capacities = dict(capacities)  # run_topology replaces each by the calibrated estimate
    cells = [cell for t in topologies for cell in run_topology(t, profile, capacities, scale, out_dir, commands,
                                                    ns.max_wait_idle_s, not ns.no_calibrate)]
    report = build_report(cells, capacities, scale, commands, busy, profile, offline_capacities)
    results = {"scale": scale.__dict__, "capacities": capacities, "offline_capacities": offline_capacities,
               "cells": cells, "busy_at_start": busy,
               "profile": str(profile), "commands": commands, "wall_s": time.time() - started}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    (out_dir / "report.md").write_text(report, encoding="utf-8")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
