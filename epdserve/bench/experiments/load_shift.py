"""``load-shift``: workers that change role as the mix moves, against the best fixed split, and
admission that predicts the SLO against a plain queue bound under 2x overload.

The trace. From the Azure LLM conversation trace: a prefill-heavy phase (its requests with
long prompts and short answers), a decode-heavy phase (short prompts, long answers), then the
prefill-heavy mix again; each phase's arrivals keep the trace's own gaps, time-scaled to the
phase's rate. Prompt lengths are scaled down (``input_scale``) for this machine; answers are
kept in the decode-heavy phase and halved in the prefill-heavy one (``output_scales``): on
this CPU a decode step pays ~7 us per context token per sequence (attention over the prompt),
so after a 1000-token prompt the trace's 47-token answers would make that phase about as much
decode work as prefill work, and neither phase would favour a side.

Four workers, each with a CPU quota of half a core (``cpu_quota.py``: four machines of half a
core each, which a host of two cores cannot otherwise show: pinned two to a core, an idle
worker would hand its core to its busy neighbour and every split would look alike):

    arm               workers
    prefill=3,decode=1  fixed split
    prefill=2,decode=2  fixed split
    prefill=1,decode=3  fixed split
    role switching      starts prefill=2,decode=2, --role-switching auto with the SLO below
    colocated=4         for reference

Reported per arm and phase: goodput at the SLO (TTFT and TPOT), SLO attainment, TTFT and TPOT
P50/P99, and the workers' roles over time. Goal: role switching >= 1.3x the goodput of the
best fixed split over the whole trace.

Overload. The prefill-heavy mix at twice the rate the best fixed split for it holds at the
SLO, on that split, with ``--admission queue`` and ``--admission predictive`` (the TTFT SLO
as the interactive class's). Goal: predictive keeps the SLO attainment of the requests it
admits >= 90 % where the queue bound's falls below 50 %.

The simulator runs the same trace through the same controller (``sim/roles.py``) with this
host's profile taken under the same quota and calibrated (``epdserve calibrate``) with the step
traces of the prefill=2,decode=2 arm, so the switches it makes can be set beside the real ones.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
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
from epdserve.bench.experiments.load_shift_report import (
    NAME,
    build_report,
    goals,
    goals_overload,
    phase_summary,
    write_plots,
)
from epdserve.bench.experiments.report import begin, write_outputs
from epdserve.bench.traces import TraceRecord, read_csv_trace
from epdserve.envs import EPDSERVE_TRACES_DIR, get_traces_dir

TRACE_FILE = "azure_conv.csv"
MIXES = ("prefill-heavy", "decode-heavy")
ROLE_POLL_S = 1.0


@dataclass(frozen=True)
class Phase:
    name: str
    mix: str  # "prefill-heavy" | "decode-heavy"
    duration_s: float
    rate: float  # requests per second


@dataclass(frozen=True)
class Scale:
    phases: tuple[Phase, ...]
    overload: Phase  # the prefill-heavy mix at 2x the rate its best split holds
    input_scale: float
    output_scales: tuple[float, float]  # answers of the (prefill-heavy, decode-heavy) requests
    max_input_len: int
    max_output_len: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    cpu_share: float  # cores per worker (its quota)
    max_model_len: int
    dwell_s: float  # --role-switching-dwell
    cooldown_s: float
    window_s: float
    profile: bool  # take this host's profile under the quota for the simulator


FULL = Scale(
    phases=(Phase("A1", "prefill-heavy", 150.0, 2.0), Phase("B", "decode-heavy", 120.0, 3.6),
            Phase("A2", "prefill-heavy", 150.0, 2.0)),
    overload=Phase("overload", "prefill-heavy", 90.0, 4.0),
    input_scale=0.25, output_scales=(0.5, 1.0), max_input_len=1536, max_output_len=320,
    slo_ttft_ms=3000.0, slo_tpot_ms=250.0, cpu_share=0.5, max_model_len=2048,
    dwell_s=20.0, cooldown_s=5.0, window_s=10.0, profile=True)
QUICK = Scale(
    phases=(Phase("A1", "prefill-heavy", 10.0, 1.0), Phase("B", "decode-heavy", 10.0, 1.0)),
    overload=Phase("overload", "prefill-heavy", 8.0, 2.0),
    input_scale=0.1, output_scales=(0.2, 0.1), max_input_len=512, max_output_len=32,
    slo_ttft_ms=5000.0, slo_tpot_ms=500.0, cpu_share=0.5, max_model_len=1024,
    dwell_s=2.0, cooldown_s=1.0, window_s=3.0, profile=False)

SPLITS = ("prefill=3,decode=1", "prefill=2,decode=2", "prefill=1,decode=3")
SWITCHING = "role switching"
COLOCATED = "colocated=4"
ARMS = (*SPLITS, SWITCHING, COLOCATED)
CALIBRATION_ARM = SPLITS[1]  # its step traces calibrate the simulator's profile (both roles, busy)


# ---------------------------------------------------------------- the trace


def is_prefill_heavy(record: TraceRecord) -> bool:
    return record.input_length >= 1000 and record.output_length <= 64


def is_decode_heavy(record: TraceRecord) -> bool:
    return record.input_length <= 256 and record.output_length >= 200


def build_trace(records: list[TraceRecord], phases: tuple[Phase, ...], scale: Scale) -> list[TraceRecord]:
    """The phases one after another: each takes the next requests of its mix in the trace's
    order, with the trace's gaps between them scaled to the phase's mean rate, and lengths
    scaled and clipped to ``scale``'s bounds. Arrival times in seconds from 0."""
    pools = {"prefill-heavy": [r for r in records if is_prefill_heavy(r)],
             "decode-heavy": [r for r in records if is_decode_heavy(r)]}
    taken = {mix: 0 for mix in pools}
    out: list[TraceRecord] = []
    start = 0.0
    for phase in phases:
        pool = pools[phase.mix]
        num = max(1, round(phase.duration_s * phase.rate))
        first = taken[phase.mix]
        if first + num + 1 > len(pool):
            raise BenchError(f"the trace has {len(pool)} {phase.mix} requests; phase {phase.name} needs {num}")
        taken[phase.mix] = first + num
        chosen = pool[first : first + num + 1]
        gaps = np.diff([r.arrival_s for r in chosen])
        gaps = gaps * (phase.duration_s / num) / max(float(gaps.mean()), 1e-9)
        arrivals = start + np.concatenate([[0.0], np.cumsum(gaps[:-1])])
        output_scale = scale.output_scales[MIXES.index(phase.mix)]
        for r, t in zip(chosen[:num], arrivals):
            out.append(TraceRecord(float(t), _scaled(r.input_length, scale.input_scale, scale.max_input_len),
                                   _scaled(r.output_length, output_scale, scale.max_output_len)))
        start += phase.duration_s
    return out


