"""Which KV heads each tensor-parallel rank holds, and the transfer plan between two workers of
different TP degrees: which prefill rank's heads go into which decode rank's pages.

A rank of TP ``t`` over a model with ``H`` KV heads holds an equal share ``H / t`` of them, or,
when TP exceeds the heads, one head shared by ``t / H`` consecutive ranks (replication, as
vLLM and SGLang do). The plan is computed once per pair of workers (``KVPusher.add_peer``)::

    H = 4, prefill TP 2 -> decode TP 4       H = 4, prefill TP 4 -> decode TP 2
    src rank 0 [h0 h1] -> dst 0 [h0], 1 [h1]   src 0 [h0], 1 [h1] -> dst 0 [h0 h1]  (staged)
    src rank 1 [h2 h3] -> dst 2 [h2], 3 [h3]   src 2 [h2], 3 [h3] -> dst 1 [h2 h3]  (staged)

    H = 1, prefill TP 1 -> decode TP 2: src 0 [h0] -> dst 0 [h0] and dst 1 [h0] (replicated)

A decode rank whose heads come whole from one prefill rank's whole heads is written straight
from that rank's pages (``HeadCopy.is_whole``); any other is assembled in the sender's staging
buffer first, so each destination rank gets one write per layer.
"""

from __future__ import annotations

from dataclasses import dataclass


def kv_heads_of_rank(total_num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) that rank ``tp_rank`` of ``tp_size`` holds: an equal
    share, or one head shared by ``tp_size / total_num_kv_heads`` consecutive ranks when TP
    exceeds the KV heads. ValueError when neither divides."""
    if total_num_kv_heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"rank {tp_rank} of tensor-parallel size {tp_size} over {total_num_kv_heads} KV heads")
    if tp_size >= total_num_kv_heads:
        if tp_size % total_num_kv_heads:
            raise ValueError(f"{tp_size} is not divisible by {total_num_kv_heads} KV heads")
        return tp_rank * total_num_kv_heads // tp_size, 1
    if total_num_kv_heads % tp_size:
        raise ValueError(f"{total_num_kv_heads} KV heads are not divisible by tensor-parallel size {tp_size}")
    count = total_num_kv_heads // tp_size
    return tp_rank * count, count


@dataclass(frozen=True)
class HeadCopy:
    """Local heads ``[src_head, src_head + num_heads)`` of prefill rank ``src_rank`` go to local
    heads ``[dst_head, dst_head + num_heads)`` of decode rank ``dst_rank``."""

    src_rank: int
    src_head: int
    dst_rank: int
    dst_head: int
    num_heads: int


@dataclass(frozen=True)
class TransferPlan:
    total_kv_heads: int
    src_tp: int
    dst_tp: int
    src_heads: int  # KV heads per prefill rank
    dst_heads: int  # KV heads per decode rank
    copies: tuple[tuple[HeadCopy, ...], ...]  # per decode rank, in local head order

    def is_whole(self, dst_rank: int) -> bool:
        """Decode rank ``dst_rank``'s heads are exactly one prefill rank's heads: no staging."""
        copies = self.copies[dst_rank]
        return len(copies) == 1 and copies[0].num_heads == self.src_heads == self.dst_heads

    @property
    def is_identity(self) -> bool:
        """Rank r to rank r, whole: equal TP."""
        return all(self.is_whole(r) and self.copies[r][0].src_rank == r for r in range(self.dst_tp))

    def sent_heads(self) -> int:
        """KV heads written per position over all decode ranks (replicated heads count each time)."""
        return sum(c.num_heads for copies in self.copies for c in copies)


def plan_transfer(total_kv_heads: int, src_tp: int, dst_tp: int) -> TransferPlan:
    """The plan for prefill at TP ``src_tp`` to decode at TP ``dst_tp``. A head several prefill
    ranks hold (replicated) is read from one of them, spread over the holders by decode rank.
    ValueError when either degree does not fit the heads."""
    src = [kv_heads_of_rank(total_kv_heads, r, src_tp) for r in range(src_tp)]
    dst = [kv_heads_of_rank(total_kv_heads, r, dst_tp) for r in range(dst_tp)]
    copies = []
    for dst_rank, (first, count) in enumerate(dst):
        runs: list[HeadCopy] = []
        for local in range(count):
            head = first + local
            holders = [r for r, (f, n) in enumerate(src) if f <= head < f + n]
            src_rank = holders[dst_rank % len(holders)]
            src_head = head - src[src_rank][0]
            last = runs[-1] if runs else None
            if (last is not None and last.src_rank == src_rank and last.src_head + last.num_heads == src_head
                    and last.dst_head + last.num_heads == local):
                runs[-1] = HeadCopy(src_rank, last.src_head, dst_rank, last.dst_head, last.num_heads + 1)
            else:
                runs.append(HeadCopy(src_rank, src_head, dst_rank, local, 1))
        copies.append(tuple(runs))
    return TransferPlan(total_kv_heads, src_tp, dst_tp, src[0][1], dst[0][1], tuple(copies))
