"""Capacity of one cluster configuration: the highest arrival rate whose simulated run meets
an SLO, found by bisection on the rate with short simulations.

The workload is fixed (lengths, images, prefixes) and only its arrival times are scaled: a
base workload with mean rate 1 request/s is replayed at rate r with arrivals ``t / r``.
A probe at rate r runs the first ``max(min_requests, r x horizon_s)`` requests: a run must
span several request lifetimes, or a short burst that a large cluster absorbs at once looks
sustainable. An overload of a fraction x shows as a queue that grows by about x seconds per
second of arrivals, so a horizon of k x the TTFT SLO exposes overloads above 1/k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from epdserve.engine.step_shape import StepShape
from epdserve.planner.slo import SLO, evaluate
from epdserve.sim.cluster import ClusterSim
from epdserve.sim.config import SimConfig
from epdserve.sim.cost_model import CostModel
from epdserve.sim.results import MissWatch
from epdserve.sim.topology import Topology
from epdserve.sim.workload import SimWorkload


@dataclass(frozen=True)
class Candidate:
    topology: Topology
    max_num_seqs: tuple[tuple[str, int], ...] = ()  # per-role overrides, sorted by role

    @property
    def label(self) -> str:
        seqs = ",".join(f"{role}={n}" for role, n in self.max_num_seqs)
        return self.topology.spec + (f" (max_num_seqs {seqs})" if seqs else "")

    def to_dict(self) -> dict:
        return {"topology": self.topology.spec, "max_num_seqs": dict(self.max_num_seqs)}


@dataclass(frozen=True)
class RatePoint:
    rate: float  # offered requests/s
    attainment: float
    goodput: float  # requests/s attaining the SLO: rate x attainment
    percentiles_ms: dict[str, float]
    num_failed: int
    is_met: bool
    is_aborted: bool = False  # stopped early: attainment is an upper bound

@dataclass(frozen=True)
class Capacity:
    candidate: Candidate
    max_rate: float  # 0: not even the lowest probed rate meets the SLO
    point: RatePoint | None  # the run at max_rate
    num_sims: int
    probes: list[tuple[float, bool]] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.point.goodput if self.point is not None else 0.0

    @property
    def goodput_per_instance(self) -> float:
        return self.goodput / self.candidate.topology.num_instances

    def to_dict(self) -> dict:
        d = {**self.candidate.to_dict(), "num_instances": self.candidate.topology.num_instances,
             "max_rate": self.max_rate, "goodput": self.goodput, "goodput_per_instance": self.goodput_per_instance,
             "num_sims": self.num_sims}
        if self.point is not None:
            d.update(attainment=self.point.attainment, percentiles_ms=self.point.percentiles_ms,
                     num_failed=self.point.num_failed)
        return d


def normalized(workload: SimWorkload) -> SimWorkload:
    """The same requests with arrivals rescaled to a mean rate of 1 request/s."""
    arrivals = workload.arrival_s - workload.arrival_s[0]
    span = float(arrivals[-1])
    if span <= 0:
        arrivals = np.arange(len(workload), dtype=np.float64)
    else:
        arrivals = arrivals * (len(workload) / span)
    return workload.with_arrivals(arrivals)


def simulate_at(cost: CostModel, candidate: Candidate, base: SimWorkload, rate: float, slo: SLO,
                attainment: float, config: dict, is_early_stop: bool = True) -> RatePoint:
    """Run ``base`` (mean rate 1) at ``rate`` requests/s on the candidate. Goodput is the
    offered rate times the attainment (the run's drain tail does not dilute it). With
    ``is_early_stop`` the run ends once it cannot meet the SLO any more."""
    workload = base.with_arrivals(base.arrival_s / rate)
    sim_config = SimConfig(candidate.topology, max_num_seqs=dict(candidate.max_num_seqs), **config)
    watch = None
    if is_early_stop:
        metrics = ("ttft", "tpot", "e2el")
        watch = MissWatch(len(workload), {m: slo.threshold_s(m) for m in metrics},
                          {t.metric: t.percentile for t in slo.targets if t.metric in metrics}, attainment)
    sim = ClusterSim(cost, sim_config, workload, watch)
    recorder = sim.run()
    if sim.is_aborted:
        bound = 1.0 - len(watch.missed) / len(workload)
        return RatePoint(rate, bound, rate * bound, {}, len(recorder.errors), False, True)
    itls = [gap for gaps in recorder.itls.values() for gap in gaps]
    report = evaluate(slo, recorder.is_ok, recorder.ttft, recorder.latency, recorder.output_len,
                      np.asarray(itls, dtype=np.float64))
    return RatePoint(rate, report.attainment, rate * report.attainment, report.percentiles_ms,
                     int((~recorder.is_ok).sum()), report.is_met(attainment))


@dataclass(frozen=True)
class ProbeSpec:
    """How long each probe's run is (see the module docstring)."""

    min_requests: int
    horizon_s: float  # seconds of arrivals at the probed rate
    max_requests: int  # also the length of the base workload

    def num_requests(self, rate: float) -> int:
        return max(self.min_requests, min(self.max_requests, math.ceil(rate * self.horizon_s)))


def max_rate(cost: CostModel, candidate: Candidate, base: SimWorkload, slo: SLO, attainment: float,
             rate_hint: float, config: dict, probes_spec: ProbeSpec | None = None,
             num_bisections: int = 5) -> Capacity:
    """Bisection between 0 and ``rate_hint`` (grown while it still meets the SLO)."""
    probes: list[tuple[float, bool]] = []
    spec = probes_spec or ProbeSpec(len(base), 0.0, len(base))

    def probe(rate: float) -> RatePoint:
        workload = base.head(spec.num_requests(rate))
        point = simulate_at(cost, candidate, workload, rate, slo, attainment, config)
        probes.append((rate, point.is_met))
        return point

    hi = rate_hint
    top = probe(hi)
    num_grow = 0
    while top.is_met and num_grow < 4:
        hi *= 2
        top, num_grow = probe(hi), num_grow + 1
    if top.is_met:
        return Capacity(candidate, hi, top, len(probes), probes)
    lo, best = 0.0, None
    for _ in range(num_bisections):
        mid = (lo + hi) / 2
        point = probe(mid)
        if point.is_met:
            lo, best = mid, point
        else:
            hi = mid
    return Capacity(candidate, lo, best, len(probes), probes)


def saturation_rate(cost: CostModel, candidate: Candidate, mean_input: float, mean_output: float,
                    prefix_hit_rate: float, images_per_request: int, tiles_per_image: int,
                    max_encode_batch: int) -> float:
    """Requests/s the candidate cannot exceed whatever the SLO: each role's work at its
    largest batch (prefill: a full token budget; decode: max_num_seqs or what the KV holds at
    the mean context; encode: a full image batch), in instance-seconds per request."""
    topo = candidate.topology
    seqs = dict(candidate.max_num_seqs)
    limits = []
    num_image_tokens = images_per_request * tiles_per_image * (cost.encode.tokens_per_tile if cost.encode else 0)
    prompt = (mean_input + num_image_tokens) * (1 - prefix_hit_rate)
    context = mean_input + num_image_tokens + mean_output / 2
    step_roles = ("colocated",) if topo.num_colocated else ("prefill", "decode")
    prefill_role, decode_role = (step_roles[0], step_roles[0]) if topo.num_colocated else step_roles
    n_prefill = topo.count(prefill_role)
    n_decode = topo.count(decode_role)
    p = cost.role(prefill_role)
    budget = p.max_num_batched_tokens
    t = p.step.time_s(StepShape(budget, int(budget * (mean_input + 1) / 2), 0, 0))
    limits.append(n_prefill * (budget / t) / max(prompt, 1e-9))
    d = cost.role(decode_role)
    fit = (d.num_kv_blocks - 1) // max(1, -(-int(context) // cost.block_size))
    batch = max(1, min(seqs.get(decode_role, d.max_num_seqs), fit))
    t = d.step.time_s(StepShape(0, 0, batch, int(batch * context)))
    limits.append(n_decode * (batch / t) / max(mean_output - 1, 1e-9))
    if images_per_request and topo.num_encode:
        enc = cost.encoder()
        t = enc.time_s(max_encode_batch * tiles_per_image)
        limits.append(topo.num_encode * (max_encode_batch / t) / images_per_request)
    return min(limits)
