"""Simulated instances and links.

A step instance (colocated, prefill or decode) is the engine's own ``Scheduler`` over the
engine's own ``KVCacheManager``; only the model run is replaced by the profile's step time.
An encode instance batches queued images. A link is one FIFO sender (an instance's NIC, or
the copy thread of a shared-memory push) of fixed bandwidth.
"""

from __future__ import annotations

from collections import deque

from epdserve.cluster import messages as m
from epdserve.config import SchedulerConfig
from epdserve.engine.kv_cache import KVCacheManager, make_group_specs
from epdserve.engine.reservation_queue import ReservationQueue
from epdserve.engine.reload_rule import PRIOR_SHM_BYTES_PER_S, PrefixCost
from epdserve.engine.scheduler import Scheduler, SchedulerOutput
from epdserve.router.workers import WorkerInfo
from epdserve.sim.cost_model import EncodeCost, RoleProfile, StepCost
from epdserve.sim.kv_tiers import SimLoader, SimStore
from epdserve.sim.peer_pull import SimPeerPuller

# Shared-memory push on one host (engine/reload_rule.py, the same figure).
SHM_BYTES_PER_S = PRIOR_SHM_BYTES_PER_S


class Link:
    """One FIFO sender; ``free_at`` is when its last queued byte is out (seconds, sim clock)."""

    __slots__ = ("bytes_per_s", "free_at", "num_bytes")

    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"link bandwidth must be > 0, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0
        self.num_bytes = 0

    def send(self, ready_s: float, num_bytes: int) -> float:
        """Queue ``num_bytes`` that are ready at ``ready_s``; returns when they are out."""
        start = max(ready_s, self.free_at)
        self.free_at = start + num_bytes / self.bytes_per_s
        self.num_bytes += num_bytes
        return self.free_at

    def send_layerwise(self, step_start: float, step_s: float, num_layers: int, sizes: list[int]) -> list[float]:
        """Push one prefill step's KV layer by layer; returns when each entry's last layer is out.

        Layer i of the step is computed at ``step_start + (i+1) * step_s / num_layers``; then
        each entry sends ``size / num_layers`` bytes for that layer, in entry order, as soon as
        the link is free. With U the link time of one layer (all entries), the end of layer k's
        sends is e_k = max(e_{k-1}, ready_k) + U, whose closed form is
        max(free + (k+1) U, start + step/L + (k+1) U, start + (k+1) step/L + U).
        """
        total = sum(sizes)
        if total == 0:
            return [step_start + step_s] * len(sizes)
        per_layer_s = total / num_layers / self.bytes_per_s
        layer_s = step_s / num_layers
        if num_layers >= 2:
            k = num_layers - 1  # layers 0 .. N-2 done before the last one starts
            before_last = max(self.free_at + k * per_layer_s, step_start + layer_s + k * per_layer_s,
                              step_start + k * layer_s + per_layer_s)
        else:
            before_last = self.free_at
        last_start = max(before_last, step_start + step_s)
        ends = []
        sent = 0
        scale = 1.0 / (num_layers * self.bytes_per_s)
        for size in sizes:
            sent += size
            ends.append(last_start + sent * scale)
        self.free_at = last_start + per_layer_s
        self.num_bytes += total
        return ends


class Pace:
    """How a step (or an encoder batch) in flight progresses on a shared host.

    ``work_s`` is its time with its cores to itself and no neighbour mid-step; it progresses at
    ``rate`` = 1 / (k x (1 + neighbour_ratio x b)) seconds of work per second, where k is 1 + the
    number of instances mid-step on one of its cores (the kernel shares a core fairly among the
    processes running on it) and b the share of the host's other instances (on other cores) that
    are mid-step (``neighbour_ratio``: the calibrated neighbour step over the step alone). The
    rate changes whenever one of them begins or ends a step; the step's end is re-timed then.
    """

    __slots__ = ("neighbour_ratio", "rate", "since", "work_s")

    def __init__(self) -> None:
        self.work_s = 0.0  # work left at ``since``
        self.since = 0.0
        self.rate = 1.0
        self.neighbour_ratio = 0.0


