"""``epdserve calibrate``: scale a profile's step costs to what the workers took in service.

An offline profile times each role's steps alone on its cores. In service the same steps take
longer: workers that share a host share its memory bandwidth and last-level cache, and the
router, the HTTP server and the clients take CPU time from the workers' cores. A short serving
run with ``epdserve serve --step-trace-dir DIR`` records every model step each worker ran
(``cluster/step_trace.py``); for each role this module sums the steps' time in service and the
time the profile predicts for the same shapes, and multiplies the role's coefficients by the
ratio. The result is a profile like any other (``simulate`` and ``plan`` read it) with a
``calibration`` record of the factors and what they were measured on.

The factor belongs to the packing it was measured on (which roles shared the host, at what
load); calibrate on the deployment the simulation is about.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from epdserve.errors import ConfigError
from epdserve.sim.cost_model import STEP_ROLES, CostModel, StepCost, StepShape

MIN_STEPS = 10  # a role needs at least this many traced steps to be calibrated


@dataclass(frozen=True)
class RoleCalibration:
    role: str
    num_steps: int
    served_s: float  # sum of the traced steps' time in service
    predicted_s: float  # sum of what the profile predicts for the same shapes
    alone: float  # served / predicted for a step while no other traced worker is mid-step
    neighbour_slowdown: float  # relative extra time while every other traced worker is mid-step
    cpu_share: float | None = None  # one-thread workers: their CPU time / served time (None: not traced)
    # ``alone`` for the prefill terms where the role's steps tell them apart (colocated steps
    # mix prefill and decode); None: one factor scales every term.
    alone_prefill: float | None = None

    @property
    def factor(self) -> float:
        return self.served_s / self.predicted_s

    def to_dict(self) -> dict:
        return {"factor": round(self.factor, 4), "alone": round(self.alone, 4),
                "alone_prefill": None if self.alone_prefill is None else round(self.alone_prefill, 4),
                "neighbour_slowdown": round(self.neighbour_slowdown, 4), "num_steps": self.num_steps,
                "cpu_share": None if self.cpu_share is None else round(self.cpu_share, 4),
                "served_s": round(self.served_s, 3), "predicted_s": round(self.predicted_s, 3)}


@dataclass(frozen=True)
class WorkerTrace:
    worker_id: str
    role: str
    starts: np.ndarray  # step start times (s, one clock for every worker of the host)
    walls: np.ndarray  # step times in service (s)
    shapes: list[StepShape]
    cpus: np.ndarray | None = None  # the worker's CPU time per step (s); None in traces without it
    num_threads: int = 1


def read_step_trace(path: Path) -> WorkerTrace:
    """A worker's trace file (``cluster/step_trace.py``)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read step trace {path}: {e.strerror}") from None
    try:
        header = json.loads(lines[0]) if lines else None
        if not isinstance(header, dict) or "role" not in header:
            raise ConfigError(f"{path}: the first line must name the worker's role")
        records = [json.loads(line) for line in lines[1:] if line.strip()]
        return WorkerTrace(
            str(header.get("worker_id", path.stem)), header["role"],
            np.array([float(d["t"]) for d in records]), np.array([float(d["wall_s"]) for d in records]),
            [StepShape.from_dict(d) for d in records],
            np.array([float(d["cpu_s"]) for d in records]) if all("cpu_s" in d for d in records) else None,
            int(header.get("num_threads", 1)),
        )
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: not a step trace ({e})") from None


def busy_overlap(trace: WorkerTrace, others: list[WorkerTrace]) -> np.ndarray:
    """Per step of ``trace``: the mean over the other workers of the share of the step during
    which that worker was mid-step (0: all idle throughout, 1: all busy throughout)."""
    if not others:
        return np.zeros(len(trace.walls))
    total = np.zeros(len(trace.walls))
    ends = trace.starts + trace.walls
    for other in others:
        order = np.argsort(other.starts)
        o_start, o_end = other.starts[order], (other.starts + other.walls)[order]
        # busy time of ``other`` before t: cumulative step time, clipped inside the step at t
        cum = np.concatenate([[0.0], np.cumsum(o_end - o_start)])

        def busy_before(t: np.ndarray, o_start=o_start, o_end=o_end, cum=cum) -> np.ndarray:
            i = np.searchsorted(o_start, t, side="right")  # steps begun before t
            last = np.maximum(i - 1, 0)
            partial = np.where(i > 0, np.minimum(t, o_end[last]) - o_start[last], 0.0)
            full = cum[last]
            return np.where(i > 0, full + np.maximum(partial, 0.0), 0.0)

        total += (busy_before(ends) - busy_before(trace.starts)) / np.maximum(trace.walls, 1e-9)
    return np.clip(total / len(others), 0.0, 1.0)


def fit_role(walls: np.ndarray, predicted: np.ndarray, overlap: np.ndarray) -> tuple[float, float]:
    """``wall ~ predicted x (alone + extra x overlap)`` by least squares; returns (alone,
    extra / alone). Without a spread of overlaps (or a negative slope) one factor fits all."""
    ratio = float(walls.sum() / predicted.sum())
    if overlap.max() - overlap.min() < 0.5:
        return ratio, 0.0
    x = np.column_stack([predicted, predicted * overlap])
    (alone, extra), *_ = np.linalg.lstsq(x, walls, rcond=None)
    if alone <= 0 or extra <= 0:
        return ratio, 0.0
    return float(alone), float(extra / alone)


SLOWDOWN_GRID = np.linspace(0.0, 1.0, 401)


def step_parts(step: StepCost, shapes: list[StepShape]) -> tuple[np.ndarray, np.ndarray]:
    """Each step's predicted time split into its prefill terms and the rest (base, decode)."""
    prefill = np.array([step.prefill_s(s) for s in shapes])
    rest = np.array([step.time_s(s) for s in shapes]) - prefill
    return prefill, rest


