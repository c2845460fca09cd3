"""KV over TCP: one persistent connection per (prefill, decode) worker pair.

Frame on the wire::

    | u32 header length | msgpack LayerFrame | dst slots (int64 * num_tokens) | K,V payload |

The payload is ``[2, num_tokens, num_kv_heads, head_dim]`` in the pool's dtype. The receiver
reads it into a buffer and scatters it into the decode worker's pages at ``dst slots``
(slot = block_id * block_size + offset). A frame with ``layer == -1`` ends a request: every
earlier frame of it has landed when the receiver sees it.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from collections.abc import Callable

import msgspec
import numpy as np
import torch

_HEADER = struct.Struct("!I")
END_OF_REQUEST = -1


class LayerFrame(msgspec.Struct, array_like=True):
    request_id: str
    layer: int
    num_tokens: int
    num_payload_bytes: int


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


def recv_header(conn: socket.socket, decoder: msgspec.msgpack.Decoder) -> msgspec.Struct | None:
    """Read one ``| u32 length | msgpack header |`` off ``conn``; None when the peer closed."""
    header_len = bytearray(_HEADER.size)
    if not _recv_exact(conn, memoryview(header_len)):
        return None
    (n,) = _HEADER.unpack(header_len)
    raw = bytearray(n)
    if not _recv_exact(conn, memoryview(raw)):
        return None
    return decoder.decode(raw)


class FrameListener:
    """Listens on ``host`` (any free port) and serves each connection in a thread of its own;
    subclasses read frames in ``_serve`` until the peer closes."""

    def __init__(self, host: str, name: str) -> None:
        self._listener = socket.create_server((host, 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._name = name
        self._closed = False
        threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name=f"{self._name}-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass


class TcpKVReceiver(FrameListener):
    """Decode side: accepts prefill workers' connections and lands frames into the pool."""

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        on_landed: Callable[[str], None],
        accepts: Callable[[str], bool],
        host: str = "127.0.0.1",
    ) -> None:
        """``accepts(request_id)``: whether frames of that request may land (its blocks are
        still reserved); frames of an aborted request are read and dropped."""
        self.kv_caches = kv_caches
        self.on_landed = on_landed
        self.accepts = accepts
        self._decoder = msgspec.msgpack.Decoder(LayerFrame)
        super().__init__(host, "kv")

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                frame = recv_header(conn, self._decoder)
                if frame is None:
                    return
                if frame.layer == END_OF_REQUEST:
                    if self.accepts(frame.request_id):
                        self.on_landed(frame.request_id)
                    continue
                slots = np.empty(frame.num_tokens, dtype=np.int64)
                payload = bytearray(frame.num_payload_bytes)
                if not _recv_exact(conn, memoryview(slots).cast("B")):
                    return
                if not _recv_exact(conn, memoryview(payload)):
                    return
                if not self.accepts(frame.request_id):
                    continue
                cache = self.kv_caches[frame.layer]
                kv = torch.frombuffer(payload, dtype=cache.dtype).view(2, frame.num_tokens, *cache.shape[3:])
                flat = cache.view(2, -1, *cache.shape[3:])
                flat.index_copy_(1, torch.from_numpy(slots).to(flat.device), kv.to(flat.device))


class TcpKVSender:
    """Prefill side: one connection to one decode worker, written by a background thread.

    ``write`` copies the layer's KV out of the prefill worker's pages at once, so the pages
    are free to reuse as soon as ``finish`` has been called; completion (the end marker sent)
    is reported by ``poll_done``.
    """

    def __init__(self, host: str, port: int, connect_timeout: float = 5.0) -> None:
        self._sock = socket.create_connection((host, port), timeout=connect_timeout)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._queue: queue.Queue = queue.Queue()
        self._done: list[str] = []
        self._failed: list[str] = []
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self.num_bytes_sent = 0
        self.seconds_sending = 0.0
        self.broken = False
        self._thread = threading.Thread(target=self._send_loop, name="kv-send", daemon=True)
        self._thread.start()

    def write(self, request_id: str, layer: int, kv: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """kv [2, n, kv_heads, head_dim], a fresh tensor (not a view of the pages) that the
        sender now owns; dst_slots [n] int64."""
        self._queue.put((request_id, layer, kv.contiguous(), dst_slots.to(torch.int64).contiguous()))

    def finish(self, request_id: str) -> None:
        self._queue.put((request_id, END_OF_REQUEST, None, None))

    def poll_done(self) -> tuple[list[str], list[str]]:
        """(request ids whose KV was all sent, request ids whose sending failed)."""
        with self._lock:
            done, self._done = self._done, []
            failed, self._failed = self._failed, []
        return done, failed

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            request_id, layer, kv, slots = item
            if self.broken:
                if layer == END_OF_REQUEST:
                    with self._lock:
                        self._failed.append(request_id)
                continue
            start = time.perf_counter()
            try:
                if layer == END_OF_REQUEST:
                    header = self._encoder.encode(LayerFrame(request_id, layer, 0, 0))
                    self._sock.sendall(_HEADER.pack(len(header)) + header)
                    with self._lock:
                        self._done.append(request_id)
                    continue
                data = kv.reshape(-1).view(torch.uint8).numpy()
                header = self._encoder.encode(LayerFrame(request_id, layer, slots.numel(), data.nbytes))
                self._sock.sendall(_HEADER.pack(len(header)) + header)
                self._sock.sendall(slots.numpy().tobytes())
                self._sock.sendall(memoryview(data))
                self.num_bytes_sent += data.nbytes
            except OSError:
                self.broken = True
                if layer == END_OF_REQUEST:
                    with self._lock:
                        self._failed.append(request_id)
            finally:
                self.seconds_sending += time.perf_counter() - start

    def close(self) -> None:
        self._queue.put(None)
        try:
            self._sock.close()
        except OSError:
            pass
