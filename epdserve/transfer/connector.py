"""The KV connector, worker side: a prefill worker pushes KV into decode workers' pages.

Two halves, as in vLLM's v1 connector. The scheduler side (``Scheduler`` with
``hold_blocks_for_transfer``) keeps a finished prefill's blocks until the transfer reports
done. This worker side moves the bytes: before a step the runner hands it one
``PushItem`` per request whose KV leaves this worker; attention calls ``save_layer(l)``
as soon as layer l's KV for the step is in the local pages (layer-wise), or the whole
prompt goes after the last chunk (bulk). Only descriptors are computed at run time:
the peer's pages were mapped (shm) or its connection opened (tcp) at start-up.

Token ranges pushed for a prompt of 10 tokens in chunks of 4 (layer-wise)::

    step 1: positions 0..3   step 2: 4..7   step 3: 8..9 + end of request

Tensor parallelism on either side: the prefill worker's rank 0 pushes for every rank. The pages
of its other ranks are shared memory it owns (``LLMEngine``), so it reads their heads itself;
each decode rank's pages get their heads by the pair's ``TransferPlan`` (``tp_plan.py``),
straight from one prefill rank's pages where the layouts agree, else assembled first in a
staging buffer allocated once per pusher. Layer-wise at prefill TP > 1, layer l goes when rank 0
writes layer l + 1 (or at the step's end): by then every rank has passed layer l's all-reduce,
so its KV of layer l is in its pages.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from epdserve.transfer.descriptors import NULL_BLOCK, KVEndpoint
from epdserve.transfer.fence import FenceView
from epdserve.transfer.locality import pick_transport
from epdserve.transfer.shm_pool import SharedKVPool, SharedStatePool
from epdserve.transfer.tcp import TcpKVSender
from epdserve.transfer.tp_plan import TransferPlan, plan_transfer


def flat_pages(layer: torch.Tensor) -> torch.Tensor:
    """A layer's pages ``[2, blocks, block_size, heads, dim]`` as ``[2, slots, heads, dim]``
    (a recurrent layer's have no heads: empty)."""
    return layer.view(2, layer.shape[1] * layer.shape[2], *layer.shape[3:])


class PeerLink(Protocol):
    num_bytes_sent: int
    seconds_sending: float
    broken: bool

    def write(self, request_id: str, generation: int, layer: int, group: int, kv: torch.Tensor,
              dst_slots: torch.Tensor, dst_block_ids: np.ndarray, rank: int = 0) -> bool:
        """Queue or write one layer's KV into the pages of the peer's tensor-parallel rank
        ``rank``; False when the receiver's fence refused it (the reservation ``generation`` is
        no longer open: nothing was written)."""
        ...
    def finish(self, request_id: str, generation: int) -> None: ...
    def poll_done(self) -> tuple[list[str], list[str]]: ...
    def close(self) -> None: ...


class ShmLink:
    """Writes straight into the decode worker's pool, mapped once: done when written. Each
    layer's copy goes ahead only while the decode worker's fence still gives the blocks to
    the reservation (``fence.py``)."""

    broken = False

    def __init__(self, endpoint: KVEndpoint) -> None:
        if len(endpoint.rank_shm_names) != endpoint.tp_size - 1:
            raise ValueError(f"a KV endpoint of tensor-parallel size {endpoint.tp_size} names "
                             f"{len(endpoint.rank_shm_names)} rank pools")
        self.pools: list[SharedKVPool] = []  # one per rank of the decode worker
        try:
            for name in ["", *endpoint.rank_shm_names]:
                self.pools.append(SharedKVPool.attach(endpoint, name or None))
        except BaseException:
            for pool in self.pools:
                pool.close()
            raise
        self.pool = self.pools[0]
        self.fence = (FenceView(endpoint.fence_shm_name, endpoint.num_groups, endpoint.num_blocks)
                      if endpoint.fence_shm_name else None)
        self._flat = [[flat_pages(layer) for layer in pool.layers] for pool in self.pools]
        # A recurrent model's state slots: a state layer's "KV" is one request's state per slot.
        self.state = SharedStatePool.attach(endpoint) if endpoint.state_shm_name else None
        if endpoint.state_shapes and self.state is None:
            self.close()
            raise ValueError("a decode worker with recurrent state offers no shared state pool")
        self._done: list[str] = []
        self.num_bytes_sent = 0
        self.seconds_sending = 0.0
        self.num_refused_writes = 0  # layers the fence refused (their reservation had ended)

    def write(self, request_id: str, generation: int, layer: int, group: int, kv: torch.Tensor,
              dst_slots: torch.Tensor, dst_block_ids: np.ndarray, rank: int = 0) -> bool:
        if self.fence is not None and not self.fence.admits(generation, group, dst_block_ids):
            self.num_refused_writes += 1
            return False
        start = time.perf_counter()
        if self.state is not None and self.state.layers[layer].numel():
            self.state.layers[layer].index_copy_(0, dst_slots, kv.to(self.state.layers[layer].dtype))
        else:
            self._flat[rank][layer].index_copy_(1, dst_slots, kv.to(self.pool.dtype))
        self.num_bytes_sent += kv.numel() * kv.element_size()
        self.seconds_sending += time.perf_counter() - start
        return True

    def finish(self, request_id: str, generation: int) -> None:
        self._done.append(request_id)

    def poll_done(self) -> tuple[list[str], list[str]]:
        done, self._done = self._done, []
        return done, []

    def close(self) -> None:
        self._flat = []
        for pool in self.pools:
            pool.close()
        if getattr(self, "state", None) is not None:
            self.state.close()
        if self.fence is not None:
            self.fence.close()


def open_link(endpoint: KVEndpoint, key: bytes) -> PeerLink:
    """A link to a decode worker's pages: its shared pool when it runs on this node, else its
    TCP listener (proving the cluster secret ``key``). Raises ValueError when it offers
    neither, OSError when it cannot be reached."""
    if pick_transport(endpoint.transport, endpoint.shm_name, endpoint.port, endpoint.node) == "shm":
        return ShmLink(endpoint)
    return TcpKVSender(endpoint.host, endpoint.port, key)


@dataclass
class PushItem:
    """One request's share of one step. Tables are per group; slot = block * block_size + offset."""

    request_id: str
    target: str  # decode worker id
    start: int  # first position to push this step
    end: int  # one past the last position computed this step
    src_tables: list[list[int]]
    dst_tables: list[list[int]]
    is_last: bool  # the prompt's last chunk: the request's transfer ends with this step
    generation: int = 0  # the decode worker's reservation (its write fence admits only this)
    skip: int = 0  # leading prompt positions the decode worker holds already: never pushed
    src_slots: list[torch.Tensor] = field(default_factory=list)  # per group, filled by begin_step
    dst_slots: list[torch.Tensor] = field(default_factory=list)
    dst_block_ids: list[np.ndarray] = field(default_factory=list)  # per group: blocks written this step


@dataclass
class TransferStats:
    request_id: str
    ok: bool
    kv_bytes: int
    start: float  # seconds since the epoch: the first layer pushed
    end: float
    compute_end: float  # when the prompt's last chunk finished computing
    blocking_s: float  # time the prefill worker's compute thread spent moving this KV
    transport: str = ""  # "shm" or "tcp" ("" when no link was open)
    kv_bytes_skipped: int = 0  # KV of the leading positions the decode worker held already
    kv_bytes_by_group: list[int] = field(default_factory=list)  # kv_bytes per KV cache group

    @property
    def exposed_s(self) -> float:
        """Transfer time not hidden behind prefill compute: what the compute thread spent
        moving bytes (a shared-memory write is a copy by that thread) plus what was still in
        flight when compute ended."""
        return self.blocking_s + max(0.0, self.end - self.compute_end)


class KVPusher:
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layer_to_group: list[int],
        block_size: int,
        layerwise: bool = True,
        rank_caches: list[list[torch.Tensor]] | None = None,
        total_kv_heads: int = 0,
        staging_tokens: int = 0,
        state_caches: list[torch.Tensor] | None = None,
    ) -> None:
        """``kv_caches``: this rank's pages per layer. At tensor parallelism > 1,
        ``rank_caches`` holds every rank's pages (rank 0's first) and ``total_kv_heads`` the
        model's KV heads; ``staging_tokens``: positions the staging buffer holds from the
        start (the most one push moves; it grows, rarely, past that). ``state_caches``: a
        recurrent model's state per layer (``[num_slots, ...]``, empty for an attention
        layer): a request's state in each such layer goes with its prompt's last chunk."""
        self.kv_caches = kv_caches
        self.rank_caches = rank_caches or [kv_caches]
        self.tp_size = len(self.rank_caches)
        self.total_kv_heads = total_kv_heads or next((c.shape[3] for c in kv_caches if c.shape[3]), 0)
        self.state_caches = state_caches
        self._state_layers = [i for i, s in enumerate(state_caches or []) if s.numel()]
        self._state_groups = {layer_to_group[i] for i in self._state_layers}
        self._srcs = [[flat_pages(c) for c in caches] for caches in self.rank_caches]
        self._plans: dict[str, TransferPlan] = {}  # decode worker id -> its plan
        self._staging_tokens = staging_tokens
        self._staging: torch.Tensor | None = None  # flat, host memory; views per write
        self._pending_layer: int | None = None  # TP > 1, layer-wise: written, not yet pushed
        self.device = kv_caches[0].device
        self.layer_to_group = layer_to_group
        self.block_size = block_size
        self.layerwise = layerwise
        # Fault injection for tests of the router's transfer timeout: transfers never end.
        self.stall = False
        self.links: dict[str, PeerLink] = {}
        self._endpoints: dict[str, tuple[KVEndpoint, bytes]] = {}  # to reopen a link that broke
        self._items: list[PushItem] = []
        self._targets: dict[str, str] = {}  # request id -> decode worker id, while in flight
        self._started: dict[str, float] = {}
        self._blocking: dict[str, float] = {}
        self._bytes: dict[str, list[int]] = {}  # request id -> bytes pushed per group
        self._compute_end: dict[str, float] = {}
        self._skipped: dict[str, int] = {}  # request id -> positions not pushed (decode had them)
        self._finished: list[TransferStats] = []
        self.num_groups = max(layer_to_group) + 1
        # KV bytes of one position over every layer (K and V) of one rank's heads
        self.bytes_per_token = sum(2 * c[0, 0, 0].numel() * c.element_size() for c in kv_caches)

    # -- peers ---------------------------------------------------------------------------
    def add_peer(self, worker_id: str, endpoint: KVEndpoint, key: bytes = b"") -> None:
        """Open the link to decode worker ``worker_id`` (``key``: the cluster secret its TCP
        listener asks for)."""
        old = self.links.pop(worker_id, None)
        if old is not None:
            old.close()
        self._plans[worker_id] = self.plan_for(endpoint)
        self._endpoints[worker_id] = (endpoint, key)
        self.links[worker_id] = open_link(endpoint, key)

    def plan_for(self, endpoint: KVEndpoint) -> TransferPlan:
        """Which of this worker's ranks writes which heads into which of the peer's ranks;
        ValueError when the peer's pages cannot take this worker's KV."""
        total = endpoint.total_kv_heads or (endpoint.layer_shapes[0][0] if endpoint.layer_shapes else 0)
        if total != self.total_kv_heads:
            raise ValueError(f"the decode worker's model has {total} KV heads, this one {self.total_kv_heads}")
        plan = plan_transfer(total, self.tp_size, endpoint.tp_size)
        ours = [(plan.dst_heads if c.shape[3] else 0, c.shape[4]) for c in self.kv_caches]
        theirs = [tuple(shape) for shape in endpoint.layer_shapes]
        if theirs != ours or endpoint.block_size != self.block_size:
            raise ValueError(f"the decode worker's KV pages (block size {endpoint.block_size}, layers "
                             f"{theirs[:1]}...) do not take this worker's (block size {self.block_size}, {ours[:1]}...)")
        states = [list(s.shape[1:]) if s.numel() else [] for s in self.state_caches or []]
        if [list(s) for s in endpoint.state_shapes] != states:
            raise ValueError(f"the decode worker's recurrent state ({endpoint.state_shapes[:2]}...) does not take "
                             f"this worker's ({states[:2]}...)")
        return plan

    def _stage(self, num_tokens: int, num_heads: int, head_dim: int) -> torch.Tensor:
        """A [2, num_tokens, num_heads, head_dim] view of the staging buffer (host memory,
        allocated once; it grows only when a push exceeds every earlier one)."""
        numel = 2 * num_tokens * num_heads * head_dim
        if self._staging is None or self._staging.numel() < numel:
            tokens = max(num_tokens, self._staging_tokens)
            self._staging_tokens = tokens
            size = max(numel, 2 * tokens * num_heads * head_dim)
            self._staging = torch.empty(size, dtype=self.kv_caches[0].dtype,
                                        pin_memory=self.device.type == "cuda")
        return self._staging[:numel].view(2, num_tokens, num_heads, head_dim)

    def _reopen_broken(self, worker_id: str) -> None:
        """A link that broke (a send timed out, the peer reset it) fails the transfers it
        carried; the next request to that peer gets a fresh connection."""
        link = self.links.get(worker_id)
        if link is None or not link.broken:
            return
        link.close()
        try:
            self.links[worker_id] = open_link(*self._endpoints[worker_id])
        except (OSError, ValueError):
            self.links.pop(worker_id, None)

    def remove_peer(self, worker_id: str) -> list[str]:
        """Drop a dead decode worker; returns the requests whose transfer to it failed."""
        link = self.links.pop(worker_id, None)
        self._endpoints.pop(worker_id, None)
        self._plans.pop(worker_id, None)
        if link is not None:
            link.close()
        failed = [rid for rid, target in self._targets.items() if target == worker_id]
        for rid in failed:
            self._finish(rid, ok=False)
        return failed

    def abort(self, request_id: str) -> None:
        if request_id in self._targets:
            self._targets.pop(request_id)
            self._started.pop(request_id, None)
            self._blocking.pop(request_id, None)
            self._bytes.pop(request_id, None)
            self._compute_end.pop(request_id, None)
            self._skipped.pop(request_id, None)

    def is_pushing(self, request_id: str) -> bool:
        """Some of ``request_id``'s KV went (or is going) to its decode worker."""
        return request_id in self._targets

    @property
    def num_in_flight(self) -> int:
        return len(self._targets)

    def transport_of(self, worker_id: str) -> str:
        """"tcp" or "shm": how KV reaches decode worker ``worker_id`` ("" with no link)."""
        link = self.links.get(worker_id)
        return "" if link is None else "shm" if isinstance(link, ShmLink) else "tcp"

    @property
    def num_bytes_sent(self) -> int:
        return sum(link.num_bytes_sent for link in self.links.values())

    @property
    def seconds_sending(self) -> float:
        return sum(link.seconds_sending for link in self.links.values())

    @property
    def num_refused_writes(self) -> int:
        """Layer writes a decode worker's fence refused (shared memory; over TCP the receiver
        counts them)."""
        return sum(getattr(link, "num_refused_writes", 0) for link in self.links.values())

    # -- one step ------------------------------------------------------------------------
    def begin_step(self, items: list[PushItem]) -> None:
        bs = self.block_size
        self._items = []
        for item in items:
            self._reopen_broken(item.target)
            if item.target not in self.links:
                self._targets[item.request_id] = item.target
                self._finish(item.request_id, ok=False)
                continue
            self._targets[item.request_id] = item.target
            self._skipped[item.request_id] = item.skip
            if not self.layerwise:
                if not item.is_last:
                    continue
                item.start = min(item.skip, item.end)  # bulk: the whole prompt after its last chunk
            # Per group, the positions whose block the decode worker holds: a sliding group's
            # table starts with null blocks where its window has passed (``kv_cache.py``).
            item.src_slots, item.dst_slots, item.dst_block_ids = [], [], []
            for group, (src, dst) in enumerate(zip(item.src_tables, item.dst_tables)):
                if group in self._state_groups:  # one slot, sent once the prompt is computed
                    sent = item.is_last and src and dst
                    item.src_slots.append(torch.tensor(src[:1] if sent else [], dtype=torch.long, device=self.device))
                    item.dst_slots.append(torch.tensor(dst[:1] if sent else [], dtype=torch.long))
                    item.dst_block_ids.append(np.asarray(dst[:1] if sent else [], dtype=np.int64))
                    continue
                live = next((i for i, b in enumerate(dst) if b != NULL_BLOCK), len(dst))
                positions = range(max(item.start, live * bs), item.end)
                item.src_slots.append(torch.tensor([src[p // bs] * bs + p % bs for p in positions], dtype=torch.long,
                                                   device=self.device))
                item.dst_slots.append(torch.tensor([dst[p // bs] * bs + p % bs for p in positions], dtype=torch.long))
                first, last = positions.start // bs, (item.end - 1) // bs  # no block when the range is empty
                item.dst_block_ids.append(np.asarray(dst[first : last + 1] if len(positions) else [], dtype=np.int64))
            self._items.append(item)

    def save_layer(self, layer: int) -> None:
        """Layer ``layer``'s KV for this step is in rank 0's pages: push it (layer-wise). At
        TP > 1 push the layer written before it, which every rank has finished."""
        if not self.layerwise:
            return
        if self.tp_size == 1:
            self._push_layer(layer)
            return
        if self._pending_layer is not None:
            self._push_layer(self._pending_layer)
        self._pending_layer = layer

    def end_step(self) -> None:
        """After the forward pass: bulk pushes, end-of-request markers."""
        compute_end = time.time()
        if not self.layerwise:
            for layer in range(len(self.kv_caches)):
                self._push_layer(layer)
        else:
            if self._pending_layer is not None:
                self._push_layer(self._pending_layer)
            for layer in self._state_layers:  # final once the forward pass is done
                self._push_layer(layer)
        self._pending_layer = None
        for item in self._items:
            if item.is_last and item.request_id in self._targets and not self.stall:
                self._compute_end[item.request_id] = compute_end
                self.links[item.target].finish(item.request_id, item.generation)
        self._items = []

    def _push_layer(self, layer: int) -> None:
        group = self.layer_to_group[layer]
        if group in self._state_groups:
            self._push_state(layer, group)
            return
        srcs = [flats[layer] for flats in self._srcs]
        for item, link, start in self._pushable(group):
            rid = item.request_id
            plan = self._plans[item.target]
            slots = item.src_slots[group]
            # A shared-memory write is done when ``write`` returns: the staging buffer serves
            # the next one. A TCP sender keeps what it queues: it gets a tensor of its own.
            reuse = isinstance(link, ShmLink) and self.device.type == "cpu"
            rows: dict[int, torch.Tensor] = {}  # prefill rank -> its heads at these slots
            for dst_rank, copies in enumerate(plan.copies):
                if plan.is_whole(dst_rank):  # one prefill rank's heads, all of them
                    src = srcs[copies[0].src_rank]
                    if reuse:
                        kv = torch.index_select(src, 1, slots, out=self._stage(len(slots), plan.dst_heads,
                                                                                src.shape[-1]))
                    else:
                        # Links write host memory (a shared pool, a socket): pages on an
                        # accelerator are copied out here.
                        kv = src.index_select(1, slots).cpu()
                else:  # split or gathered: assembled in the decode rank's layout
                    kv = self._stage(len(slots), plan.dst_heads, srcs[0].shape[-1])
                    for c in copies:
                        if c.src_rank not in rows:  # whole rows first: a contiguous gather is a memcpy
                            rows[c.src_rank] = srcs[c.src_rank].index_select(1, slots).cpu()
                        kv[:, :, c.dst_head : c.dst_head + c.num_heads].copy_(
                            rows[c.src_rank][:, :, c.src_head : c.src_head + c.num_heads])
                    if not reuse:
                        kv = kv.clone()
                if not link.write(rid, item.generation, layer, group, kv, item.dst_slots[group],
                                  item.dst_block_ids[group], dst_rank):
                    self._finish(rid, ok=False)  # the reservation ended: nothing more is written
                    break
                self._count(rid, group, kv)
            else:
                self._blocking[rid] = self._blocking.get(rid, 0.0) + time.time() - start

    def _push_state(self, layer: int, group: int) -> None:
        """The requests' recurrent state in ``layer`` into their slots on the decode worker."""
        state = self.state_caches[layer]  # type: ignore[index]
        for item, link, start in self._pushable(group):
            rid = item.request_id
            rows = state.index_select(0, item.src_slots[group]).cpu()
            if not link.write(rid, item.generation, layer, group, rows, item.dst_slots[group],
                              item.dst_block_ids[group]):
                self._finish(rid, ok=False)
                continue
            self._blocking[rid] = self._blocking.get(rid, 0.0) + time.time() - start
            self._count(rid, group, rows)

    def _pushable(self, group: int) -> Iterator[tuple[PushItem, PeerLink, float]]:
        """This step's items with something of ``group`` to push over a live link: (item, its
        link, when its push of this layer started)."""
        for item in self._items:
            link = self.links.get(item.target)
            if link is None or item.request_id not in self._targets or not len(item.src_slots[group]):
                continue
            start = time.time()
            self._started.setdefault(item.request_id, start)
            yield item, link, start

    def _count(self, request_id: str, group: int, sent: torch.Tensor) -> None:
        by_group = self._bytes.setdefault(request_id, [0] * self.num_groups)
        by_group[group] += sent.numel() * sent.element_size()

    def poll(self) -> list[TransferStats]:
        """Transfers that completed or failed since the last poll."""
        for link in self.links.values():
            done, failed = link.poll_done()
            for rid in done:
                self._finish(rid, ok=True)
            for rid in failed:
                self._finish(rid, ok=False)
        finished, self._finished = self._finished, []
        return finished

    def _finish(self, request_id: str, ok: bool) -> None:
        target = self._targets.pop(request_id, None)
        if target is None:
            return
        now = time.time()
        plan = self._plans.get(target)
        # Bytes of one position to this peer: every head its ranks take (a replicated head each time).
        per_token = self.bytes_per_token if plan is None else self.bytes_per_token * plan.sent_heads() // plan.src_heads
        by_group = self._bytes.pop(request_id, None) or [0] * self.num_groups
        self._finished.append(
            TransferStats(
                request_id, ok, sum(by_group), self._started.pop(request_id, now),
                now, self._compute_end.pop(request_id, now), self._blocking.pop(request_id, 0.0),
                self.transport_of(target), self._skipped.pop(request_id, 0) * per_token, by_group,
            )
        )

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