def fit_role_parts(walls: np.ndarray, prefill: np.ndarray, rest: np.ndarray,
                   overlap: np.ndarray) -> tuple[float, float, float] | None:
    """``wall ~ (kp x prefill + kd x rest) x (1 + slowdown x overlap)``, each step weighted by
    its own time (relative residuals: a 20 ms decode step counts as much as a 300 ms prefill);
    the slowdown by a grid search, kp and kd by least squares for each. Returns (kd, kp,
    slowdown), or None where the two parts cannot be told apart (fewer than MIN_STEPS steps
    without prefill, or with prefill: a prefill worker's steps are all prefill plus the same
    base) or a factor comes out <= 0."""
    if (prefill == 0).sum() < MIN_STEPS or (prefill > 0).sum() < MIN_STEPS:
        return None
    grid = SLOWDOWN_GRID if overlap.max() - overlap.min() >= 0.5 else np.zeros(1)
    best = None
    for slowdown in grid:
        scale = (1.0 + slowdown * overlap) / walls
        x = np.column_stack([prefill * scale, rest * scale])
        (kp, kd), residual, *_ = np.linalg.lstsq(x, np.ones_like(walls), rcond=None)
        error = float(residual[0]) if len(residual) else float(np.sum((x @ [kp, kd] - 1.0) ** 2))
        if kp > 0 and kd > 0 and (best is None or error < best[0]):
            best = (error, float(kd), float(kp), float(slowdown))
    return None if best is None else best[1:]


def calibrate(cost: CostModel, trace_dir: Path) -> tuple[CostModel, dict[str, RoleCalibration]]:
    """The profile with each traced role's step cost scaled to its steps in service: by the
    served / predicted ratio of a step with no traced neighbour busy, plus a neighbour
    slowdown for the share of the host's other traced workers that are mid-step."""
    files = sorted(Path(trace_dir).glob("*.jsonl"))
    if not files:
        raise ConfigError(f"no step traces (*.jsonl) in {trace_dir}; serve with --step-trace-dir {trace_dir}")
    traces = []
    for path in files:
        trace = read_step_trace(path)
        if trace.role not in STEP_ROLES:
            raise ConfigError(f"{path}: role {trace.role!r} has no step cost to calibrate")
        traces.append(trace)
    by_role: dict[str, list[tuple[np.ndarray, ...]]] = {}
    cpu: dict[str, list[tuple[float, float]]] = {}  # one-thread workers: (CPU s, served s)
    for trace in traces:
        if trace.cpus is not None and trace.num_threads == 1:
            cpu.setdefault(trace.role, []).append((float(trace.cpus.sum()), float(trace.walls.sum())))
        prefill, rest = step_parts(cost.role(trace.role).step, trace.shapes)
        overlap = busy_overlap(trace, [t for t in traces if t is not trace])
        by_role.setdefault(trace.role, []).append((trace.walls, prefill, rest, overlap))
    result = {}
    for role, parts in by_role.items():
        walls, prefill, rest, overlap = (np.concatenate(p) for p in zip(*parts))
        if len(walls) < MIN_STEPS:
            raise ConfigError(f"only {len(walls)} {role} steps traced in {trace_dir}; "
                              f"calibrate needs at least {MIN_STEPS}")
        predicted = prefill + rest
        split = fit_role_parts(walls, prefill, rest, overlap)
        if split is None:
            alone, slowdown = fit_role(walls, predicted, overlap)
            alone_prefill = None
        else:
            alone, alone_prefill, slowdown = split
        cpu_share = sum(c for c, _ in cpu[role]) / sum(w for _, w in cpu[role]) if role in cpu else None
        result[role] = RoleCalibration(role, len(walls), float(walls.sum()), float(predicted.sum()), alone, slowdown,
                                       cpu_share, alone_prefill)
    roles = dict(cost.roles)
    for role, cal in result.items():
        old = roles[role]
        roles[role] = replace(old, step=old.step.scaled(cal.alone, cal.alone_prefill),
                              neighbour_slowdown=cal.neighbour_slowdown)
    raw = dict(cost.raw)
    raw["calibration"] = {"step_trace_dir": str(trace_dir), "roles": {r: c.to_dict() for r, c in result.items()}}
    return replace(cost, roles=roles, raw=raw), result


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="scale a profile's step costs to the step times workers traced in service")
    p.add_argument("--profile", required=True, help="profile.json written by epdserve profile")
    p.add_argument("--step-trace-dir", required=True,
                   help="the directory given to epdserve serve --step-trace-dir for the calibration run")
    p.add_argument("--out", required=True, help="where to write the calibrated profile")
    p.set_defaults(func=run_calibrate_command)
    return p


def run_calibrate_command(ns: argparse.Namespace) -> int:
    cost = CostModel.load(ns.profile)
    calibrated, result = calibrate(cost, Path(ns.step_trace_dir))
    try:
        calibrated.save(ns.out)
    except OSError as e:
        raise ConfigError(f"cannot write {ns.out}: {e.strerror}") from None
    for role, cal in sorted(result.items()):
        print(f"{role:10s} {cal.num_steps:6d} steps  served {cal.served_s:8.2f} s  "
              f"profile predicts {cal.predicted_s:8.2f} s  factor {cal.factor:.3f}  "
              f"(alone {cal.alone:.3f}, neighbour slowdown +{100 * cal.neighbour_slowdown:.1f} %"
              + ("" if cal.cpu_share is None else f"; on CPU {100 * cal.cpu_share:.0f} % of it") + ")")
    print(f"wrote {ns.out}")
    return 0
