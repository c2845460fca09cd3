"""The receiving process of the hand-off experiment, and the wire format both ends speak.

Every message on the socket is ``| u32 length | msgpack list | payload bytes (pickle only) |``.
The sender's messages (``kind`` first):

    ["hello", prealloc_name, slab_name]      once: map both segments, keep the mappings
    ["pickle", num_payload_bytes]            a pickled tensor follows
    ["fresh", segment_name, shape]           a new segment holds the tensor
    ["prealloc", shape]                      the preallocated segment holds it: copy it out
    ["slab", byte_offset, shape]             the slab holds it at the offset: view it
    ["quit"]

The receiver answers each transfer with ``[t_usable, fingerprint]``: ``time.perf_counter()``
(seconds, CLOCK_MONOTONIC, the same clock in every process) at the moment it holds a usable
tensor, then a checksum of that tensor taken after the clock was read.
"""

from __future__ import annotations

import argparse
import pickle
import socket
import struct
import time
from multiprocessing import resource_tracker, shared_memory

import msgspec
import torch

_LENGTH = struct.Struct("!I")
DTYPE = torch.bfloat16
NUM_FINGERPRINT_ELEMENTS = 4096


def send_message(sock: socket.socket, message: list, payload: bytes | None = None) -> None:
    """One framed message, with the pickle payload (if any) right behind it."""
    header = msgspec.msgpack.encode(message)
    sock.sendall(_LENGTH.pack(len(header)) + header)
    if payload is not None:
        sock.sendall(payload)


def recv_exact(sock: socket.socket, num_bytes: int) -> bytearray:
    """Exactly ``num_bytes`` from the socket; raises ConnectionError if it closes first."""
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]
    return buffer


def recv_message(sock: socket.socket) -> list:
    (length,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    return msgspec.msgpack.decode(recv_exact(sock, length))


def fingerprint(tensor: torch.Tensor) -> float:
    """A checksum of evenly spaced elements: equal on both ends when the bytes arrived."""
    flat = tensor.reshape(-1)
    step = max(1, flat.numel() // NUM_FINGERPRINT_ELEMENTS)
    return float(flat[::step].float().sum())


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Map a segment another process owns; that process, not this one, unlinks it."""
    segment = shared_memory.SharedMemory(name=name, create=False)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def view_of(segment: shared_memory.SharedMemory, byte_offset: int, shape: list[int]) -> torch.Tensor:
    """A tensor over ``segment`` at ``byte_offset``: no copy."""
    numel = 1
    for size in shape:
        numel *= size
    return torch.frombuffer(segment.buf, dtype=DTYPE, count=numel, offset=byte_offset).view(shape)


def _receive_one(sock: socket.socket, message: list, segments: dict[str, shared_memory.SharedMemory]) -> None:
    kind = message[0]
    fresh: shared_memory.SharedMemory | None = None
    if kind == "pickle":
        tensor = pickle.loads(recv_exact(sock, message[1]))
    elif kind == "fresh":
        fresh = attach_segment(message[1])
        tensor = view_of(fresh, 0, message[2])
    elif kind == "prealloc":
        tensor = view_of(segments["prealloc"], 0, message[1]).clone()
    elif kind == "slab":
        tensor = view_of(segments["slab"], message[1], message[2])
    else:
        raise ValueError(f"unknown message {kind!r}")
    t_usable = time.perf_counter()
    send_message(sock, [t_usable, fingerprint(tensor)])
    del tensor
    if fresh is not None:
        fresh.close()


def receiver_main(port: int) -> None:
    """Entry point of the receiving process: connect to the sender and serve until "quit"."""
    torch.set_num_threads(1)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    segments: dict[str, shared_memory.SharedMemory] = {}
    try:
        while True:
            message = recv_message(sock)
            if message[0] == "quit":
                return
            if message[0] == "hello":
                segments = {"prealloc": attach_segment(message[1]), "slab": attach_segment(message[2])}
                for segment in segments.values():
                    torch.frombuffer(segment.buf, dtype=torch.uint8).sum()  # fault the mapping in once
                send_message(sock, ["ready"])
                continue
            _receive_one(sock, message, segments)
    finally:
        sock.close()
        for segment in segments.values():
            segment.close()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m epdserve.bench.experiments.handoff_peer")
    parser.add_argument("--port", type=int, required=True, help="the sender's port on 127.0.0.1")
    receiver_main(parser.parse_args().port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
