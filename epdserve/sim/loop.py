"""The simulator's cluster and clock: its instances, the router's worker registry, one event heap.

Events sit in one heap as ``(time_s, kind, order, seq, payload)``. At equal times lower kinds
go first, so work that arrives at an instant is visible to a step that ends at that instant::

    ARRIVAL < EMBED_DONE < TRANSFER_DONE < ENCODE_END < STEP_END < RESERVED < HEARTBEAT < ROLE_SWITCHED
    < HANDED_OVER

and step ends at one instant go in instance order (``order``), the rest in push order.
``SimLoop.run`` pops them and calls the handler of each kind (``_on_arrival`` ..), which the
request path (``cluster.ClusterSim``) defines; the heartbeat, here, reports every instance's
load to the registry as workers do.

Each step instance runs the engine's ``Scheduler.schedule()`` when it starts a step and
``Scheduler.update()`` when the step ends (``StepCost`` seconds later); between steps it
does nothing. Decode-only stretches are fast-forwarded (``fastforward``) to the same result.
"""

from __future__ import annotations

import heapq
from time import perf_counter

import numpy as np

from epdserve.cluster.local import core_sets
from epdserve.errors import ConfigError
from epdserve.router.workers import PromptBlocks, WorkerRegistry
from epdserve.sampling import SamplingParams
from epdserve.service import SERVICE_CLASSES, draw_classes
from epdserve.sim import fastforward
from epdserve.sim.config import SimConfig, SimStats
from epdserve.sim.cost_model import CostModel
from epdserve.sim.instance import EncodeInstance, Link, StepInstance, progress_rate, role_summary
from epdserve.sim.kv_tiers import SimStore
from epdserve.sim.peer_pull import SimPeerPuller
from epdserve.sim.results import Flight, MissWatch, Recorder
from epdserve.sim.roles import SimRoleSwitching
from epdserve.sim.workload import SimWorkload

ARRIVAL, EMBED_DONE, TRANSFER_DONE, ENCODE_END, STEP_END, RESERVED, HEARTBEAT, ROLE_SWITCHED, HANDED_OVER = range(9)


