"""``handoff-paths``: ways to hand a bf16 tensor (an image embedding) to another process.

Sender (this process) and receiver (a spawned process) share one TCP loopback connection.
Each transfer is timed end to end: from the sender starting with the tensor in its own
memory until the receiver holds a usable tensor with the same contents.

    path                      sender                               crosses the socket    receiver
    pickle_socket             pickle.dumps                         the pickled bytes      pickle.loads
    fresh_shm                 new segment, copy in                 segment name, shape    map it, view
    prealloc_shm_memcpy       copy into a segment mapped at start  shape                  copy out
    registered_slab           copy into the slab at an offset      offset, shape          view (no copy)
    registered_slab_in_place  (output already in the slab)         offset, shape          view (no copy)

``memcpy`` is the floor: the same bytes copied once inside one process (two destinations used in
turn, like the slab's two slots).
"""

from __future__ import annotations

import os
import pickle
import selectors
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path

import torch

from epdserve.bench import BenchError
from epdserve.bench.experiments.handoff_peer import (
    DTYPE,
    fingerprint,
    recv_message,
    send_message,
    view_of,
)
from epdserve.bench.experiments.handoff_report import NAME, build_report, write_plot
from epdserve.bench.experiments.report import begin, write_outputs

# (label, shape): 2664 image tokens x 7168 (a 1080p image, d=7168) and 1026 x 4096 (1024^2, d=4096).
SHAPES = (("37 MB", (2664, 7168)), ("8.4 MB", (1026, 4096)))
QUICK_SHAPES = (("1.5 MB", (192, 4096)), ("0.5 MB", (64, 4096)))
PATHS = ("pickle_socket", "fresh_shm", "prealloc_shm_memcpy", "registered_slab", "registered_slab_in_place")
NUM_REPEATS = 30
QUICK_NUM_REPEATS = 3
NUM_WARMUP = 2
ACCEPT_TIMEOUT_S = 120.0  # the receiver imports torch before it connects
SLAB_ALIGN_BYTES = 4096
PEER_EXIT_TIMEOUT_S = 10.0


def _nbytes(shape: tuple[int, int]) -> int:
    return shape[0] * shape[1] * torch.tensor([], dtype=DTYPE).element_size()


