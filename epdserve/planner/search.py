"""Search over cluster configurations: enumerate candidates, find each one's highest rate
meeting the SLO with short simulations (``capacity.max_rate``), in worker processes.

Candidates are visited in order of their estimated rate per instance (the formula's per-role
throughputs at the SLO for split ones, saturation for colocated ones). Each simulated one
calibrates its family's estimates (median of measured / estimated max rate). A candidate is
pruned, not simulated, when the best goodput per instance so far exceeds its estimate by
``PRUNE_MARGIN``, or its calibrated estimate by ``CALIBRATED_MARGIN`` (the best few of each
family, split and colocated, are always simulated, so the verdict compares simulated bests).
A candidate is dominated, not simulated, when a larger pool with the same instance ratio and
batch limits was simulated (equal estimates per instance put the larger pool first): a larger
pool of the same shape balances load at least as well. A time budget leaves the rest
unsimulated.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass

from epdserve.planner.capacity import Candidate, Capacity, ProbeSpec, max_rate
from epdserve.planner.slo import SLO
from epdserve.sim.cost_model import CostModel
from epdserve.sim.topology import Topology
from epdserve.sim.workload import SimWorkload

PRUNE_MARGIN = 1.5  # a candidate is skipped when best goodput/instance > margin x its estimate
CALIBRATED_MARGIN = 1.1  # ... or > margin x its calibrated estimate (once calibrated)
MIN_CALIBRATION = 4  # simulated candidates of a family before its calibration is trusted
MIN_PER_FAMILY = 3  # split and colocated each get this many simulated before any is pruned
HINT_FACTOR = 1.25  # the rate search starts at this multiple of the (calibrated) estimate


def enumerate_candidates(num_instances: int, seqs_choices: Sequence[int], has_encode: bool,
                         num_encode_choices: Sequence[int] = (1,)) -> list[Candidate]:
    """colocated=n and prefill=p,decode=d (+ encode=e) with at most ``num_instances`` in all,
    each with every max_num_seqs choice for the role that batches running sequences (colocated,
    decode; an empty choice list: the profile's). Prefill keeps the profile's value: its batch
    is bounded by the token budget, not by the sequence count."""
    seqs = [n or None for n in seqs_choices] or [None]  # None (or 0): the profile's value
    out = []
    encodes = list(num_encode_choices) if has_encode else [0]
    for e in encodes:
        for n in range(1, num_instances - e + 1):
            for s in seqs:
                out.append(Candidate(Topology(num_encode=e, num_colocated=n), _seqs(("colocated", s))))
        for p in range(1, num_instances - e):
            for d in range(1, num_instances - e - p + 1):
                for s in seqs:
                    out.append(Candidate(Topology(num_encode=e, num_prefill=p, num_decode=d), _seqs(("decode", s))))
    return out


def ratio_class(candidate: Candidate) -> tuple[tuple, int]:
    """(the instance ratio in lowest terms with the batch limits, the multiple): prefill=4,
    decode=6 is 2 x (prefill 2 : decode 3)."""
    topo = candidate.topology
    counts = (topo.num_encode, topo.num_prefill, topo.num_decode, topo.num_colocated)
    g = math.gcd(*counts)
    return (tuple(n // g for n in counts), candidate.max_num_seqs), g


def _seqs(*pairs: tuple[str, int | None]) -> tuple[tuple[str, int], ...]:
    """Only overrides go in; a None (the profile's value) leaves the role out."""
    return tuple(sorted((role, n) for role, n in pairs if n is not None))


@dataclass(frozen=True)
class SearchResult:
    results: list[Capacity]  # simulated candidates, in visiting order
    estimates: dict  # candidate -> estimated rate (requests/s)
    num_candidates: int
    num_pruned: int  # by their (calibrated) estimate
    num_dominated: int  # a larger pool of the same ratio was simulated
    num_skipped: int  # left when the time budget ran out
    search_s: float
    num_workers: int


_STATE: dict = {}


def _init(cost_dict: dict, base: SimWorkload, slo: SLO, attainment: float, config: dict, spec: ProbeSpec) -> None:
    _STATE.update(cost=CostModel.from_dict(cost_dict), base=base, slo=slo, attainment=attainment, config=config,
                  spec=spec)


def _evaluate(task: tuple[Candidate, float]) -> Capacity:
    candidate, hint = task
    s = _STATE
    return max_rate(s["cost"], candidate, s["base"], s["slo"], s["attainment"], hint, s["config"], s["spec"])


class _Calibration:
    """Measured max rate over estimate, per family (split, colocated): the next candidate's
    first probe is its estimate times the median ratio seen so far (plus headroom)."""

    def __init__(self) -> None:
        self.ratios: dict[bool, list[float]] = {True: [], False: []}

    def add(self, cap: Capacity, estimate: float) -> None:
        if cap.max_rate > 0 and estimate > 0:
            self.ratios[cap.candidate.topology.is_split].append(cap.max_rate / estimate)

    def factor(self, candidate: Candidate) -> float | None:
        seen = sorted(self.ratios[candidate.topology.is_split])
        return seen[len(seen) // 2] if seen else None

    def hint(self, candidate: Candidate, estimate: float) -> float:
        factor = self.factor(candidate)
        return HINT_FACTOR * estimate * (factor if factor is not None else 1.0)

    def is_worse(self, candidate: Candidate, estimate: float, best_per_instance: float) -> bool:
        """Even with the family's median correction and a margin, it cannot beat the best."""
        n = candidate.topology.num_instances
        if best_per_instance > PRUNE_MARGIN * estimate / n:
            return True
        factor = self.factor(candidate)
        if factor is None or len(self.ratios[candidate.topology.is_split]) < MIN_CALIBRATION:
            return False
        return best_per_instance > CALIBRATED_MARGIN * factor * estimate / n


def search(cost: CostModel, candidates: list[Candidate], estimate: Callable[[Candidate], float], base: SimWorkload,
           slo: SLO, attainment: float, config: dict, spec: ProbeSpec, num_workers: int | None = None,
           time_budget_s: float | None = None) -> SearchResult:
    """``estimate(candidate)``: the rate (requests/s) it should carry, for the visiting order,
    pruning and (calibrated by the candidates simulated so far) the first probe."""
    started = time.perf_counter()
    num_workers = max(1, num_workers or os.cpu_count() or 1)
    estimates = {c: estimate(c) for c in candidates}
    # Per family (split, colocated): best estimate per instance first; among equals the larger
    # pool (it multiplexes better, so it calibrates the family without understating it).
    queues: dict[bool, list[Candidate]] = {
        family: sorted((c for c in candidates if c.topology.is_split == family),
                       key=lambda c: (-round(estimates[c] / c.topology.num_instances, 9), -c.topology.num_instances))
        for family in (True, False)
    }
    families_seen: dict[bool, int] = {True: 0, False: 0}
    largest: dict[tuple, int] = {}  # ratio class -> largest multiple simulated
    num_dominated = 0
    results: list[Capacity] = []
    calibration = _Calibration()
    best = 0.0
    num_pruned = 0
    init_args = (cost.to_dict(), base, slo, attainment, config, spec)

    def is_out_of_time() -> bool:
        return time_budget_s is not None and time.perf_counter() - started > time_budget_s

    def pick() -> Candidate:
        """The family that has not had its first few, else the higher calibrated estimate."""
        live = [f for f in (True, False) if queues[f]]
        fresh = [f for f in live if families_seen[f] < MIN_PER_FAMILY]
        if fresh:
            family = min(fresh, key=lambda f: families_seen[f])
        else:
            def head_value(f: bool) -> float:
                c = queues[f][0]
                return (calibration.factor(c) or 1.0) * estimates[c] / c.topology.num_instances
            family = max(live, key=head_value)
        return queues[family].pop(0)

    def next_task() -> tuple[Candidate, float] | None:
        nonlocal num_pruned, num_dominated
        while (queues[True] or queues[False]) and not is_out_of_time():
            c = pick()
            family = c.topology.is_split
            key, scale = ratio_class(c)
            if families_seen[family] >= MIN_PER_FAMILY and calibration.is_worse(c, estimates[c], best):
                num_pruned += 1
                continue
            if largest.get(key, 0) > scale:
                num_dominated += 1
                continue
            largest[key] = max(largest.get(key, 0), scale)
            families_seen[family] += 1
            return c, calibration.hint(c, estimates[c])
        return None

    def record(cap: Capacity) -> None:
        nonlocal best
        results.append(cap)
        calibration.add(cap, estimates[cap.candidate])
        best = max(best, cap.goodput_per_instance)

    if num_workers == 1:
        _init(*init_args)
        while (task := next_task()) is not None:
            record(_evaluate(task))
    else:
        with ProcessPoolExecutor(num_workers, initializer=_init, initargs=init_args) as pool:
            running: set = set()
            while True:
                while len(running) < num_workers and (task := next_task()) is not None:
                    running.add(pool.submit(_evaluate, task))
                if not running:
                    break
                done, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    record(future.result())
    num_left = len(queues[True]) + len(queues[False])
    return SearchResult(results, estimates, len(candidates), num_pruned, num_dominated, num_left,
                        time.perf_counter() - started, num_workers)
