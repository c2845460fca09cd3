"""``epdserve calibrate``: scale a profile's step costs to what the workers took in service.

An offline profile times each role's steps alone on its cores. In service the same steps take
longer: workers that share a host share its memory bandwidth and last-level cache, and the
router, the HTTP server and the clients take CPU time from the workers' cores. A short serving
run with ``epdserve serve --step-trace-dir DIR`` records every model step each worker ran
(``cluster/step_trace.py``; an encode worker records its batches, which count as a neighbour's
busy time, and the encoder's cost is scaled by one factor to their time alone where the traces
count their tiles); for each role this module predicts every traced step from the profile, split
into the cost model's term groups (base, prefill terms, decode terms), and fits per group a
factor for a step alone and an extra for a step during which the host's other traced workers are
mid-step (every ``--window``, i.e. every calibration run, weighs the same in the fit, however
many steps it holds): a step of one sequence that streams the model's weights slows far more next to another
such step than a prefill does. Then, per batch size with at least MIN_KNOT_STEPS decode-only
steps, their served time over that fit becomes a knot of the step cost's ``decode_factors``: a
CPU's matmul kernels are not linear in their row count (on an AVX-512 Xeon in float32, 12 rows
took longer than 16), which no linear term follows. The result is a profile like any other
(``simulate`` and ``plan`` read it): the scaled step cost, a ``neighbour_step`` cost that the
simulator adds by the share of an instance's neighbours that are mid-step, and a ``calibration``
record of the factors and what they were measured on.

Workers pinned to the same core time-share it (serve wraps around when a host has fewer cores
than workers, e.g. an encoder beside a decode worker on two cores). The kernel shares a core
fairly, so a step's time on a core of its own is the integral over the step of 1 / (1 + the
number of others mid-step on its cores) (``alone_time``); the fit is on that, only the workers
on other cores count as neighbours, and ``simulate --cores-per-host`` shares the cores again by
the same rule (``sim/instance.py`` ``Pace``). Traces name their worker's cores in the header
(older ones do not: no sharing is seen).

The factors belong to the packing they were measured on (which roles shared the host, at what
load); calibrate on the deployment the simulation is about.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from epdserve.engine.step_shape import StepShape
from epdserve.errors import ConfigError
from epdserve.sim.cost_model import STEP_ROLES, CostModel, EncodeCost, RoleProfile, StepCost
from epdserve.sim.nnls import nnls

MIN_STEPS = 10  # a role needs at least this many traced steps to be calibrated
# A batch size gets a decode factor (``StepCost.decode_factors``) from at least this many
# decode-only steps of that size.
MIN_KNOT_STEPS = 30


TERMS = ("base", "prefill", "decode")  # the cost model's terms in three groups (StepCost.parts_s)
# How strongly each term group's factor for a step alone is held at the profile's (1), per
# traced step: where the traces cannot tell the groups apart (the same shapes throughout, or the
# neighbour busy in every step) the fit keeps the profile's proportions.
RIDGE = 1e-3


@dataclass(frozen=True)
class RoleCalibration:
    role: str
    num_steps: int
    served_s: float  # sum of the traced steps' time in service
    predicted_s: float  # sum of what the profile predicts for the same shapes
    alone: tuple[float, float, float]  # per term group (TERMS): served / profiled, no traced neighbour mid-step
    busy: tuple[float, float, float]  # per term group: extra served / profiled while every neighbour is mid-step
    cpu_share: float | None = None  # one-thread workers: their CPU time / served time (None: not traced)
    decode_factors: tuple[tuple[int, float], ...] = ()  # (batch size, served / fitted) of decode-only steps

    @property
    def factor(self) -> float:
        return self.served_s / self.predicted_s

    def to_dict(self) -> dict:
        return {"factor": round(self.factor, 4), "alone": dict(zip(TERMS, (round(a, 4) for a in self.alone))),
                "busy": dict(zip(TERMS, (round(b, 4) for b in self.busy))),
                "decode_factors": [[d, round(f, 4)] for d, f in self.decode_factors], "num_steps": self.num_steps,
                "cpu_share": None if self.cpu_share is None else round(self.cpu_share, 4),
                "served_s": round(self.served_s, 3), "predicted_s": round(self.predicted_s, 3)}


@dataclass(frozen=True)
class EncoderCalibration:
    num_batches: int  # traced batches that computed tiles
    served_s: float  # their time alone on a core (time-sharing taken out)
    predicted_s: float  # what the profile predicts for their tiles
    cpu_share: float | None = None  # the encoder's CPU time / its batches' wall time (one thread)

    @property
    def factor(self) -> float:
        return self.served_s / self.predicted_s

    def to_dict(self) -> dict:
        return {"factor": round(self.factor, 4), "num_batches": self.num_batches,
                "served_s": round(self.served_s, 3), "predicted_s": round(self.predicted_s, 3),
                "cpu_share": None if self.cpu_share is None else round(self.cpu_share, 4)}


@dataclass(frozen=True)
class WorkerTrace:
    worker_id: str
    role: str
    starts: np.ndarray  # step start times (s, one clock for every worker of the host)
    walls: np.ndarray  # step times in service (s)
    shapes: list[StepShape]
    cpus: np.ndarray | None = None  # the worker's CPU time per step (s); None in traces without it
    num_threads: int = 1
    cores: frozenset[int] | None = None  # the cores it ran on (None: traces without them)
    tiles: np.ndarray | None = None  # an encoder's tiles computed per batch (None: traces without them)

    def shares_cores_with(self, other: WorkerTrace) -> bool:
        return self.cores is not None and other.cores is not None and bool(self.cores & other.cores)


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
            frozenset(int(c) for c in header["cores"]) if "cores" in header else None,
            np.array([int(d["num_tiles"]) for d in records])
            if records and all("num_tiles" in d for d in records) else None,
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


def alone_time(trace: WorkerTrace, sharers: list[WorkerTrace]) -> np.ndarray:
    """Per step of ``trace``: its time on a core of its own, the integral over the step of
    1 / (1 + n(t)), n(t) the number of ``sharers`` mid-step at t (a fairly shared core)."""
    if not sharers:
        return trace.walls.copy()
    starts = np.concatenate([o.starts for o in sharers])
    times = np.concatenate([starts, starts + np.concatenate([o.walls for o in sharers])])
    order = np.argsort(times, kind="stable")
    times = times[order]
    count = np.cumsum(np.concatenate([np.ones(len(starts)), -np.ones(len(starts))])[order])  # after each breakpoint
    share = 1.0 / (1.0 + np.maximum(count, 0.0))
    cum = np.concatenate([[0.0], np.cumsum(np.diff(times) * share[:-1])])  # the integral from times[0]

    def integral(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(times, t, side="right") - 1
        at = np.maximum(i, 0)
        return np.where(i < 0, t - times[0], cum[at] + (t - times[at]) * share[at])

    return integral(trace.starts + trace.walls) - integral(trace.starts)


def neighbour_split(trace: WorkerTrace, traces: list[WorkerTrace]) -> tuple[np.ndarray, np.ndarray]:
    """Per step of ``trace``: how much time-sharing its cores stretched it (its wall over
    ``alone_time``: 1 alone, 2 with one other mid-step throughout), and the busy share of the
    host's other workers (``busy_overlap``: the neighbour term's weight)."""
    sharers: list[WorkerTrace] = []
    neighbours: list[WorkerTrace] = []
    for other in traces:
        if other is not trace:
            (sharers if trace.shares_cores_with(other) else neighbours).append(other)
    stretch = trace.walls / np.maximum(alone_time(trace, sharers), 1e-12)
    return np.maximum(stretch, 1.0), busy_overlap(trace, neighbours)


def step_parts(step: StepCost, shapes: list[StepShape]) -> np.ndarray:
    """Each step's predicted time by term group (TERMS), one row per step."""
    return np.array([step.parts_s(shape) for shape in shapes]).reshape(len(shapes), len(TERMS))