def _scaled(n: int, factor: float, most: int) -> int:
    return int(min(max(1, round(n * factor)), most))


def phase_of(records: list[TraceRecord], phases: tuple[Phase, ...]) -> list[str]:
    """Each record's phase, by its arrival time."""
    ends = np.cumsum([p.duration_s for p in phases])
    return [phases[min(int(np.searchsorted(ends, r.arrival_s, side="right")), len(phases) - 1)].name
            for r in records]


def write_trace(records: list[TraceRecord], path: Path) -> None:
    """As a Mooncake-style JSONL (``bench serve --dataset trace`` reads it): no shared prefixes."""
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1e3, 3), "input_length": r.input_length,
                                "output_length": r.output_length}) + "\n")


def trace_stats(records: list[TraceRecord], phases: tuple[Phase, ...]) -> dict:
    names = phase_of(records, phases)
    out = {}
    for phase in phases:
        mine = [r for r, n in zip(records, names) if n == phase.name]
        out[phase.name] = {"mix": phase.mix, "num_requests": len(mine), "duration_s": phase.duration_s,
                           "rate": len(mine) / phase.duration_s,
                           "mean_input_len": float(np.mean([r.input_length for r in mine])),
                           "mean_output_len": float(np.mean([r.output_length for r in mine]))}
    return out


# ---------------------------------------------------------------- one arm


def serve_flags(arm: str, scale: Scale, admission: str = "queue", split: str | None = None,
                step_trace_dir: Path | None = None) -> list[str]:
    topology = split or (SPLITS[1] if arm == SWITCHING else arm)
    counts = dict(part.split("=") for part in topology.split(","))
    flags = ["--cores-per-worker", "1", "--max-model-len", str(scale.max_model_len)]
    if "colocated" in counts:
        flags += ["--colocated-workers", counts["colocated"]]
    else:
        flags += ["--prefill-workers", counts["prefill"], "--decode-workers", counts["decode"]]
    slo = f"ttft:{scale.slo_ttft_ms:g},tpot:{scale.slo_tpot_ms:g}"
    flags += ["--service-class-slo", f"interactive={slo}", "--admission", admission]
    if step_trace_dir is not None:
        flags += ["--step-trace-dir", str(step_trace_dir)]
    if arm == SWITCHING:
        flags += ["--role-switching", "auto", "--role-switching-dwell", f"{scale.dwell_s:g}",
                  "--role-switching-cooldown", f"{scale.cooldown_s:g}",
                  "--role-switching-window", f"{scale.window_s:g}"]
    return flags


