"""P/D prefill in the simulator: a prompt's prefix copied from its decode instance's pages
instead of recomputed, as ``engine/kv_pull.py``'s ``PeerPuller`` does on a worker.

The decode instance's reservation names the prompt's blocks by key and takes the ones its
prefix cache holds (``Scheduler.reserve``); the prefill instance then takes from decode the
blocks from the end of its own pool hit to the end of decode's (``reload_rule.pull_span``) when
copying them beats computing them (``PrefixCost.should_copy``), and the copy's time at its
link's bandwidth is added to the step that admits the request (the engine copies before its
forward pass). Only between instances of one host: a worker copies over shared memory only
(over TCP the prefix is computed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from epdserve.engine.reload_rule import PrefixCost, pull_span
from epdserve.request import Request


@dataclass
class SimPull:
    """One request's copy (the scheduler's ``PeerPull``)."""

    num_blocks: int
    predicted_s: float  # the rule's copy time: what the step pays
    block_ids: list[int] = field(default_factory=list)


class SimPeerPuller:
    """A prefill instance's ``Scheduler.peer_loader``."""

    def __init__(self, cost: PrefixCost, bytes_per_s: float, is_same_host: Callable[[str], bool]) -> None:
        """``bytes_per_s``: the copy's bandwidth (the instance's link: shared memory on one
        host); ``is_same_host(worker_id)``: whether that decode instance shares its host."""
        self.cost = cost
        self.bytes_per_s = bytes_per_s
        self.is_same_host = is_same_host
        self.num_pulled_blocks = 0  # by the steps that admitted the copies (``pulled``)

    def plan_pull(self, request: Request, num_cached_tokens: int) -> SimPull | None:
        """As ``PeerPuller.plan_pull``, without the pages."""
        span = pull_span(request, num_cached_tokens, self.cost.block_size)
        if span is None or not self.is_same_host(request.kv_target):
            return None
        num_blocks = span[1] - span[0]
        if not self.cost.should_copy(num_blocks, self.bytes_per_s, 0.0, num_cached_tokens):
            return None
        return SimPull(num_blocks, self.cost.copy_s(num_blocks, self.bytes_per_s))

    def pulled(self, pulls: list[SimPull]) -> float:
        """The copies a step admitted: counted; returns the seconds they add to the step."""
        self.num_pulled_blocks += sum(p.num_blocks for p in pulls)
        return sum(p.predicted_s for p in pulls)
