"""What every worker process shares, whatever its role: the link to the router and the loop.

A worker registers with the router (``Register``), sends heartbeats with its load from a
thread of its own (router_link.py), and runs one loop: wait for control messages (or for a
file descriptor a helper thread signals), handle each, then do one pass of its own work. The
role classes (worker_llm.py, worker_prefill.py, worker_decode.py, encode_worker.py) say what
that work is, which messages they take and what they hold for the router's requests.

A handler that raises costs only the message's request (``_fail_message``); a fatal error
(``failures.is_fatal``) ends the process with ``EXIT_FATAL`` so its launcher restarts it.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from functools import cached_property
from typing import Any

import torch
import zmq

from epdserve.cluster import messages as m
from epdserve.cluster.router_link import (
    MalformedFrame,
    StepProgress,
    connect_to_router,
    recv_message,
    start_heartbeats,
)
from epdserve.engine.failures import EXIT_FATAL, is_fatal
from epdserve.gc_heap import freeze_startup_heap
from epdserve.roles import Role
from epdserve.transfer.locality import this_node

log = logging.getLogger("epdserve.worker")

Handler = Callable[[Any], None]


class WorkerBase:
    """One worker process's link to the router and its loop; subclasses add their role."""

    role: Role

    def __init__(self, router: str, worker_id: str, key: bytes, cores: tuple[int, ...] = (),
                 heartbeat_s: float = 0.2) -> None:
        """``key``: the cluster secret (epdserve/auth.py) this worker proves to the router and
        its peers; ``cores``: CPU cores to pin the process (and torch's threads) to; () leaves
        it as is."""
        if cores:
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
        self.router = router
        self.worker_id = worker_id
        self.key = key
        self.heartbeat_s = heartbeat_s
        self.progress = StepProgress()
        self._stop = threading.Event()
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        # A ``SwitchRole`` asked for this role: the loop ends once the worker holds nothing, and
        # the process goes on as a worker of it (``run_process``).
        self.next_role: Role | None = None

    # -- what a role says ----------------------------------------------------------------
    def register(self) -> m.Register:
        raise NotImplementedError

    def load(self) -> m.Load:
        """The load report of the next heartbeat (called from the heartbeat thread)."""
        raise NotImplementedError

    def _handlers(self) -> dict[type, Handler]:
        """Message type -> handler; a subclass extends its parent's table. Other types are
        ignored."""
        return {m.Shutdown: lambda msg: self._stop.set(), m.Reconcile: self._on_reconcile,
                m.SwitchRole: self._on_switch_role}

    def _poll_timeout_ms(self) -> int:
        """How long the loop may wait for a message before its next pass."""
        return 100

    def _wake_fds(self) -> Iterable[int]:
        """File descriptors that wake the loop besides the router socket."""
        return ()

    def _on_wake(self, ready: dict) -> None:
        """After each poll, with what it found ready (``_wake_fds`` included)."""

    def _step(self) -> None:
        """One pass of the role's own work, after the messages that had arrived."""

    def _fail_message(self, msg: m.Message | MalformedFrame, exc: Exception) -> None:
        """Handling ``msg`` raised ``exc`` (not fatal)."""
        log.error("handling %s failed", type(msg).__name__, exc_info=exc)

    def _forget_all_but(self, keep: set[str]) -> None:
        """Drop what this worker holds for requests not in ``keep`` (see ``_on_reconcile``)."""

    def _release(self) -> None:
        """Free the role's resources (``close``, before the router sockets close)."""

    def _can_switch_to(self, role: Role) -> bool:
        """Whether this worker can go on as a worker of ``role`` (``SwitchRole``)."""
        return False

    def _holds_nothing(self) -> bool:
        """No request, reservation or transfer is in hand (a switch of role may go ahead)."""
        return True

    # -- shared ---------------------------------------------------------------------------
    def _register(self, **fields: Any) -> m.Register:
        return m.Register(worker_id=self.worker_id, role=self.role, pid=os.getpid(), host=socket.gethostname(),
                          node=this_node(), load=self.load(), **fields)

    def _send(self, msg: m.Msg) -> None:
        """To the router; a router that stopped reading costs this message, never the loop
        (the router's own deadlines settle what it was about)."""
        try:
            self.sock.send(m.encode(msg))
        except zmq.Again:
            log.warning("router is not reading: dropped %s", type(msg).__name__)

    @cached_property
    def _dispatch(self) -> dict[type, Handler]:
        return self._handlers()

    def _handle(self, msg: m.Message | MalformedFrame) -> None:
        handler = self._dispatch.get(type(msg))
        if handler is None:
            return
        try:
            handler(msg)
        except Exception as e:
            if is_fatal(e):
                raise
            self._fail_message(msg, e)

    def _on_switch_role(self, msg: m.SwitchRole) -> None:
        """The router drained this worker and moves it to ``msg.role``: once it holds nothing
        (the router sent nothing new since it began draining), the loop ends and the process
        registers again in the new role."""
        if msg.role == self.role or not self._can_switch_to(msg.role):
            log.warning("a %s worker cannot switch to %s: ignored", self.role, msg.role)
            return
        log.info("switching from %s to %s", self.role, msg.role)
        self.next_role = msg.role

    def _on_reconcile(self, msg: m.Reconcile) -> None:
        """The router had given this worker up (missed lease, hung step) and failed its
        requests: drop every request it no longer knows here, then register again."""
        self._forget_all_but(set(msg.request_ids))
        self._send(self.register())

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> int:
        """Register, beat, and loop until ``Shutdown`` (0) or a fatal error (``EXIT_FATAL``)."""
        self.ctx = zmq.Context()
        try:
            self.sock = connect_to_router(self.ctx, self.router, self.worker_id, self.key)
            freeze_startup_heap()  # the model, tokenizer and libraries: never garbage (epdserve/gc_heap.py)
            self._send(self.register())
            start_heartbeats(self.ctx, self.router, self.worker_id, self.key, self.load, self.heartbeat_s,
                             self._stop, self.progress)
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            for fd in self._wake_fds():
                poller.register(fd, zmq.POLLIN)
            while not self._stop.is_set():
                timeout_ms = self._poll_timeout_ms()
                self.progress.end()
                if self._receive(poller, timeout_ms):
                    return 0
                self._step()
                if self.next_role is not None and self._holds_nothing():
                    return 0
        except Exception as e:
            if not is_fatal(e):
                raise
            # The process's memory or device can no longer be trusted: stop (the launcher
            # restarts the worker; the router fails its requests when the process exits).
            log.critical("fatal error, the %s worker exits with status %d", self.role, EXIT_FATAL, exc_info=True)
            return EXIT_FATAL
        finally:
            self.close()
        return 0

    def _receive(self, poller: zmq.Poller, timeout_ms: int) -> bool:
        """Wait up to ``timeout_ms`` for a message, then handle it and every one queued behind
        it; True once a ``Shutdown`` stopped the worker."""
        while True:
            ready = dict(poller.poll(timeout_ms))
            self._on_wake(ready)
            if self.sock not in ready:
                return False
            self.progress.begin()
            msg = recv_message(self.sock)
            if msg is not None:
                self._handle(msg)
            timeout_ms = 0
            if self._stop.is_set():
                return True

    def close(self) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        self._stop.set()
        self._release()
        if self.sock is not None:
            self.sock.close()
        if self.ctx is not None:
            self.ctx.term()


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent (the router) dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_process(make_worker: Callable[[], WorkerBase], die_with_parent: bool = False,
                successor: Callable[[WorkerBase], Callable[[], WorkerBase]] | None = None) -> int:
    """The body of a worker process: build the worker, run it; SIGTERM and SIGINT end the
    loop (``close`` still frees what it holds, shared memory included). A worker whose loop
    ended for a ``SwitchRole`` is followed, in this process, by the worker that
    ``successor(worker)()`` builds in its new role (``successor`` keeps what it reuses, the
    loaded model, and nothing else: the old role's memory is gone before the new one's is
    taken)."""
    if die_with_parent:
        _die_with_parent()
    signal.signal(signal.SIGTERM, _interrupt)
    worker: WorkerBase | None = make_worker()
    try:
        while True:
            status = worker.run()
            if status != 0 or worker.next_role is None or successor is None:
                return status
            make_next = successor(worker)
            worker = None
            gc.collect()  # the old role's KV pages and buffers (reference cycles included)
            signal.signal(signal.SIGTERM, _interrupt)  # ``close`` ignored it for its clean-up
            worker = make_next()
    except KeyboardInterrupt:
        return 0