def fit_terms(walls: np.ndarray, parts: np.ndarray, overlap: np.ndarray,
              weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``wall ~ sum_g parts_g x (alone_g + busy_g x overlap)`` by non-negative least squares on
    relative residuals (a 20 ms decode step counts as much as a 300 ms prefill), each residual
    times its step's weight (``weights``, mean 1; None: all 1), each ``alone_g`` held at 1 by a
    ridge of RIDGE per step. A group absent from every step keeps alone 1 and busy 0; without
    overlaps, busy is 0. Returns (alone, busy), one value per group."""
    root = np.ones(len(walls)) if weights is None else np.sqrt(weights)
    x = np.column_stack([parts, parts * overlap[:, None]]) * (root / np.maximum(walls, 1e-9))[:, None]
    num_groups = parts.shape[1]
    present = np.concatenate([np.abs(parts).sum(axis=0) > 0] * 2)
    present[num_groups:] &= overlap.max() > 0
    ridge = np.zeros((num_groups, 2 * num_groups))
    ridge[np.arange(num_groups), np.arange(num_groups)] = np.sqrt(RIDGE * len(walls))
    a = np.vstack([x, ridge])[:, present]
    b = np.concatenate([root, np.full(num_groups, np.sqrt(RIDGE * len(walls)))])
    coef = np.zeros(2 * num_groups)
    coef[present] = nnls(a, b)
    alone, busy = coef[:num_groups], coef[num_groups:]
    alone[~present[:num_groups]] = 1.0
    return alone, busy


def window_weights(window: np.ndarray) -> np.ndarray:
    """Per step, a weight that gives every window (calibration run) the same weight in the fit
    whatever its number of steps, mean 1: a light load's run has many small steps, a heavy one's
    fewer large ones, and counted by steps the light run would decide the terms that the large
    steps depend on."""
    _, index, counts = np.unique(window, return_inverse=True, return_counts=True)
    return len(window) / (len(counts) * counts[index])


def decode_knots(walls: np.ndarray, predicted: np.ndarray, num_seqs: np.ndarray) -> tuple[tuple[int, float], ...]:
    """Per batch size of at least MIN_KNOT_STEPS decode-only steps (``num_seqs`` > 0; 0 marks a
    step that prefills): their summed time over the summed prediction, one knot each."""
    knots = []
    for d in np.unique(num_seqs[num_seqs > 0]):
        mine = num_seqs == d
        if mine.sum() >= MIN_KNOT_STEPS:
            knots.append((int(d), float(walls[mine].sum() / max(predicted[mine].sum(), 1e-12))))
    return tuple(knots)


@dataclass(frozen=True)
class TracedSteps:
    """The steps ``calibrate`` and ``refresh`` take from a step-trace directory."""
    # per role, per trace: (time alone on its cores, shapes, neighbours' busy share, the window each
    # began in: its index in ``windows``, 0 without windows) of the steps kept
    steps: dict[str, list[tuple[np.ndarray, list[StepShape], np.ndarray, np.ndarray]]]
    encoder: list[tuple[np.ndarray, np.ndarray]]  # an encoder's batches kept: (time alone, tiles), per trace
    cpu: dict[str, list[tuple[float, float]]]  # one-thread workers: (CPU s, served s) of the steps kept


def read_traced_steps(trace_dir: Path, since: float | None = None,
                      windows: list[tuple[float, float]] | None = None) -> TracedSteps:
    """Every worker's trace in ``trace_dir``; of each, the steps that began at or after ``since``
    and in one of ``windows`` (both optional), with time-sharing of their cores taken out and
    the busy share of the host's other workers measured against every traced step."""
    for start, end in windows or ():
        if not start < end:
            raise ConfigError(f"a calibration window must end after it starts, got {start:g}:{end:g}")
    files = sorted(Path(trace_dir).glob("*.jsonl"))
    if not files:
        raise ConfigError(f"no step traces (*.jsonl) in {trace_dir}; serve with --step-trace-dir {trace_dir}")
    traces = []
    for path in files:
        trace = read_step_trace(path)
        if trace.role not in STEP_ROLES and trace.role != "encode":
            raise ConfigError(f"{path}: role {trace.role!r} has no step cost to calibrate")
        traces.append(trace)
    if not any(t.role in STEP_ROLES for t in traces):
        raise ConfigError(f"{trace_dir} holds encoder batches only: no {', '.join(STEP_ROLES)} steps to calibrate")
    traced = TracedSteps({}, [], {})
    for trace in traces:
        keep = np.ones(len(trace.walls), dtype=bool) if since is None else trace.starts >= since
        window = np.zeros(len(trace.walls), dtype=np.int64)
        if windows:
            inside = np.array([(trace.starts >= a) & (trace.starts < b) for a, b in windows]).reshape(
                len(windows), len(trace.walls))
            keep &= inside.any(axis=0)
            window = inside.argmax(axis=0)
        if trace.role == "encode":  # its batches are its neighbours' busy time, and its own cost's samples
            if trace.tiles is None:
                continue
            keep &= trace.tiles > 0  # all cache hits: nothing computed
        if trace.cpus is not None and trace.num_threads == 1:
            traced.cpu.setdefault(trace.role, []).append((float(trace.cpus[keep].sum()),
                                                          float(trace.walls[keep].sum())))
        # A step's time on a core it had to itself: what the simulator stretches again when it
        # places instances on shared cores (simulate --cores-per-host).
        sharing, overlap = neighbour_split(trace, traces)
        if trace.role == "encode":
            traced.encoder.append((trace.walls[keep] / sharing[keep], trace.tiles[keep]))
            continue
        shapes = [s for s, k in zip(trace.shapes, keep) if k]
        alone = trace.walls[keep] / sharing[keep]
        traced.steps.setdefault(trace.role, []).append((alone, shapes, overlap[keep], window[keep]))
    return traced


def _too_few(role: str, num_steps: int, trace_dir: Path, since: float | None,
             windows: list[tuple[float, float]] | None) -> ConfigError:
    return ConfigError(f"only {num_steps} {role} steps traced in {trace_dir}"
                       + ("" if since is None else f" since {since:g}")
                       + ("" if not windows else " in " + ", ".join(f"{a:g}:{b:g}" for a, b in windows))
                       + f"; calibrate needs at least {MIN_STEPS}")


def calibrate(cost: CostModel, trace_dir: Path, since: float | None = None,
              windows: list[tuple[float, float]] | None = None,
              ) -> tuple[CostModel, dict[str, RoleCalibration]]:
    """The profile with each traced role's step cost scaled to its steps in service: per term
    group, a factor for a step while no other traced worker is mid-step, and the extra while
    they all are (the neighbour step, applied by the share of the host's other instances that
    are mid-step). ``since``: only steps that began at or after this time (the traces' clock,
    ``time.monotonic``), e.g. to leave out a warm-up; ``windows``: only steps that began in one
    of these [start, end) spans (e.g. calibration runs between other work), both: in both.
    An encoder's batches that counted their tiles scale the profile's encoder cost by one factor
    (``calibrate_encoder``; the record's ``encode``)."""
    traced = read_traced_steps(trace_dir, since, windows)
    by_role: dict[str, list[tuple[np.ndarray, ...]]] = {}
    for role, groups in traced.steps.items():
        step = cost.role(role).step.with_decode_factors(())
        for walls, shapes, overlap, window in groups:
            decode_only = np.array([0 if s.num_prefill_tokens else s.num_decode_seqs for s in shapes],
                                   dtype=np.int64)
            by_role.setdefault(role, []).append(
                (walls, step_parts(step, shapes), overlap, decode_only, window))
    result = {}
    for role, groups in by_role.items():
        walls, parts, overlap, decode_only, window = (np.concatenate(g) for g in zip(*groups))
        if len(walls) < MIN_STEPS:
            raise _too_few(role, len(walls), trace_dir, since, windows)
        alone, busy = fit_terms(walls, parts, overlap, window_weights(window))
        fitted = parts @ alone + (parts * overlap[:, None]) @ busy
        cpu_share = share_on_cpu(traced.cpu.get(role))
        result[role] = RoleCalibration(role, len(walls), float(walls.sum()), float(parts.sum()),
                                       tuple(float(a) for a in alone), tuple(float(b) for b in busy), cpu_share,
                                       decode_knots(walls, fitted, decode_only))
    roles = dict(cost.roles)
    for role, cal in result.items():
        old = roles[role]
        step = old.step.with_decode_factors(())
        neighbour = step.scaled(*cal.busy).with_decode_factors(cal.decode_factors) if any(cal.busy) else None
        roles[role] = replace(old, step=step.scaled(*cal.alone).with_decode_factors(cal.decode_factors),
                              neighbour_step=neighbour)
    raw = dict(cost.raw)
    raw["calibration"] = {"step_trace_dir": str(trace_dir), "since": since, "windows": windows,
                          "roles": {r: c.to_dict() for r, c in result.items()}}
    encode, enc = scaled_encoder(cost, traced)
    if enc is not None:
        raw["calibration"]["encode"] = enc.to_dict()
    return replace(cost, roles=roles, encode=encode, raw=raw), result


def predict_steps(role: RoleProfile, shapes: list[StepShape], overlap: np.ndarray) -> np.ndarray:
    """Each step's time alone on its cores as the profile predicts it: the step cost, plus the
    neighbour step (where the role has one) by the neighbours' busy share, as the simulator
    applies it."""
    predicted = step_parts(role.step, shapes).sum(axis=1)
    if role.neighbour_step is not None:
        predicted = predicted + overlap * step_parts(role.neighbour_step, shapes).sum(axis=1)
    return predicted


def refresh(cost: CostModel, trace_dir: Path, since: float | None = None,
            windows: list[tuple[float, float]] | None = None) -> tuple[CostModel, dict[str, dict]]:
    """A calibrated profile brought to the host's speed in a later stretch of the same
    deployment: each traced role's step cost, its neighbour term and decode factors with it,
    times one factor, the steps' time alone on their cores over what ``cost`` predicts for them
    (its neighbour term by their neighbours' busy share); the encoder's cost by its own factor
    (``calibrate_encoder``). The fitted proportions are kept: one short run at one load, such as
    a calibration run between two stretches of service, tells the host's speed, not the terms
    apart. Returns the profile (its calibration record gains ``refresh``) and the factors."""
    traced = read_traced_steps(trace_dir, since, windows)
    roles = dict(cost.roles)
    factors: dict[str, dict] = {}
    for role, groups in traced.steps.items():
        walls = np.concatenate([g[0] for g in groups])
        if len(walls) < MIN_STEPS:
            raise _too_few(role, len(walls), trace_dir, since, windows)
        old = roles[role]
        shapes, overlap = [s for g in groups for s in g[1]], np.concatenate([g[2] for g in groups])
        predicted = predict_steps(old, shapes, overlap)
        f = float(walls.sum() / max(predicted.sum(), 1e-12))
        neighbour = None if old.neighbour_step is None else old.neighbour_step.scaled(f)
        roles[role] = replace(old, step=old.step.scaled(f), neighbour_step=neighbour)
        factors[role] = {"factor": round(f, 4), "num_steps": len(walls),
                         "served_s": round(float(walls.sum()), 3),
                         "predicted_s": round(float(predicted.sum()), 3)}
    encode, enc = scaled_encoder(cost, traced)
    if enc is not None:
        factors["encode"] = enc.to_dict()
    raw = dict(cost.raw)
    raw["calibration"] = {**raw.get("calibration", {}), "refresh": {
        "step_trace_dir": str(trace_dir), "since": since, "windows": windows, "factors": factors}}
    return replace(cost, roles=roles, encode=encode, raw=raw), factors

def share_on_cpu(sums: list[tuple[float, float]] | None) -> float | None:
    """One-thread workers' CPU time over their served time, from (CPU s, served s) per trace."""
    if not sums:
        return None
    return sum(c for c, _ in sums) / max(sum(w for _, w in sums), 1e-9)


def calibrate_encoder(cost: CostModel, batches: list[tuple[np.ndarray, np.ndarray]],
                      cpu_share: float | None) -> EncoderCalibration | None:
    """One factor for the profile's encoder cost: its traced batches' time alone over what the
    profile predicts for their tiles (``batches``: time alone and tiles per batch, per trace).
    None without an encoder in the profile or with fewer than MIN_STEPS batches that counted
    their tiles."""
    if cost.encode is None or not batches:
        return None
    alone, tiles = (np.concatenate([b[i] for b in batches]) for i in range(2))
    if len(alone) < MIN_STEPS:
        return None
    predicted = sum(cost.encode.time_s(int(n)) for n in tiles)
    return EncoderCalibration(len(alone), float(alone.sum()), float(predicted), cpu_share)



def scaled_encoder(cost: CostModel,
                   traced: TracedSteps) -> tuple[EncodeCost | None, EncoderCalibration | None]:
    """The profile's encoder cost times its traced batches' factor (``calibrate_encoder``), and
    the factor's record; as profiled (and None) where the batches do not tell it."""
    enc = calibrate_encoder(cost, traced.encoder, share_on_cpu(traced.cpu.get("encode")))
    if enc is None:
        return cost.encode, None
    return replace(cost.encode, base_s=cost.encode.base_s * enc.factor,
                   per_tile_s=cost.encode.per_tile_s * enc.factor), enc

def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "calibrate", help="scale a profile's step costs to the step times workers traced in service")
    p.add_argument("--profile", required=True, help="profile.json written by epdserve profile")
    p.add_argument("--step-trace-dir", required=True,
                   help="the directory given to epdserve serve --step-trace-dir for the calibration run")
    p.add_argument("--since", type=float, default=None,
                   help="only steps that began at or after this time (the traces' clock: the host's "
                        "time.monotonic seconds), e.g. to leave out a warm-up")
    p.add_argument("--window", action="append", default=None, metavar="START:END",
                   help="only steps that began in [START, END) (the traces' clock); repeat it for several "
                        "spans, e.g. calibration runs interleaved with other work")
    p.add_argument("--refresh", action="store_true",
                   help="bring a calibrated profile to the host's speed on these steps: each role's step "
                        "cost times one factor (their time alone over the profile's prediction), the "
                        "encoder's by its own; the fitted terms and decode factors kept (one short run at "
                        "one load is enough)")
    p.add_argument("--out", required=True, help="where to write the calibrated profile")
    p.set_defaults(func=run_calibrate_command)
    return p