class Sender:
    """The sending end: the receiver process, the socket, and the segments mapped at start-up."""

    def __init__(self, max_bytes: int) -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        cmd = [sys.executable, "-m", "epdserve.bench.experiments.handoff_peer", "--port", str(port)]
        self.process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        try:
            self.sock = _accept_from(listener, self.process)
        except BaseException:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            listener.close()
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.slot_bytes = -(-max_bytes // SLAB_ALIGN_BYTES) * SLAB_ALIGN_BYTES
        self.prealloc = shared_memory.SharedMemory(create=True, size=self.slot_bytes)
        self.slab = shared_memory.SharedMemory(create=True, size=2 * self.slot_bytes)  # two slots
        for segment in (self.prealloc, self.slab):
            torch.frombuffer(segment.buf, dtype=torch.uint8).zero_()  # fault pages in once, at start-up
        send_message(self.sock, ["hello", self.prealloc.name, self.slab.name])
        if recv_message(self.sock) != ["ready"]:
            raise BenchError("the receiver process did not map the segments")
        self.num_transfers = 0

    def transfer(self, path: str, tensor: torch.Tensor) -> float:
        """Hand ``tensor`` over by ``path``; milliseconds until the receiver could use it."""
        shape = list(tensor.shape)
        offset = (self.num_transfers % 2) * self.slot_bytes  # alternate slots, as a ring would
        self.num_transfers += 1
        fresh: shared_memory.SharedMemory | None = None
        if path == "registered_slab_in_place":
            view_of(self.slab, offset, shape).copy_(tensor)  # the producer wrote its output here
        start = time.perf_counter()
        if path == "pickle_socket":
            payload = pickle.dumps(tensor, protocol=pickle.HIGHEST_PROTOCOL)
            send_message(self.sock, ["pickle", len(payload)], payload)
        elif path == "fresh_shm":
            fresh = shared_memory.SharedMemory(create=True, size=tensor.numel() * tensor.element_size())
            view_of(fresh, 0, shape).copy_(tensor)
            send_message(self.sock, ["fresh", fresh.name, shape])
        elif path == "prealloc_shm_memcpy":
            view_of(self.prealloc, 0, shape).copy_(tensor)
            send_message(self.sock, ["prealloc", shape])
        elif path == "registered_slab":
            view_of(self.slab, offset, shape).copy_(tensor)
            send_message(self.sock, ["slab", offset, shape])
        elif path == "registered_slab_in_place":
            send_message(self.sock, ["slab", offset, shape])
        else:
            raise ValueError(f"unknown path {path!r}")
        t_usable, received_fingerprint = recv_message(self.sock)
        if fresh is not None:
            fresh.close()
            fresh.unlink()
        if received_fingerprint != fingerprint(tensor):
            raise BenchError(f"{path}: the receiver's tensor differs from the one sent")
        return (t_usable - start) * 1e3

    def close(self) -> None:
        try:
            send_message(self.sock, ["quit"])
        except OSError:
            pass
        try:
            self.process.wait(PEER_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.sock.close()
        for segment in (self.prealloc, self.slab):
            segment.close()
            segment.unlink()


def _accept_from(listener: socket.socket, process: subprocess.Popen) -> socket.socket:
    """The receiver's connection; fails at once if the receiver exits instead of connecting."""
    pidfd = os.pidfd_open(process.pid)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(listener, selectors.EVENT_READ, "connected")
            selector.register(pidfd, selectors.EVENT_READ, "exited")
            events = selector.select(timeout=ACCEPT_TIMEOUT_S)
    finally:
        os.close(pidfd)
    if not events:
        raise BenchError(f"the receiver process did not connect within {ACCEPT_TIMEOUT_S:g} s")
    if any(key.data == "exited" for key, _ in events):
        raise BenchError(f"the receiver process exited with code {process.wait()} before connecting")
    return listener.accept()[0]


def _time_ms(run_once: Callable[[], float], num_repeats: int) -> list[float]:
    for _ in range(NUM_WARMUP):
        run_once()
    return [run_once() for _ in range(num_repeats)]


class _Memcpy:
    """The floor: one copy of the same bytes inside this process, into two destinations used
    in turn (as the slab's two slots are), each faulted in before timing."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.destinations = [torch.empty_like(tensor), torch.empty_like(tensor)]
        for destination in self.destinations:
            destination.copy_(tensor)
        self.num_copies = 0

    def __call__(self) -> float:
        destination = self.destinations[self.num_copies % 2]
        self.num_copies += 1
        start = time.perf_counter()
        destination.copy_(self.tensor)
        return (time.perf_counter() - start) * 1e3


def _row(path: str, label: str, num_bytes: int, samples_ms: list[float], memcpy_ms: float) -> dict:
    ms = statistics.median(samples_ms)
    return {
        "path": path, "size": label, "bytes": num_bytes, "ms": ms,
        "ms_min": min(samples_ms), "ms_max": max(samples_ms), "num_repeats": len(samples_ms),
        "gbps": num_bytes / (ms * 1e-3) / 1e9, "vs_memcpy": ms / memcpy_ms,
    }


def measure(shapes: tuple, num_repeats: int) -> list[dict]:
    """One row per (path, size), memcpy first; medians over ``num_repeats`` transfers.

    Copies run on one thread on both ends: a copy is memory-bound, and a second intra-op
    thread only adds a barrier that stalls whenever another process holds the other core.
    """
    torch.manual_seed(0)
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sender = Sender(max(_nbytes(shape) for _, shape in shapes))
    rows: list[dict] = []
    try:
        for label, shape in shapes:
            tensor = torch.randn(shape).to(DTYPE)
            num_bytes = tensor.numel() * tensor.element_size()
            memcpy = _time_ms(_Memcpy(tensor), num_repeats)
            memcpy_ms = statistics.median(memcpy)
            rows.append(_row("memcpy", label, num_bytes, memcpy, memcpy_ms))
            for path in PATHS:
                samples = _time_ms(lambda p=path, t=tensor: sender.transfer(p, t), num_repeats)
                rows.append(_row(path, label, num_bytes, samples, memcpy_ms))
    finally:
        sender.close()
        torch.set_num_threads(num_threads)
    return rows


def run(out_dir: Path, quick: bool) -> str:
    """Measure, then write results.json (a list of rows), report.md and handoff_paths.png."""
    experiment = begin(NAME, out_dir, quick)
    rows = measure(QUICK_SHAPES if quick else SHAPES, QUICK_NUM_REPEATS if quick else NUM_REPEATS)
    plot = write_plot(rows, out_dir)
    report = build_report(rows, experiment, plot.name)
    write_outputs(out_dir, rows, report)
    return report