class StepInstance:
    """A colocated, prefill or decode instance: the real scheduler with modelled step times."""

    def __init__(self, worker_id: str, profile: RoleProfile, block_size: int, max_model_len: int,
                 enable_prefix_caching: bool, max_num_seqs: int | None, link: Link | None, model_name: str,
                 node: str = "", store: SimStore | None = None, kv_tiers: dict[str, tuple[float, float]] | None = None,
                 bytes_per_block: int = 0) -> None:
        """``store``: the KV tiers of its node (``kv_tiers.SimStore``; None: none), read at the
        bandwidths ``kv_tiers`` gives (tier -> (bytes per second, seconds per load))."""
        self.role = profile.name
        # One full-attention group: block bookkeeping only (byte sizes come from the profile).
        # Which block ids a request holds does not change a simulated step's cost, so blocks
        # come in queue order (no runs): the same ids whether a decode stretch is stepped or
        # fast-forwarded in one allocation, and prefix-cache eviction strictly least recently used.
        groups = make_group_specs((None,), num_kv_heads=1, head_dim=1)
        self.kv_cache = KVCacheManager(groups, profile.num_kv_blocks, block_size, enable_prefix_caching,
                                       keep_runs=False)
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs or profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
        )
        self.scheduler = Scheduler(config, self.kv_cache)
        tiers = kv_tiers or {}
        self.loader: SimLoader | None = None
        self.puller: SimPeerPuller | None = None  # prefill: copies from decode's pages (set by the cluster)
        self.prefix_cost = PrefixCost.from_step_cost(profile.step, block_size, bytes_per_block,
                                                     {t: c[0] for t, c in tiers.items()},
                                                     {t: c[1] for t, c in tiers.items()})
        if store is not None:
            self.loader = SimLoader(store, self.prefix_cost)
            self.kv_cache.on_free = self.loader.on_free
            self.scheduler.prefix_loader = self.loader
        self.step_cost: StepCost = profile.step
        self.neighbour_step: StepCost | None = profile.neighbour_step
        self.neighbours: list = []  # the other instances on its host, on other cores (set by the cluster)
        self.sharers: list = []  # the instances on one of its cores (set by the cluster)
        self.link = link  # prefill: where its KV leaves
        self.reserve_queue: ReservationQueue = ReservationQueue()  # decode: flights waiting for room
        self.worker = WorkerInfo(m.Register(
            worker_id, self.role, pid=0, host="sim", model_name=model_name, max_model_len=max_model_len,
            num_kv_blocks=profile.num_kv_blocks, block_size=block_size, node=node, kv_bytes_per_block=bytes_per_block,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            kv_tiers=[m.TierCost(t, c[0], c[1]) for t, c in tiers.items()] if store is not None else []))
        self.worker.load = self.load()
        self.is_busy = False
        self.busy_until = 0.0  # when the step (or stretch step) in flight ends
        self.step_start = 0.0  # when the stepped step in flight began
        self.handover_pending = False  # draining: hand its requests over when the step in flight ends
        self.out: SchedulerOutput | None = None  # the step in flight
        self.stretch = None  # fastforward.Stretch in flight instead of one step
        self.epoch = 0  # bumped when a stretch is cut short or a step re-timed: its pending end event is stale
        self.index = 0  # position in the cluster: orders step ends that fall at one instant
        self.num_steps = 0
        self.busy_s = 0.0
        self.pace = Pace()  # the stepped step in flight: its work left and how fast it goes

    def load(self) -> m.Load:
        s = self.scheduler
        return m.Load(s.num_running, s.num_waiting + len(self.reserve_queue), self.kv_cache.num_free_blocks(),
                      self.kv_cache.num_used_blocks(),
                      len(s.reserved), len(s.transferring), prefill_s_per_token=self.step_cost.per_prefill_token_s)


class EncodeInstance:
    """A vision encoder: FIFO of (flight, image index), batched by image."""

    def __init__(self, worker_id: str, cost: EncodeCost, max_batch_images: int, link: Link, model_name: str) -> None:
        self.role = "encode"
        self.cost = cost
        self.max_batch_images = max_batch_images
        self.link = link
        self.queue: deque = deque()
        self.batch: list = []
        self.worker = WorkerInfo(m.Register(worker_id, "encode", pid=0, host="sim", model_name=model_name,
                                            max_model_len=0, num_kv_blocks=0, block_size=0))
        self.neighbour_step = None  # encoder steps are not calibrated
        self.neighbours: list = []  # the other instances on its host, on other cores (set by the cluster)
        self.sharers: list = []  # the instances on one of its cores (set by the cluster)
        self.is_busy = False
        self.busy_until = 0.0  # when the batch in flight ends
        self.epoch = 0  # bumped when the batch in flight is re-timed: its pending end event is stale
        self.num_steps = 0
        self.busy_s = 0.0
        self.pace = Pace()

    def load(self) -> m.Load:
        return m.Load(len(self.batch), len(self.queue), 0, 0)


def progress_rate(inst: StepInstance | EncodeInstance) -> float:
    """Seconds of work per second for ``inst``'s step in flight, given who is mid-step now
    (``Pace``): its core time-shared with the instances mid-step on it, and slowed by
    the busy share of its neighbours on other cores by the step's neighbour ratio."""
    k = 1 + sum(1 for o in inst.sharers if o.is_busy)
    ratio = inst.pace.neighbour_ratio
    if ratio and inst.neighbours:
        busy = sum(1 for o in inst.neighbours if o.is_busy) / len(inst.neighbours)
        return 1.0 / (k * (1.0 + ratio * busy))
    return 1.0 / k


def role_summary(instances: list[StepInstance | EncodeInstance], end_s: float) -> dict[str, dict]:
    """Per role: instances, steps, busy seconds and utilization over ``end_s`` seconds,
    preemptions and prompt tokens computed (step roles), bytes sent (prefill, encode), blocks
    copied from decode's pages (prefill)."""
    roles: dict[str, dict] = {}
    for inst in instances:
        r = roles.setdefault(inst.role, {"num_instances": 0, "num_steps": 0, "busy_s": 0.0})
        r["num_instances"] += 1
        r["num_steps"] += inst.num_steps
        r["busy_s"] += inst.busy_s
        if isinstance(inst, StepInstance):
            s = inst.scheduler
            r["num_preemptions"] = r.get("num_preemptions", 0) + s.num_preemptions
            r["num_computed_prompt_tokens"] = r.get("num_computed_prompt_tokens", 0) + s.num_computed_prompt_tokens
        if inst.role in ("prefill", "encode"):
            r["link_bytes"] = r.get("link_bytes", 0) + inst.link.num_bytes
        if getattr(inst, "puller", None) is not None:
            r["num_pulled_blocks"] = r.get("num_pulled_blocks", 0) + inst.puller.num_pulled_blocks
    for r in roles.values():
        r["utilization"] = r["busy_s"] / (max(end_s, 1e-9) * r["num_instances"])
    return roles
