"""What the router does with each message from a worker, and whether each worker is alive.

Messages go to the part that owns them (``match`` in ``Dispatcher.handle``): registration and
heartbeats to membership (here), a request's progress to the request flow (flow.py), images'
progress to the encode stage (encode_stage.py).

Membership: a worker is READY while its heartbeats renew its lease (``heartbeat_timeout_s``)
and its step loop moves (a heartbeat says how long the current step has run; past
``step_timeout_s`` the step is hung). Missing either makes it SUSPECT: its requests fail at
once, it gets no new ones, and when its heartbeats come back it is sent a Reconcile (drop what
the router failed) and is READY again when it registers anew. A local worker whose process
exits is DEAD at once (pidfd), without waiting for the lease (workers.py draws the states).

A worker speaks only for itself: the channel admits members of the cluster (CURVE), and here
a message must come from the socket of the worker it names (its heartbeats from
``<id>/hb``), from a registered worker, and about a request the router gave that worker;
anything else is dropped (``_is_from_its_worker``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from epdserve.cluster import messages as m
from epdserve.roles import Role
from epdserve.router.channel import WorkerChannel
from epdserve.router.config import RouterConfig
from epdserve.router.flow import RequestFlow
from epdserve.router.metrics import RouterMetrics
from epdserve.router.role_switch import RoleSwitcher
from epdserve.router.workers import WorkerInfo, WorkerRegistry, WorkerState

log = logging.getLogger("epdserve.router")


class Dispatcher:
    def __init__(self, config: RouterConfig, channel: WorkerChannel, registry: WorkerRegistry,
                 metrics: RouterMetrics, flow: RequestFlow) -> None:
        self.config = config
        self.channel = channel
        self.registry = registry
        self.metrics = metrics
        self.flow = flow
        self.encode = flow.encode
        self.registered = asyncio.Event()  # set at every registration
        self._pidfds: dict[str, int] = {}
        self.switcher = RoleSwitcher(registry, channel, metrics, self._on_leave_role, self.mark_dead,
                                     flow.handover.hand_over_all)

    def handle(self, sender: str, msg: m.Message) -> None:
        if not self._is_from_its_worker(sender, msg):
            return
        flow, encode = self.flow, self.encode
        match msg:
            case m.Heartbeat():
                self._on_heartbeat(msg)
            case m.Register():
                self._on_register(msg)
            case m.Outputs():
                if msg.kv_events:
                    self.registry.apply_kv_events(msg.worker_id, msg.kv_events)
                flow.on_outputs(msg)
            case m.KVEvents():
                self.registry.apply_kv_events(msg.worker_id, msg.events)
            case m.Reserved():
                flow.on_reserved(msg)
            case m.TransferDone():
                flow.on_transfer_done(msg, sender)
            case m.Paused():
                flow.handover.on_paused(sender, msg)
            case m.Retargeted():
                flow.handover.on_retargeted(sender, msg)
            case m.ReservationExpired():
                flow.on_reservation_expired(sender, msg)
            case m.RequestFailed():
                flow.on_request_failed(msg)
            case m.EncodeDone():
                encode.on_encode_done(sender, msg)
            case m.EmbeddingLanded():
                encode.on_embedding_landed(msg)
            case _:
                log.warning("dropping %s from %s: not a message a worker sends", type(msg).__name__, sender)
        if self.switcher.switching:
            self.switcher.poll()  # a draining worker may hold nothing now

    def _is_from_its_worker(self, sender: str, msg: m.Message) -> bool:
        """Whether ``sender`` (the socket's identity) may send ``msg``."""
        worker_id = sender.removesuffix("/hb") if isinstance(msg, m.Heartbeat) else sender
        claimed = getattr(msg, "worker_id", None)
        if claimed is not None and claimed != worker_id:
            log.warning("dropping %s from %s: it speaks for worker %r", type(msg).__name__, sender, claimed)
            return False
        if isinstance(msg, m.Register):
            return True
        worker = self.registry.get(worker_id)
        if worker is None:
            log.warning("dropping %s from %s: not a registered worker", type(msg).__name__, sender)
            return False
        request_id = getattr(msg, "request_id", None)
        path = self.flow.paths.get(request_id) if request_id is not None else None
        if path is None:
            return True  # a request the router no longer tracks: its handler ignores it
        if isinstance(msg, m.EncodeDone):  # the encode stage matches it to its job
            allowed = worker.role == Role.ENCODE
        elif isinstance(msg, m.EmbeddingLanded):
            allowed = path.mm is not None and path.mm.consumer == worker_id
        else:
            allowed = worker_id in path.workers
        if not allowed:
            log.warning("dropping %s of %s from %s: not a worker of that request", type(msg).__name__,
                        request_id, sender)
        return allowed

    # -- membership ----------------------------------------------------------------------
    def _on_register(self, msg: m.Register) -> None:
        old = self.registry.get(msg.worker_id)
        info = WorkerInfo(msg)
        if msg.load is not None:
            info.load = msg.load
        if old is not None and old.is_serving:
            self.mark_dead(msg.worker_id, "worker re-registered")
        elif old is not None and old.state is WorkerState.SUSPECT:
            log.info("worker %s is back and reconciled", msg.worker_id)
        elif not self.switcher.on_register(old, info) and old is not None:
            info.num_switches = old.num_switches
        self.registry.add(info)
        self.flow.handover.forget(msg.worker_id)
        self.encode.on_register(msg)
        self.metrics.worker_up.labels(msg.worker_id, msg.role).set(1)
        if msg.role == Role.DECODE and msg.kv_endpoint is not None:
            for prefill in self.registry.ready(Role.PREFILL):
                self.channel.post(prefill.worker_id, m.PeerUp(msg.worker_id, msg.kv_endpoint))
        if msg.role == Role.PREFILL:
            for decode in self.registry.ready(Role.DECODE):
                if decode.endpoint is not None:
                    self.channel.post(msg.worker_id, m.PeerUp(decode.worker_id, decode.endpoint))
        log.info("worker %s (%s, pid %d) registered", msg.worker_id, msg.role, msg.pid)
        self.registered.set()

    def _on_heartbeat(self, msg: m.Heartbeat) -> None:
        worker = self.registry.get(msg.worker_id)
        if worker is None or worker.state in (WorkerState.DEAD, WorkerState.SWITCHING):
            return  # (a switching worker's last beats of its old role)
        now = time.monotonic()
        worker.last_seen = now
        is_hung = msg.step_age_s > self.config.step_timeout_s
        if worker.state is WorkerState.SUSPECT:
            # Its heartbeats are back: once its loop moves again, it drops what the router
            # failed meanwhile and registers again (then it is READY).
            if not is_hung and now - worker.last_reconcile >= self.config.heartbeat_timeout_s:
                worker.last_reconcile = now
                self.channel.post(worker.worker_id, m.Reconcile([]))
            return
        if is_hung:
            self.suspect(worker.worker_id, f"its step has been running for {msg.step_age_s:.1f} s "
                                           f"(step timeout {self.config.step_timeout_s:g} s)")
            return
        worker.load = msg.load
        worker.num_submitted = 0
        load = msg.load
        self.metrics.observe_load(worker.worker_id, worker.role, load.num_running, load.num_waiting,
                                  load.num_used_blocks, load.num_free_blocks)

    async def liveness_loop(self) -> None:
        period = self.config.heartbeat_timeout_s / 4
        while True:
            await asyncio.sleep(period)
            deadline = time.monotonic() - self.config.heartbeat_timeout_s
            for worker in list(self.registry.workers.values()):
                if worker.is_serving and worker.last_seen < deadline:
                    self.suspect(worker.worker_id, "worker missed its heartbeat lease "
                                                   f"({self.config.heartbeat_timeout_s:g} s)")
            self.switcher.poll()  # requests aborted by their clients leave a draining worker too

    def suspect(self, worker_id: str, reason: str) -> None:
        """READY -> SUSPECT: the worker may still be alive (paused, hung); it gets no more
        requests, those in hand fail now, and it serves again after it reconciles."""
        self._give_up(worker_id, WorkerState.SUSPECT, reason)

    def mark_dead(self, worker_id: str, reason: str) -> None:
        """The worker's process exited (or another registered under its id)."""
        self._give_up(worker_id, WorkerState.DEAD, reason)

    def _give_up(self, worker_id: str, state: WorkerState, reason: str) -> None:
        worker = self.registry.get(worker_id)
        if worker is None or worker.state is WorkerState.DEAD:
            return
        was_serving = worker.is_serving
        was_switching = worker.state is WorkerState.SWITCHING
        worker.state = state
        if was_switching:  # it held nothing, and its peers and slab were let go at the switch
            self.metrics.worker_up.labels(worker_id, str(worker.switch_to)).set(0)
            log.warning("worker %s (switching to %s) is %s: %s", worker_id, worker.switch_to, state.value, reason)
            return
        if not was_serving:  # SUSPECT -> DEAD: its requests failed already
            if state is WorkerState.DEAD:
                self.encode.on_worker_gone(worker)
            return
        worker.last_reconcile = 0.0
        self.metrics.worker_up.labels(worker_id, worker.role).set(0)
        log.warning("worker %s (%s) is %s: %s", worker_id, worker.role, state.value, reason)
        if worker.role == Role.DECODE:
            self._peer_down(worker_id)
        self.flow.on_worker_lost(worker, reason)
        self.encode.on_worker_dead(worker)

    def _peer_down(self, worker_id: str) -> None:
        """Prefill workers close their links to decode worker ``worker_id``."""
        for prefill in self.registry.workers.values():
            if prefill.role == Role.PREFILL and prefill.is_serving:
                self.channel.post(prefill.worker_id, m.PeerDown(worker_id))

    def _on_leave_role(self, worker: WorkerInfo) -> None:
        """A drained worker is switching role: what its old role offered its peers goes now
        (a decode worker's pages, a consumer's slab), before its process frees them."""
        if worker.role == Role.DECODE:
            self._peer_down(worker.worker_id)
        self.encode.on_worker_dead(worker)

    # -- local processes -----------------------------------------------------------------
    def watch_process(self, worker_id: str, pid: int) -> None:
        """Local worker: learn of its exit at once (pidfd), not only by missed heartbeats."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        self._pidfds[worker_id] = fd
        asyncio.get_running_loop().add_reader(fd, self._on_process_exit, worker_id)

    def _on_process_exit(self, worker_id: str) -> None:
        fd = self._pidfds.pop(worker_id, None)
        if fd is not None:
            _unwatch_fd(fd)
        self.mark_dead(worker_id, "worker process exited")

    def close(self) -> None:
        for fd in self._pidfds.values():
            _unwatch_fd(fd)
        self._pidfds.clear()


def _unwatch_fd(fd: int) -> None:
    try:
        asyncio.get_running_loop().remove_reader(fd)
    except RuntimeError:
        pass
    os.close(fd)
