"""The machine's raw data-movement rates: memcpy, memcpy into shared memory, a TCP stream.

These are the denominators of "theoretical transfer time": bytes / rate of the transport.
Every rate is in GB/s (1e9 bytes per second); every buffer is touched once before timing so
that page faults are not counted.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import torch

from epdserve.bench.experiments.netns import InNamespace

DEFAULT_NUM_BYTES = 64 * 2**20
NUM_REPEATS = 5
SOCKET_CHUNK_BYTES = 2**20  # one sendall / recv_into call


def _median_gbps(num_bytes: int, run_once: Callable[[], None], num_repeats: int) -> float:
    run_once()  # warm-up: faults pages in, fills caches
    seconds = []
    for _ in range(num_repeats):
        start = time.perf_counter()
        run_once()
        seconds.append(time.perf_counter() - start)
    return num_bytes / statistics.median(seconds) / 1e9


def memcpy_gbps(num_bytes: int = DEFAULT_NUM_BYTES, num_repeats: int = NUM_REPEATS) -> float:
    """One private buffer copied into another (``Tensor.copy_``), both already faulted in."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    return _median_gbps(num_bytes, lambda: dst.copy_(src), num_repeats)


def shm_memcpy_gbps(num_bytes: int = DEFAULT_NUM_BYTES, num_repeats: int = NUM_REPEATS) -> float:
    """A private buffer copied into a POSIX shared-memory mapping: what the shm KV link does."""
    segment = shared_memory.SharedMemory(create=True, size=num_bytes)
    try:
        return _copy_into_gbps(segment, num_bytes, num_repeats)
    finally:
        segment.close()  # the tensor view is gone by now: the mapping can close
        segment.unlink()


def _copy_into_gbps(segment: shared_memory.SharedMemory, num_bytes: int, num_repeats: int) -> float:
    dst = torch.frombuffer(segment.buf, dtype=torch.uint8, count=num_bytes)
    src = torch.ones(num_bytes, dtype=torch.uint8)
    return _median_gbps(num_bytes, lambda: dst.copy_(src), num_repeats)


def tcp_stream_gbps(
    num_bytes: int = DEFAULT_NUM_BYTES,
    num_repeats: int = NUM_REPEATS,
    host: str = "127.0.0.1",
    listen_ns: str | None = None,
    connect_ns: str | None = None,
) -> float:
    """One TCP connection: ``num_bytes`` sent until the receiver has read them all.

    ``listen_ns`` / ``connect_ns``: network namespaces of the receiving and sending sockets
    (None: this process's own), so the stream can cross a veth link between namespaces.
    """
    listener = _in_ns(listen_ns, lambda: socket.create_server((host, 0)))
    port = listener.getsockname()[1]
    sender = _in_ns(connect_ns, lambda: socket.create_connection((host, port), timeout=30))
    receiver, _ = listener.accept()
    listener.close()
    for sock in (sender, receiver):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = memoryview(bytearray(SOCKET_CHUNK_BYTES))
    sink = memoryview(bytearray(SOCKET_CHUNK_BYTES))

    def receive_all() -> None:
        remaining = num_bytes
        while remaining:
            n = receiver.recv_into(sink[: min(remaining, SOCKET_CHUNK_BYTES)])
            if n == 0:
                raise ConnectionError("the stream ended early")
            remaining -= n

    def send_and_wait() -> None:
        reader = threading.Thread(target=receive_all, name="bw-recv")
        reader.start()
        for start in range(0, num_bytes, SOCKET_CHUNK_BYTES):
            sender.sendall(payload[: min(SOCKET_CHUNK_BYTES, num_bytes - start)])
        reader.join()

    try:
        return _median_gbps(num_bytes, send_and_wait, num_repeats)
    finally:
        sender.close()
        receiver.close()


def _in_ns(ns: str | None, make: Callable[[], socket.socket]) -> socket.socket:
    if ns is None:
        return make()
    with InNamespace(ns):
        return make()
