"""Worker processes on this machine, each pinned to its own cores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class LocalWorker:
    worker_id: str
    role: str
    cores: tuple[int, ...]
    process: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.process.pid


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def assign_cores(num_workers: int, cores_per_worker: int) -> list[tuple[int, ...]]:
    """Consecutive cores per worker; wraps around (shares cores) when there are too few."""
    cores = available_cores()
    out = []
    for i in range(num_workers):
        start = i * cores_per_worker
        out.append(tuple(cores[(start + j) % len(cores)] for j in range(cores_per_worker)))
    return out


def spawn_worker(
    worker_id: str,
    role: str,
    router_address: str,
    cores: tuple[int, ...],
    worker_args: list[str],
    log_path: str | None = None,
) -> LocalWorker:
    """Start ``epdserve worker`` as a child that dies with this process."""
    cmd = [
        sys.executable, "-m", "epdserve.cli", "worker", "--role", role, "--router", router_address,
        "--worker-id", worker_id, "--cores", ",".join(map(str, cores)), "--die-with-parent", *worker_args,
    ]
    out = open(log_path, "ab") if log_path else None
    try:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                   stdin=subprocess.DEVNULL)
    finally:
        if out is not None:
            out.close()
    return LocalWorker(worker_id, role, cores, process)


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