def parse_windows(values: list[str]) -> list[tuple[float, float]]:
    """``START:END`` strings (``--window``) as (start, end) pairs."""
    windows = []
    for value in values:
        try:
            start, end = (float(x) for x in value.split(":"))
        except ValueError:
            raise ConfigError(f"--window takes START:END in seconds (the traces' clock), got {value!r}") from None
        windows.append((start, end))
    return windows


def _encode_line(enc: dict) -> str:
    """The encoder's factor as the command prints it (``EncoderCalibration.to_dict``)."""
    return (f"{'encode':10s} {enc['num_batches']:6d} batches  alone {enc['served_s']:8.2f} s  "
            f"profile predicts {enc['predicted_s']:8.2f} s  factor {enc['factor']:.3f}"
            + ("" if enc["cpu_share"] is None
               else f"  (on CPU {100 * enc['cpu_share']:.0f} % of its wall time)"))


def _save(cost: CostModel, path: str) -> None:
    try:
        cost.save(path)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror}") from None


def run_calibrate_command(ns: argparse.Namespace) -> int:
    cost = CostModel.load(ns.profile)
    if ns.refresh:
        refreshed, factors = refresh(cost, Path(ns.step_trace_dir), ns.since, parse_windows(ns.window or []))
        _save(refreshed, ns.out)
        for role, f in sorted(factors.items()):
            if role == "encode":
                print(_encode_line(f))
            else:
                print(f"{role:10s} {f['num_steps']:6d} steps  served {f['served_s']:8.2f} s  "
                      f"profile predicts {f['predicted_s']:8.2f} s  factor {f['factor']:.3f}")
        print(f"wrote {ns.out}")
        return 0
    calibrated, result = calibrate(cost, Path(ns.step_trace_dir), ns.since, parse_windows(ns.window or []))
    _save(calibrated, ns.out)
    for role, cal in sorted(result.items()):
        terms = ", ".join(f"{t} x{a:.3f} (+{b:.3f} next to busy)" for t, a, b in zip(TERMS, cal.alone, cal.busy))
        print(f"{role:10s} {cal.num_steps:6d} steps  served {cal.served_s:8.2f} s  "
              f"profile predicts {cal.predicted_s:8.2f} s  factor {cal.factor:.3f}  ({terms}"
              + ("" if cal.cpu_share is None else f"; on CPU {100 * cal.cpu_share:.0f} % of it") + ")")
    enc = calibrated.raw["calibration"].get("encode")
    if enc is not None:
        print(_encode_line(enc))
    print(f"wrote {ns.out}")
    return 0
