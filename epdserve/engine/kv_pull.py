"""P/D prefill: a prompt's prefix copied from the decode worker's pages instead of recomputed.

In a conversation the decode worker ends a turn holding the whole exchange (prompt and
answer) in its prefix cache, while the prefill worker holds only the prompts it computed. The
next turn's reservation reports what decode holds (``Submit.kv_target_num_cached``); the blocks
from the prefill worker's own pool hit up to there are then either copied from decode's pages
or recomputed, by the reload rule (``reload_rule.PrefixCost.should_copy``): the copy's bytes
over the link's measured bandwidth against the prefill time of those tokens.

Only between workers of one node: the prefill worker already maps the decode worker's pool
in shared memory to push into it (``transfer/connector.py`` ``ShmLink``) and reads it the same
way. Over TCP the prefix is recomputed.

Safety: the decode blocks read are the reservation's cached prefix, held by the decode
worker's request for as long as the reservation is open, and never written while cached. The
reservation's own (fenced) blocks tell whether it is: the fence is checked before the copy and
after it, and a request whose reservation ended in between fails (its pages, not yet in the
prefix cache, are freed with it), so a torn copy never reaches an output or the cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from epdserve.engine.reload_rule import (
    PRIOR_PREFILL_S_PER_TOKEN,
    PRIOR_SHM_BYTES_PER_S,
    PrefillRate,
    PrefixCost,
    pull_span,
)
from epdserve.request import Request
from epdserve.transfer.connector import KVPusher, ShmLink

log = logging.getLogger("epdserve.engine")

# A link's own bandwidth replaces the prior once it has sent this long.
MIN_MEASURED_SEND_S = 0.01


@dataclass
class PeerPull:
    """One request's copy (the scheduler's ``PeerPull``)."""

    request_id: str
    link: ShmLink
    src_block_ids: list[int]  # the decode worker's pages, in prompt order
    generation: int  # the reservation's, on its fenced blocks
    fenced_block_ids: np.ndarray  # the reservation's own blocks (group 0)
    predicted_s: float  # the rule's copy time
    block_ids: list[int] = field(default_factory=list)  # this worker's pages (set at allocation)

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)

    def is_open(self) -> bool:
        fence = self.link.fence
        return fence is None or fence.admits(self.generation, 0, self.fenced_block_ids)


def copy_pages(theirs: Sequence[torch.Tensor], ours: Sequence[torch.Tensor], src: torch.Tensor,
               dst: torch.Tensor) -> None:
    """Per layer, pages ``src`` of ``theirs`` into pages ``dst`` of ``ours`` (layers of
    ``[2, num_blocks, ...]``): one indexed read and one indexed write per layer."""
    for their_layer, our_layer in zip(theirs, ours):
        rows = their_layer.index_select(1, src).to(device=our_layer.device, dtype=our_layer.dtype)
        our_layer.index_copy_(1, dst, rows)


class PeerPuller:
    """The scheduler's ``peer_loader`` on a prefill worker with one full-attention KV group."""

    def __init__(self, pusher: KVPusher, kv_caches: Sequence[torch.Tensor], block_size: int,
                 bytes_per_block: int, prefill_rate: PrefillRate) -> None:
        self.pusher = pusher
        self.kv_caches = list(kv_caches)
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.prefill_rate = prefill_rate
        self.num_pulled_blocks = 0
        self.num_failed = 0  # copies whose reservation ended meanwhile
        self._compatible: dict[int, bool] = {}  # id(link) -> its pool's pages match ours

    def _link(self, worker_id: str) -> ShmLink | None:
        link = self.pusher.links.get(worker_id)
        if not isinstance(link, ShmLink) or link.broken:
            return None
        ok = self._compatible.get(id(link))
        if ok is None:
            ok = (len(link.pool.layers) == len(self.kv_caches)
                  and all(theirs.shape[0] == ours.shape[0] and theirs.shape[2:] == ours.shape[2:]
                          for theirs, ours in zip(link.pool.layers, self.kv_caches)))
            self._compatible[id(link)] = ok
        return link if ok else None

    def cost(self) -> PrefixCost:
        return PrefixCost(self.prefill_rate.per_token_s or PRIOR_PREFILL_S_PER_TOKEN, 0.0,
                          bytes_per_block=self.bytes_per_block, block_size=self.block_size)

    def plan_pull(self, request: Request, num_cached_tokens: int) -> PeerPull | None:
        """The blocks from ``num_cached_tokens`` (the pool hit) to what the decode worker holds,
        when the rule says copying beats computing; None otherwise."""
        span = pull_span(request, num_cached_tokens, self.block_size)
        if span is None:
            return None
        link = self._link(request.kv_target)
        if link is None:
            return None
        first, last = span
        table = request.kv_target_block_ids[0]
        bytes_per_s = PRIOR_SHM_BYTES_PER_S
        if link.seconds_sending >= MIN_MEASURED_SEND_S:
            bytes_per_s = link.num_bytes_sent / link.seconds_sending
        cost = self.cost()
        num_blocks = last - first
        if not cost.should_copy(num_blocks, bytes_per_s, 0.0, num_cached_tokens):
            return None
        return PeerPull(request.request_id, link, table[first:last], request.kv_target_generation,
                        np.asarray(table[last:], dtype=np.int64), cost.copy_s(num_blocks, bytes_per_s))

    def apply(self, pulls: Sequence[PeerPull]) -> list[str]:
        """Copy each pull's pages, every layer (before the forward pass); returns the ids of the
        requests whose reservation ended before the copy was done (their pages are not valid)."""
        failed = []
        for pull in pulls:
            assert len(pull.block_ids) == pull.num_blocks, "a pull's pages were not allocated"
            if not pull.is_open():
                failed.append(pull.request_id)
                continue
            start = time.perf_counter()
            src = torch.tensor(pull.src_block_ids, dtype=torch.long)
            dst = torch.tensor(pull.block_ids, dtype=torch.long, device=self.kv_caches[0].device)
            copy_pages(pull.link.pool.layers, self.kv_caches, src, dst)
            if not pull.is_open():
                failed.append(pull.request_id)
                continue
            self.num_pulled_blocks += pull.num_blocks
            log.debug("request %s: copied %d blocks from its decode worker in %.2f ms", pull.request_id,
                      pull.num_blocks, (time.perf_counter() - start) * 1e3)
        self.num_failed += len(failed)
        return failed
