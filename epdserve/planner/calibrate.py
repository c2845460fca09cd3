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

from epdserve.errors import ConfigError
from epdserve.sim.cost_model import STEP_ROLES, CostModel, StepCost, StepShape

MIN_STEPS = 10  # a role needs at least this many traced steps to be calibrated


@dataclass(frozen=True)
class RoleCalibration:
    role: str
    num_steps: int
    served_s: float  # sum of the traced steps' time in service
    predicted_s: float  # sum of what the profile predicts for the same shapes

    @property
    def factor(self) -> float:
        return self.served_s / self.predicted_s

    def to_dict(self) -> dict:
        return {"factor": round(self.factor, 4), "num_steps": self.num_steps,
                "served_s": round(self.served_s, 3), "predicted_s": round(self.predicted_s, 3)}


def read_step_trace(path: Path) -> tuple[dict, list[tuple[StepShape, float]]]:
    """A worker's trace file: its header and (shape, seconds in service) per step."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read step trace {path}: {e.strerror}") from None
    try:
        header = json.loads(lines[0]) if lines else None
        if not isinstance(header, dict) or "role" not in header:
            raise ConfigError(f"{path}: the first line must name the worker's role")
        steps = []
        for line in lines[1:]:
            if not line.strip():
                continue
            d = json.loads(line)
            steps.append((StepShape.from_dict(d), float(d["wall_s"])))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: not a step trace ({e})") from None
    return header, steps


def calibrate(cost: CostModel, trace_dir: Path) -> tuple[CostModel, dict[str, RoleCalibration]]:
    """The profile with each traced role's step cost scaled by its served / predicted ratio."""
    files = sorted(Path(trace_dir).glob("*.jsonl"))
    if not files:
        raise ConfigError(f"no step traces (*.jsonl) in {trace_dir}; serve with --step-trace-dir {trace_dir}")
    served: dict[str, float] = {}
    predicted: dict[str, float] = {}
    counts: dict[str, int] = {}
    for path in files:
        header, steps = read_step_trace(path)
        role = header["role"]
        if role not in STEP_ROLES:
            raise ConfigError(f"{path}: role {role!r} has no step cost to calibrate")
        step_cost = cost.role(role).step
        served[role] = served.get(role, 0.0) + sum(t for _, t in steps)
        predicted[role] = predicted.get(role, 0.0) + sum(step_cost.time_s(shape) for shape, _ in steps)
        counts[role] = counts.get(role, 0) + len(steps)
    result = {}
    for role, n in counts.items():
        if n < MIN_STEPS:
            raise ConfigError(f"only {n} {role} steps traced in {trace_dir}; calibrate needs at least {MIN_STEPS}")
        result[role] = RoleCalibration(role, n, served[role], predicted[role])
    roles = dict(cost.roles)
    for role, cal in result.items():
        old = roles[role]
        scaled = StepCost(**{k: v * cal.factor for k, v in old.step.to_dict().items()})
        roles[role] = replace(old, step=scaled)
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
              f"profile predicts {cal.predicted_s:8.2f} s  factor {cal.factor:.3f}")
    print(f"wrote {ns.out}")
    return 0