def bench_cmd(server: RunningServer, trace: Path, scale: Scale, out: Path) -> list[str]:
    return epdserve_cmd("bench", "serve", "--base-url", server.url, "--dataset", "trace",
                        "--dataset-path", str(trace), "--ignore-eos", "--return-timing",
                        "--goodput", f"ttft:{scale.slo_ttft_ms:g}", f"tpot:{scale.slo_tpot_ms:g}",
                        "--result-json", str(out), "--disable-tqdm")


class RoleWatch:
    """Polls ``/v1/roles`` while a run goes: the workers per role over time."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.samples: list[dict] = []
        self.switches: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="role-watch", daemon=True)
        self.start_s = time.time()

    def __enter__(self) -> RoleWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(headers=auth_headers(self.server), timeout=5) as client:
            while not self._stop.wait(ROLE_POLL_S):
                try:
                    body = client.get(f"{self.server.url}/v1/roles").json()
                except (httpx.HTTPError, ValueError):
                    continue
                counts = {role: sum(states.values()) for role, states in body["workers"].items()}
                self.samples.append({"t": time.time() - self.start_s, "workers": body["workers"],
                                     "counts": counts, "pressure": body.get("pressure")})
                self.switches = [{**s, "t": s["time"] - self.start_s} for s in body.get("switches", [])]


def run_arm(arm: str, trace: Path, scale: Scale, out_dir: Path, commands: list[str], tag: str,
            admission: str = "queue", split: str | None = None, step_trace_dir: Path | None = None) -> dict:
    """A fresh server with four quota-limited workers; the trace replayed once."""
    server = start_server(serve_flags(arm, scale, admission, split, step_trace_dir), out_dir / "logs" / tag)
    commands.append(server.command)
    quotas = cpu_quota.CpuQuotas(scale.cpu_share)
    result_path = out_dir / "runs" / f"{tag}.json"
    result_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        for w in list_workers(server):
            quotas.limit(w["pid"], w["id"])
        with RoleWatch(server) as watch:
            run_command(bench_cmd(server, trace, scale, result_path), commands)
        throttled = quotas.throttled_s()
    finally:
        stop_server(server)
        quotas.close()
    result = json.loads(result_path.read_text(encoding="utf-8"))
    return {"arm": arm, "admission": admission, "result_file": str(result_path.relative_to(out_dir)),
            "requests": per_request(result), "roles": watch.samples, "switches": watch.switches,
            "throttled_s": throttled}


def per_request(result: dict) -> list[dict]:
    """Per request (in trace order): TTFT, TPOT, success, output tokens, the error's status."""
    out = []
    for ttft, latency, n, err in zip(result["ttfts"], result["latencies"], result["output_lens"], result["errors"]):
        tpot = (latency - ttft) / (n - 1) if not err and n > 1 else None
        out.append({"ok": not err, "ttft_s": ttft if not err else None, "tpot_s": tpot, "output_len": n,
                    "status": (err.split("HTTP ", 1)[1][:3] if "HTTP " in err else "error") if err else "200"})
    return out


# ---------------------------------------------------------------- the simulator


def simulate(trace: Path, profile: Path, scale: Scale, arm: str, out: Path, commands: list[str]) -> dict:
    """The same trace through the simulator with the controller (or a fixed split)."""
    topology = SPLITS[1] if arm == SWITCHING else arm
    cmd = epdserve_cmd("simulate", "--profile", str(profile), "--topology", topology, "--workload", "trace",
                       str(trace), "--max-model-len", str(scale.max_model_len),
                       "--goodput", f"ttft:{scale.slo_ttft_ms:g}", f"tpot:{scale.slo_tpot_ms:g}",
                       "--max-detail-requests", "0", "--out", str(out), "--quiet")
    if arm == SWITCHING:
        cmd += ["--role-switching", "auto", "--role-switching-slo",
                f"ttft:{scale.slo_ttft_ms:g},tpot:{scale.slo_tpot_ms:g}",
                "--role-switching-dwell", f"{scale.dwell_s:g}", "--role-switching-cooldown", f"{scale.cooldown_s:g}",
                "--role-switching-window", f"{scale.window_s:g}"]
    run_command(cmd, commands)
    result = json.loads(out.read_text(encoding="utf-8"))
    return {"arm": arm, "requests": per_request(result),
            "switches": (result["simulator"].get("role_switching") or {}).get("switches", [])}