class SimLoop:
    """The instances of ``config.topology``, the router's registry of them, the clock and the
    event heap; ``run`` drives the handlers until no event is left (or the SLO is out of reach)."""

    def __init__(self, cost: CostModel, config: SimConfig, workload: SimWorkload,
                 watch: MissWatch | None = None) -> None:
        """``watch``: stop as soon as the run can no longer meet its SLO (``is_aborted``)."""
        if len(workload) == 0:
            raise ConfigError("the workload has no requests")
        topo = config.topology
        self.cost, self.config, self.workload = cost, config, workload
        self.is_split = topo.is_split
        self.num_image_tokens = 0
        if workload.num_images:
            if not topo.num_encode:
                raise ConfigError("the workload has images; add encode=N to the topology")
            self.num_image_tokens = workload.num_images * workload.tiles_per_image * cost.encoder().tokens_per_tile
        elif topo.num_encode:
            cost.encoder()
        lengths = workload.input_lens + workload.output_lens + self.num_image_tokens
        self.max_model_len = config.max_model_len or max(2, int(lengths.max()))
        self.now = 0.0
        self.instances: list[StepInstance | EncodeInstance] = []
        self.registry = WorkerRegistry(config.routing, config.routing_ttft_slo_s)
        # prefix-aware routing: instances report the blocks they cache and evict (KV events)
        self.is_prefix_aware = config.routing == "prefix-aware"
        self.by_worker_id: dict[str, StepInstance | EncodeInstance] = {}
        self.stores: dict[str, SimStore] = {}  # node -> its KV tiers below the pools
        self.kv_tiers = self._kv_tier_costs() if config.has_kv_tiers else {}
        for role in topo.roles:
            for i in range(topo.count(role)):
                self._add_instance(role, f"{role}-{i}")
        for inst in self.instances:
            self._set_neighbours(inst)
        # --role-switching auto: the router's controller on these instances (sim/roles.py)
        self.roles = (SimRoleSwitching(config.role_control, config.role_switch_s, self.registry, self.instances,
                                       self.by_worker_id, self.schedule_switch, self.hand_over)
                      if config.role_control is not None and topo.is_split else None)
        # A step's time then depends on the other instances' state, which a fast-forwarded
        # stretch cannot see: step every step.
        self.is_shared = any((inst.neighbour_step is not None and inst.neighbours) or inst.sharers
                             for inst in self.instances)
        self.is_fast_forward = config.is_fast_forward and not self.is_shared
        self.recorder = Recorder(len(workload), config.max_detail_requests, watch)
        self.watch = watch
        self.is_aborted = False
        self.flights: dict[str, Flight] = {}
        self.detail_ids: set[str] = set()
        self.heap: list = []
        self.seq = 0
        self.num_pending_events = 0  # in the heap, heartbeats not counted
        self.stats = SimStats()
        self._filler = workload.make_filler()
        self._params: dict[tuple[int, int], SamplingParams] = {}
        self.class_ids = self._draw_classes()  # per request, an index into SERVICE_CLASSES

    def _set_neighbours(self, inst: StepInstance | EncodeInstance) -> None:
        """The other instances on its host: those on one of its cores (``sharers``, with
        ``cores_per_host``) and the rest (``neighbours``, the calibrated neighbour term's)."""
        config = self.config
        per_host = config.instances_per_host
        host = inst.index // per_host
        on_host = [o for o in self.instances if o is not inst and o.index // per_host == host]
        inst.sharers = []
        if config.cores_per_host:
            cores = core_sets(per_host, config.cores_per_worker, range(config.cores_per_host))
            mine = set(cores[inst.index % per_host])
            inst.sharers = [o for o in on_host if mine.intersection(cores[o.index % per_host])]
        inst.neighbours = [o for o in on_host if o not in inst.sharers]

    def _add_instance(self, role: str, worker_id: str) -> None:
        inst = self._make_instance(role, worker_id, len(self.instances))
        self.instances.append(inst)
        self.registry.add(inst.worker)
        self.by_worker_id[worker_id] = inst

    def _make_instance(self, role: str, worker_id: str, index: int) -> StepInstance | EncodeInstance:
        cost, config = self.cost, self.config
        link = Link(config.link_bytes_per_s)
        if role == "encode":
            inst = EncodeInstance(worker_id, cost.encoder(), config.encode_max_batch_images, link, cost.model)
        else:
            profile = cost.role(role)
            capacity = (profile.num_kv_blocks - 1) * cost.block_size
            if capacity < self.max_model_len:
                raise ConfigError(
                    f"the profile's {role} role holds {capacity} tokens of KV; the workload's longest "
                    f"request needs {self.max_model_len} (pass a smaller max model length)"
                )
            node = f"sim-host-{index // config.instances_per_host}"
            inst = StepInstance(worker_id, profile, cost.block_size, self.max_model_len, config.enable_prefix_caching,
                                config.max_num_seqs.get(role), link if role in ("prefill", "decode") else None, cost.model,
                                node, self._store(node), self.kv_tiers, cost.bytes_per_block())
        inst.index = index
        if role == "prefill" and config.enable_prefix_caching:
            by_id = self.by_worker_id
            inst.puller = SimPeerPuller(inst.prefix_cost, link.bytes_per_s,
                                        lambda worker_id: by_id[worker_id].worker.registration.node == node)
            inst.scheduler.peer_loader = inst.puller
        inst.worker.role_since = self.now  # the simulator's clock (registered now)
        if self.is_prefix_aware and role != "encode":
            inst.kv_cache.record_events()
        return inst

    # -- role switching (sim/roles.py) ---------------------------------------------------
    def schedule_switch(self, when: float, inst: StepInstance) -> None:
        """The drained ``inst`` is back in its new role at ``when``."""
        self._push(when, ROLE_SWITCHED, inst)

    def _on_role_switched(self, old: StepInstance) -> None:
        """A fresh instance of the new role takes ``old``'s place (id, host, position) and
        registers, as a switched worker does."""
        new = self._make_instance(old.worker.switch_to, old.worker.worker_id, old.index)
        new.worker.num_switches = old.worker.num_switches + 1
        new.num_steps, new.busy_s = old.num_steps, old.busy_s
        self.instances[old.index] = new
        self.by_worker_id[new.worker.worker_id] = new
        self.registry.add(new.worker)
        for inst in self.instances:
            if inst is new or old in inst.neighbours or old in inst.sharers:
                self._set_neighbours(inst)
        self.roles.on_switched(self.now, new)

    def _draw_classes(self) -> np.ndarray:
        """Each request's class (``service.draw_classes``, as bench draws them) as an index."""
        names = draw_classes(self.config.class_mix, len(self.workload), self.config.class_seed)
        index = {c: i for i, c in enumerate(SERVICE_CLASSES)}
        return np.fromiter((index[c] for c in names), dtype=np.int8, count=len(names))

    def class_summary(self) -> dict:
        """Per service class: requests, those refused at admission, and of the admitted ones
        those that met the class's SLO (``ClassSLO``; None without one)."""
        rec, out = self.recorder, {}
        for ci, name in enumerate(SERVICE_CLASSES):
            idx = np.flatnonzero(self.class_ids == ci)
            if not len(idx):
                continue
            refused = sum(1 for i in idx if rec.errors.get(int(i), "").startswith("429"))
            ok = idx[rec.is_ok[idx]]
            slo = self.config.class_slos.get(name)
            met = None
            if slo is not None:
                tpots = np.where(rec.output_len[ok] > 1, (rec.latency[ok] - rec.ttft[ok])
                                 / np.maximum(rec.output_len[ok] - 1, 1), 0.0)
                met = int(sum(slo.is_met(float(t), float(p) if n > 1 else None)
                              for t, p, n in zip(rec.ttft[ok], tpots, rec.output_len[ok])))
            out[name] = {"num_requests": int(len(idx)), "num_refused": refused, "num_completed": int(len(ok)),
                         "num_slo_met": met,
                         "attainment_of_completed": (met / len(ok) if met is not None and len(ok) else None)}
        return out

    def _kv_tier_costs(self) -> dict[str, tuple[float, float]]:
        """tier -> (read bytes per second, seconds per load) of each tier with a size: the
        config's bandwidth, else the profile's measurement (``epdserve profile``)."""
        config, costs = self.config, {}
        for tier, gib in (("host", config.kv_host_tier_gib), ("disk", config.kv_disk_tier_gib)):
            if gib <= 0:
                continue
            if tier in config.kv_tier_bytes_per_s:
                costs[tier] = (config.kv_tier_bytes_per_s[tier], 0.0)
            elif tier in self.cost.kv_tiers:
                costs[tier] = self.cost.kv_tiers[tier]
            else:
                raise ConfigError(f"the profile has no measured KV {tier} tier: profile again with this "
                                  f"version, or give --kv-{tier}-tier-read-gbps")
        return costs

    def _store(self, node: str) -> SimStore | None:
        """The node's KV tiers (made at its first instance); None without tiers."""
        if not self.config.has_kv_tiers:
            return None
        store = self.stores.get(node)
        if store is None:
            bytes_per_block = self.cost.bytes_per_block()
            blocks = [int(gib * 2**30) // bytes_per_block for gib in (self.config.kv_host_tier_gib,
                                                                       self.config.kv_disk_tier_gib)]
            for tier, gib, n in zip(("host", "disk"), (self.config.kv_host_tier_gib, self.config.kv_disk_tier_gib),
                                    blocks):
                if gib > 0 and n < 1:
                    raise ConfigError(f"a {gib:g} GiB {tier} tier holds no {bytes_per_block}-byte KV block")
            store = self.stores[node] = SimStore(*blocks, record_events=self.is_prefix_aware)
        return store

    # -- event loop ----------------------------------------------------------------------
    def _push(self, when: float, kind: int, payload: object, order: int = 0) -> None:
        self.seq += 1
        if kind != HEARTBEAT:
            self.num_pending_events += 1
        heapq.heappush(self.heap, (when, kind, order, self.seq, payload))

    def _push_step_end(self, inst: StepInstance, when: float) -> None:
        inst.busy_until = when
        self._push(when, STEP_END, (inst, inst.epoch), inst.index)

    def _push_encode_end(self, enc: EncodeInstance, when: float) -> None:
        enc.busy_until = when
        self._push(when, ENCODE_END, (enc, enc.epoch))

    def _repace(self, changed: StepInstance | EncodeInstance) -> None:
        """``changed`` began or ended a step: the steps in flight on its host whose pace that
        changes (its sharers', and its neighbours' with a neighbour term) end at a new time.
        Work done so far counts at the old rate (``instance.Pace``)."""
        now = self.now
        for other in (*changed.sharers, *changed.neighbours):
            if not other.is_busy or getattr(other, "stretch", None) is not None:
                continue
            pace = other.pace
            rate = progress_rate(other)
            if rate == pace.rate:
                continue
            pace.work_s = max(pace.work_s - (now - pace.since) * pace.rate, 0.0)
            pace.since, pace.rate = now, rate
            end = now + pace.work_s / rate
            other.busy_s += end - other.busy_until
            other.epoch += 1
            if isinstance(other, EncodeInstance):
                self._push_encode_end(other, end)
            else:
                self._push_step_end(other, end)

    def run(self) -> Recorder:
        started = perf_counter()
        self._push(float(self.workload.arrival_s[0]), ARRIVAL, 0)
        self._push(0.0, HEARTBEAT, None)
        heap, pop = self.heap, heapq.heappop
        num_events = 0
        watch = self.watch
        while heap:
            if watch is not None and watch.is_hopeless:
                self.is_aborted = True
                break
            when, kind, _, _, payload = pop(heap)
            self.now = when
            num_events += 1
            if kind != HEARTBEAT:
                self.num_pending_events -= 1
            if kind == STEP_END:
                inst, epoch = payload
                if epoch == inst.epoch:
                    self._on_step_end(inst)
            elif kind == ARRIVAL:
                self._on_arrival(payload)
            elif kind == TRANSFER_DONE:
                self._on_transfer_done(payload)
            elif kind == ENCODE_END:
                enc, epoch = payload
                if epoch == enc.epoch:
                    self._on_encode_end(enc)
            elif kind == EMBED_DONE:
                self._on_embed_done(*payload)
            elif kind == RESERVED:
                self._submit(*payload)
            elif kind == ROLE_SWITCHED:
                self._on_role_switched(payload)
            elif kind == HANDED_OVER:
                self._on_handed_over(*payload)
            else:
                self._on_heartbeat(payload)
        self.stats = SimStats(perf_counter() - started, num_events, self.now)
        return self.recorder

    def _on_heartbeat(self, _: object) -> None:
        for inst in self.instances:
            stretch = getattr(inst, "stretch", None)
            inst.worker.load = inst.load() if stretch is None else fastforward.load(inst, stretch, self.now)
            inst.worker.num_submitted = 0
        if self.roles is not None:
            self.roles.on_heartbeat(self.now)
        if self.flights and self.num_pending_events == 0:
            raise ConfigError(
                f"simulation stalled at {self.now:.3f} s with {len(self.flights)} requests that no instance "
                f"can schedule (KV cache or max_num_seqs too small for them)"
            )
        if self.flights or self.num_pending_events:
            self._push(self.now + self.config.heartbeat_s, HEARTBEAT, None)

    # -- instances -----------------------------------------------------------------------
    def _pick(self, role: str, prompt: PromptBlocks | None = None) -> StepInstance | EncodeInstance | None:
        """The instance the router's registry picks for ``role`` (None: none of that role)."""
        worker = self.registry.pick(role, prompt)
        return None if worker is None else self.by_worker_id[worker.worker_id]

    def _publish_kv_events(self, inst: StepInstance) -> None:
        """prefix-aware: what ``inst`` cached and evicted reaches the router's prefix index (a
        worker sends its step's events with the step's outputs)."""
        if self.is_prefix_aware:
            index, worker_id = self.registry.prefix_index, inst.worker.worker_id
            for kind, hashes in inst.kv_cache.take_events():
                index.apply(worker_id, kind, "pool", hashes)
            if inst.loader is not None:  # its node's tiers: any of the node's workers reports them
                for kind, tier, hashes in inst.loader.store.take_events():
                    index.apply(worker_id, kind, tier, hashes)

    def _sync(self, inst: StepInstance) -> None:
        """Before anything changes a fast-forwarding instance's requests (a new one joins its
        queue or batch): its stretch ends with the step in flight, as that step runs the batch
        it started with; the change applies from the next step."""
        stretch = inst.stretch
        if stretch is None:
            return
        num_steps = fastforward.steps_done_before(stretch, self.now) + 1
        if num_steps < stretch.num_steps:
            fastforward.truncate(stretch, num_steps)
            inst.epoch += 1
            self._push_step_end(inst, stretch.ends[-1])

    # -- summary -------------------------------------------------------------------------
    def summary(self) -> dict:
        """The run's settings, cost and per-role counters, for the result's ``simulator`` section."""
        return {
            "topology": self.config.topology.spec,
            "workload": self.workload.name,
            "link_bytes_per_s": self.config.link_bytes_per_s,
            "max_model_len": self.max_model_len,
            "wall_time_s": self.stats.wall_s,
            "num_events": self.stats.num_events,
            "sim_end_s": self.stats.sim_end_s,
            "roles": role_summary(self.instances, self.stats.sim_end_s),
            "service_classes": self.class_summary(),
            **({"role_switching": self.roles.summary(self.stats.sim_end_s)} if self.roles is not None else {}),
            **({"kv_tiers": self._tier_summary()} if self.stores else {}),
        }

    def _tier_summary(self) -> dict:
        """The KV tiers: per-node capacities, blocks written down, blocks loaded per tier."""
        loaded = {"host": 0, "disk": 0}
        for inst in self.instances:
            loader = getattr(inst, "loader", None)
            if loader is not None:
                for tier, n in loader.num_loaded_blocks.items():
                    loaded[tier] += n
        store = next(iter(self.stores.values()))
        return {
            "num_nodes": len(self.stores),
            "capacity_blocks": {t.name: t.capacity_blocks for t in store.tiers},
            "read_bytes_per_s": {t: c[0] for t, c in self.kv_tiers.items()},
            "num_written_blocks": sum(s.num_written for s in self.stores.values()),
            "num_loaded_blocks": loaded,
        }

    # -- handlers (the request path's) --------------------------------------------------
    def _on_arrival(self, index: int) -> None:
        raise NotImplementedError

    def _submit(self, flight: Flight, blocks: list[list[int]] | None) -> None:
        raise NotImplementedError

    def _on_step_end(self, inst: StepInstance) -> None:
        raise NotImplementedError

    def _on_transfer_done(self, flight: Flight) -> None:
        raise NotImplementedError

    def _on_encode_end(self, enc: EncodeInstance) -> None:
        raise NotImplementedError

    def _on_embed_done(self, flight: Flight, k: int) -> None:
        raise NotImplementedError

    def hand_over(self, source: StepInstance) -> None:
        raise NotImplementedError

    def _on_handed_over(self, flight: Flight, held: object, source: StepInstance, target: StepInstance) -> None:
        raise NotImplementedError
