"""Simulator fidelity: real epdserve against ``epdserve simulate`` on the same arrivals.

    python benchmarks/sim_fidelity.py [--profile P] [--out out/sim_fidelity] [--quick] [--no-calibrate]

1. Profile this machine (``epdserve profile``, colocated workers at 1 thread: in both
   topologies every worker has one core), unless ``--profile`` is given.
2. Estimate each topology's capacity with the simulator: the highest rate whose SLO
   attainment is >= 90 % on the random workload (256 in / 96 out tokens, +-25 %).
3. For each topology (colocated x2: two colocated workers on one core each; 1P1D: one prefill
   and one decode worker on one core each), start ``epdserve serve`` with step tracing, send
   an unscored warm-up, then (unless ``--no-calibrate``) unscored calibration runs at 0.75 x
   and 1.25 x capacity with seeds of their own, and ``epdserve calibrate --since`` the profile
   on the steps the workers traced in them (not the warm-up's). Then run ``epdserve bench serve`` at 0.5, 1.0 and 1.5 x capacity (each level
   has prompts of its own fixed seed, so none hits the prefix cache).
4. Write each run's requests as a Mooncake trace (send time, prompt tokens as the server
   counted them, output tokens) and replay it with ``epdserve simulate`` on the calibrated
   profile, and on the offline profile for comparison.
5. Per (topology, load): TTFT P50/P99, TPOT P50/P99 and goodput, real vs simulated, the
   relative error of each cell, and whether it is within 10 %.

Both sides are scored by the same function from per-request records: TTFT, TPOT =
(E2E - TTFT)/(output - 1), goodput = requests meeting every SLO / (last finish - first send).
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
from dataclasses import dataclass
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


FULL = Scale(160, 16, 150, 256, 96, 0.25, (0.5, 1.0, 1.5), 1000.0, 80.0, False, True)
QUICK = Scale(10, 4, 24, 64, 8, 0.25, (0.5, 1.0), 1000.0, 80.0, True, False)


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


def score(result: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """The compared metrics from a bench-shaped result's per-request lists."""
    ok = [i for i, err in enumerate(result["errors"]) if not err]
    ttft = np.array([result["ttfts"][i] for i in ok]) * 1e3
    e2e = np.array([result["latencies"][i] for i in ok]) * 1e3
    out = np.array([result["output_lens"][i] for i in ok])
    tpot = np.where(out > 1, (e2e - ttft) / np.maximum(out - 1, 1), 0.0)
    starts = np.array(result["start_times"])
    ends = np.array([result["start_times"][i] + result["latencies"][i] for i in range(len(starts))])
    span_s = float(ends.max() - starts.min()) if len(starts) else 0.0
    num_good = int(np.sum((ttft <= slo_ttft_ms) & (tpot <= slo_tpot_ms)))
    has_tpot = out > 1
    return {
        "ttft_p50_ms": float(np.percentile(ttft, 50)) if ok else None,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) if ok else None,
        "tpot_p50_ms": float(np.percentile(tpot[has_tpot], 50)) if has_tpot.any() else None,
        "tpot_p99_ms": float(np.percentile(tpot[has_tpot], 99)) if has_tpot.any() else None,
        "goodput": num_good / span_s if span_s > 0 else 0.0,
        "attainment": num_good / len(starts) if len(starts) else 0.0,
        "num_failed": len(starts) - len(ok),
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
        if calibrate:
            # Calibrate on the calibration runs' steps only: the warm-up starts on a fresh KV
            # pool, and steps ran faster until its free list had churned.
            since = time.monotonic()
            for k, load in enumerate(CALIBRATION_LOADS):
                wait_for_idle(pids, max_wait_idle_s)
                bench_serve(server.url, load * capacity, scale.num_calibration_prompts, CALIBRATION_SEED + k, scale,
                            out_dir / f"calibration_{name}_x{load:g}.json", log)
            sim_profile = out_dir / f"profile_calibrated_{name}.json"
            # The workers' trace files are line-buffered: every step of the calibration runs
            # is on disk; the levels' steps come later and are not read here.
            run_logged(epdserve("calibrate", "--profile", str(profile), "--step-trace-dir", str(trace_dir),
                                "--since", f"{since:.6f}", "--out", str(sim_profile)), log)
            # The levels are multiples of what the calibrated simulator says this deployment holds.
            capacity = estimate_capacity(sim_profile, topology, scale, out_dir / "capacity_calibrated", log)
            capacities[topology] = capacity
        for index, level in enumerate(scale.load_levels):
            rate = level * capacity
            tag = f"{name}_x{level:g}"
            wait_for_idle(pids, max_wait_idle_s)
            with other_work(pids) as other:
                real = bench_serve(server.url, rate, scale.num_prompts, index + 1, scale, out_dir / f"real_{tag}.json",
                                   log)
            trace = ["--workload", "trace", str(out_dir / f"trace_{tag}.jsonl")]
            write_trace(real, out_dir / f"trace_{tag}.jsonl")
            sim = simulate(sim_profile, topology, trace, scale, out_dir / f"sim_{tag}.json", log)
            cell = {**compare(topology, level, rate, real, sim, scale), "other_work_share": other.value,
                    "profile": str(sim_profile)}
            if calibrate:
                offline = simulate(profile, topology, trace, scale, out_dir / f"sim_offline_{tag}.json", log)
                cell["offline"] = compare(topology, level, rate, real, offline, scale)
            cells.append(cell)
            print(format_rows([cells[-1]]), flush=True)
    finally:
        stop_server(server)
    return cells