def take_profile(scale: Scale, out_dir: Path, commands: list[str]) -> Path:
    """This host's prefill and decode profile, one thread under the workers' quota."""
    import subprocess

    path = out_dir / "profile_quota.json"
    cmd = epdserve_cmd("profile", "--roles", "prefill,decode", "--max-model-len", str(scale.max_model_len),
                       "--out", str(path))
    commands.append(" ".join(cmd) + f"  # in a cgroup of {scale.cpu_share:g} core")
    quotas = cpu_quota.CpuQuotas(scale.cpu_share)
    try:
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   stdin=subprocess.DEVNULL)
        quotas.limit(process.pid, "profile")
        _, err = process.communicate()
    finally:
        quotas.close()
    if process.returncode != 0:
        raise BenchError(f"epdserve profile failed: {err.strip()[-300:]}")
    return path


def calibrate(profile: Path, step_trace_dir: Path, out_dir: Path, commands: list[str]) -> Path:
    """The profile scaled to the steps the calibration arm's workers took in service."""
    path = out_dir / "profile_calibrated.json"
    run_command(epdserve_cmd("calibrate", "--profile", str(profile), "--step-trace-dir", str(step_trace_dir),
                             "--out", str(path)), commands)
    return path


# ---------------------------------------------------------------- the experiment


def run(out_dir: Path, quick: bool) -> str:
    experiment = begin(NAME, out_dir, quick)
    scale = QUICK if quick else FULL
    why = cpu_quota.available()
    if why is not None:
        raise BenchError(f"load-shift gives each worker a CPU quota and cannot here: {why}")
    source = get_traces_dir() / TRACE_FILE
    if not source.is_file():
        raise BenchError(f"the Azure conversation trace is not at {source} (set ${EPDSERVE_TRACES_DIR})")
    out_dir.mkdir(parents=True, exist_ok=True)
    records = read_csv_trace(str(source))
    trace = build_trace(records, scale.phases, scale)
    overload = build_trace(records, (scale.overload,), scale)
    trace_path, overload_path = out_dir / "load_shift_trace.jsonl", out_dir / "overload_trace.jsonl"
    write_trace(trace, trace_path)
    write_trace(overload, overload_path)
    commands: list[str] = []
    arms = {}
    for arm in ARMS:
        print(f"load-shift: {arm}", flush=True)
        tag = arm.replace("=", "").replace(",", "_").replace(" ", "_")
        steps = out_dir / "steps" / tag if arm == CALIBRATION_ARM and scale.profile else None
        arms[arm] = run_arm(arm, trace_path, scale, out_dir, commands, tag, step_trace_dir=steps)
    phase_names = phase_of(trace, scale.phases)
    summary = goals(arms, phase_names, scale)
    overload_split = summary["best_split_by_phase"].get(scale.phases[0].name, SPLITS[0])
    admission = {policy: run_arm(SPLITS[0], overload_path, scale, out_dir, commands, f"overload_{policy}", policy,
                                 overload_split)
                 for policy in ("queue", "predictive")}
    sim = {}
    if scale.profile:
        profile = calibrate(take_profile(scale, out_dir, commands), out_dir / "steps" / CALIBRATION_ARM.replace(
            "=", "").replace(",", "_"), out_dir, commands)
        for arm in (*SPLITS, SWITCHING):
            sim[arm] = simulate(trace_path, profile, scale, arm, out_dir / "runs" / f"sim_{arm.replace('=', '')}.json",
                                commands)
    total_s = sum(p.duration_s for p in scale.phases)
    simulated = {arm: {"goodput": phase_summary(s["requests"], total_s, scale.slo_ttft_ms, scale.slo_tpot_ms)["goodput"],
                       "switches": s["switches"]} for arm, s in sim.items()}
    results = {"scale": asdict(scale), "trace": trace_stats(trace, scale.phases), "phase_of_request": phase_names,
               "arrival_s": [r.arrival_s for r in trace], "arms": arms,
               "overload": {"split": overload_split, "policies": admission}, "simulated": sim,
               "goals": {**summary, **goals_overload(admission, scale.slo_ttft_ms, scale.slo_tpot_ms),
                         "simulated": simulated},
               "commands": commands}
    plots = write_plots(results, out_dir)
    report = build_report(results, experiment, [p.name for p in plots])
    write_outputs(out_dir, results, report)
    return report
