"""Worker processes on this machine, each pinned to its own cores, restarted when they die."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from epdserve.engine.failures import EXIT_FATAL
from epdserve.envs import EPDSERVE_CLUSTER_KEY
from epdserve.errors import ConfigError
from epdserve.transfer.segments import unlink_segments_of

log = logging.getLogger("epdserve.local")


@dataclass(frozen=True)
class WorkerLaunch:
    """How a local worker is started: enough to start it again under the same id."""

    worker_id: str
    role: str
    router_address: str
    cores: tuple[int, ...]
    worker_args: tuple[str, ...]
    log_path: str | None = None
    cluster_key: bytes = field(default=b"", repr=False)  # handed over in the environment, never argv


@dataclass
class LocalWorker:
    worker_id: str
    role: str
    cores: tuple[int, ...]
    process: subprocess.Popen
    launch: WorkerLaunch

    @property
    def pid(self) -> int:
        return self.process.pid


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def assign_cores(num_workers: int, cores_per_worker: int) -> list[tuple[int, ...]]:
    """Consecutive cores per worker; wraps around (shares cores) when there are too few."""
    return core_sets(num_workers, cores_per_worker, available_cores())


def core_sets(num_workers: int, cores_per_worker: int, cores: Sequence[int]) -> list[tuple[int, ...]]:
    """``assign_cores`` on a given list of cores (the simulator places its instances so)."""
    return [tuple(cores[(i * cores_per_worker + j) % len(cores)] for j in range(cores_per_worker))
            for i in range(num_workers)]


def spawn_worker(
    worker_id: str,
    role: str,
    router_address: str,
    cores: tuple[int, ...],
    worker_args: list[str],
    log_path: str | None = None,
    cluster_key: bytes = b"",
) -> LocalWorker:
    """Start ``epdserve worker`` as a child that dies with this process."""
    return start_worker(WorkerLaunch(worker_id, role, router_address, cores, tuple(worker_args), log_path,
                                     cluster_key))


def start_worker(launch: WorkerLaunch) -> LocalWorker:
    cmd = [
        sys.executable, "-m", "epdserve.cli", "worker", "--role", launch.role,
        "--router", launch.router_address, "--worker-id", launch.worker_id,
        "--cores", ",".join(map(str, launch.cores)), "--die-with-parent", *launch.worker_args,
    ]
    out = open(launch.log_path, "ab") if launch.log_path else None
    try:
        env = {**os.environ, EPDSERVE_CLUSTER_KEY: launch.cluster_key.hex()} if launch.cluster_key else None
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                   stdin=subprocess.DEVNULL, env=env)
    finally:
        if out is not None:
            out.close()
    return LocalWorker(launch.worker_id, launch.role, launch.cores, process, launch)


def stop_workers(workers: list[LocalWorker], timeout_s: float = 10.0) -> None:
    for w in workers:
        if w.process.poll() is None:
            w.process.send_signal(signal.SIGTERM)
    for w in workers:
        try:
            w.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            w.process.kill()
            w.process.wait()
        unlink_segments_of(w.pid)  # reaped: what a killed worker could not close


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode == EXIT_FATAL:
        return f"exit status {returncode} (fatal error)"
    return f"exit status {returncode}"


@dataclass(frozen=True)
class RestartPolicy:
    """Per worker: the first restart waits ``initial_backoff_s``, each next one twice as long
    up to ``max_backoff_s``; a worker that stayed up ``stable_s`` starts over at
    ``initial_backoff_s``. At most ``max_restarts`` restarts in any ``window_s`` (0: never
    restart); past that the worker stays down. Seconds throughout."""

    max_restarts: int = 5
    window_s: float = 600.0
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"--max-worker-restarts must not be negative, got {self.max_restarts}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s or self.window_s <= 0 or self.stable_s <= 0:
            raise ConfigError("restart back-off, window and stable time must be positive (initial <= max)")


@dataclass
class _RestartState:
    started_at: float  # time.monotonic() of the current process's start
    backoff_s: float  # the wait before the next restart
    restarted_at: deque[float] = field(default_factory=deque)  # monotonic, within the window


class WorkerSupervisor:
    """Restarts local workers that die while the server runs (``RestartPolicy``); a worker
    that exits with status 0 was asked to stop and stays down.

    An exit is learned the moment it happens, through a pidfd on the event loop. A restarted
    worker has the same id and arguments, so it registers with the router again under its id;
    ``on_start(worker)`` is called with each new process. Everything runs on the event loop's
    thread, so after ``close`` no restart can happen.
    """

    def __init__(self, policy: RestartPolicy, on_start: Callable[[LocalWorker], None]) -> None:
        self.policy = policy
        self._on_start = on_start
        self._workers: dict[str, LocalWorker] = {}
        self._states: dict[str, _RestartState] = {}
        self._pidfds: dict[str, int] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._is_watching = False
        self._is_closed = False

    @property
    def workers(self) -> list[LocalWorker]:
        """The current process of every worker (what to stop at shutdown)."""
        return list(self._workers.values())

    def add(self, worker: LocalWorker) -> None:
        self._workers[worker.worker_id] = worker
        self._states[worker.worker_id] = _RestartState(time.monotonic(), self.policy.initial_backoff_s)
        if self._is_watching:
            self._watch(worker)

    def start(self) -> None:
        """Watch every worker from now on (call on the event loop, once start-up is over:
        a worker that cannot start is not restarted in a loop)."""
        self._is_watching = True
        for worker in self._workers.values():
            self._watch(worker)

    def close(self) -> None:
        """Stop watching and cancel pending restarts; the processes keep running (stop_workers)."""
        self._is_closed = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for worker_id in list(self._pidfds):
            self._unwatch(worker_id)

    def _watch(self, worker: LocalWorker) -> None:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(worker.pid)
        except ProcessLookupError:  # already gone (and reaped)
            loop.call_soon(self._on_exit, worker.worker_id)
            return
        except (AttributeError, OSError) as e:
            log.warning("cannot watch worker %s (pid %d): %s; it is not restarted",
                        worker.worker_id, worker.pid, e)
            return
        self._pidfds[worker.worker_id] = fd
        loop.add_reader(fd, self._on_exit, worker.worker_id)

    def _unwatch(self, worker_id: str) -> None:
        fd = self._pidfds.pop(worker_id, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    def _on_exit(self, worker_id: str) -> None:
        self._unwatch(worker_id)
        if self._is_closed:
            return
        worker = self._workers[worker_id]
        returncode = worker.process.wait()  # it has exited: this reaps it at once
        self._release_shared_memory(worker)
        if returncode == 0:  # asked to stop (SIGTERM, SIGINT, Shutdown), e.g. Ctrl-C to the group
            log.warning("worker %s (pid %d) stopped cleanly; not restarted", worker_id, worker.pid)
            return
        how = describe_exit(returncode)
        delay = self._next_delay(self._states[worker_id], time.monotonic())
        if delay is None:
            log.error("worker %s (pid %d) stopped: %s; not restarted (%d restarts allowed in %g s)",
                      worker_id, worker.pid, how, self.policy.max_restarts, self.policy.window_s)
            return
        log.warning("worker %s (pid %d) stopped: %s; restarting it in %g s",
                    worker_id, worker.pid, how, delay)
        self._timers[worker_id] = asyncio.get_running_loop().call_later(delay, self._restart, worker_id)

    @staticmethod
    def _release_shared_memory(worker: LocalWorker) -> None:
        """A worker that died without closing (killed) leaves its KV pool, fence and slab
        segments behind; it has been reaped, so its pid names only its own."""
        removed = unlink_segments_of(worker.pid)
        if removed:
            log.warning("worker %s (pid %d) left %d shared-memory segments: unlinked", worker.worker_id,
                        worker.pid, len(removed))

    def _next_delay(self, state: _RestartState, now: float) -> float | None:
        """The back-off before restarting (and count the restart), or None: restart no more."""
        policy = self.policy
        if now - state.started_at >= policy.stable_s:
            state.backoff_s = policy.initial_backoff_s
        while state.restarted_at and state.restarted_at[0] <= now - policy.window_s:
            state.restarted_at.popleft()
        if len(state.restarted_at) >= policy.max_restarts:
            return None
        state.restarted_at.append(now)
        delay = state.backoff_s
        state.backoff_s = min(2 * state.backoff_s, policy.max_backoff_s)
        return delay

    def _restart(self, worker_id: str) -> None:
        self._timers.pop(worker_id, None)
        if self._is_closed:
            return
        old = self._workers[worker_id]
        try:
            worker = start_worker(old.launch)
        except OSError as e:
            log.error("cannot restart worker %s: %s", worker_id, e)
            return
        self._workers[worker_id] = worker
        self._states[worker_id].started_at = time.monotonic()
        self._watch(worker)
        self._on_start(worker)
        log.warning("restarted worker %s: pid %d (was %d)", worker_id, worker.pid, old.pid)