def compare(topology: str, level: float, rate: float, real: dict, sim: dict, scale: Scale) -> dict:
    real_m = score(real, scale.slo_ttft_ms, scale.slo_tpot_ms)
    sim_m = score(sim, scale.slo_ttft_ms, scale.slo_tpot_ms)
    errors = {k: relative_error(sim_m[k], real_m[k]) for k in METRICS}
    return {
        "topology": topology, "load": level, "rate": rate, "real": real_m, "sim": sim_m, "rel_error": errors,
        "is_within_goal": all(e is not None and abs(e) <= GOAL for e in errors.values()),
        "real_ttft_breakdown_ms": real.get("ttft_breakdown_ms"), "sim_ttft_breakdown_ms": sim.get("ttft_breakdown_ms"),
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
        (f"Random workload: {scale.num_prompts} requests per level, {scale.input_len} prompt tokens and "
         f"{scale.output_len} output tokens (±{100 * scale.range_ratio:.0f} %), Poisson arrivals, seed 1, 2, 3 "
         f"for the levels, after {scale.num_warmup_prompts} unscored warm-up requests per server"
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
             "their steps, and `epdserve calibrate --since` (the calibration runs' steps, not the warm-up's) "
             "fitted each role's traced step times against the profile's prediction for the same shapes: per "
             "term group (base, prefill terms, decode terms) a factor for a step while the other worker is "
             "idle, and the extra while it is mid-step (simulated with `--instances-per-host 2`):"),
            "",
            *[f"- {topology}: " + "; ".join(
                f"{role}: " + ", ".join(f"{term} × {cal['alone'][term]:.3f} (+{cal['busy'][term]:.3f} next to a busy "
                                        "worker)" for term in cal["alone"])
                + f" ({cal['num_steps']} steps; served / predicted overall {cal['factor']:.3f})"
                for role, cal in factors.items())
              for topology, factors in calibration_factors(cells).items()],
            "",
        ]
    lines += [format_rows(cells), "", f"Cells within {100 * GOAL:.0f} %: {num_within} of {num_cells}.", ""]
    if calibrated:
        off_within, off_cells = count_within(offline)
        lines += ["The same real runs simulated on the offline profile (no calibration):", "", format_rows(offline), "",
                  f"Cells within {100 * GOAL:.0f} %: {off_within} of {off_cells}.", ""]
    lines += ["Commands:", "",
              *[f"- `{c}`" for c in commands if not c.startswith("epdserve simulate") or "trace" in c], ""]
    return "\n".join(lines)


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
    parser.add_argument("--busy-neighbours", action="store_true",
                        help="profile each role next to a busy worker on the other core (epdserve profile flag)")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="simulate on the offline profile only (no calibration run)")
    parser.add_argument("--max-wait-idle-s", type=float, default=600.0,
                        help="before each level, wait up to this long for other work to leave the CPUs")
    ns = parser.parse_args(argv)
    scale = QUICK if ns.quick else FULL
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
