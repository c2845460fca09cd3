"""KV over TCP: one persistent connection per (prefill, decode) worker pair.

Frame on the wire::

    | u32 header length | msgpack LayerFrame | dst slots (int64 * num_tokens) | K,V payload |

The payload is ``[2, num_tokens, num_kv_heads, head_dim]`` in the pool's dtype. The receiver
reads it into a buffer and scatters it into the decode worker's pages at ``dst slots``
(slot = block_id * block_size + offset), if the decode worker's write fence still gives those
blocks to the frame's reservation generation (``fence.py``); otherwise the frame is read and
dropped. A frame with ``layer == -1`` ends a request: every earlier frame of it has landed when
the receiver sees it.

Sends have a deadline (``send_timeout_s``) and the queue of layers waiting to be sent is
bounded: a peer that stops reading breaks the link (its transfers fail) instead of growing
this process's memory or blocking it for good.
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

from epdserve.transfer.fence import ReservationFence

_HEADER = struct.Struct("!I")
END_OF_REQUEST = -1


class LayerFrame(msgspec.Struct, array_like=True):
    request_id: str
    generation: int  # the decode worker's reservation this KV is for
    layer: int
    num_tokens: int
    num_payload_bytes: int

# A layer frame's payload at most (a header naming more is a broken peer: the link closes).
MAX_FRAME_BYTES = 1 << 31
SEND_TIMEOUT_S = 10.0
MAX_QUEUED_LAYERS = 1024


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
        fence: ReservationFence,
        layer_to_group: list[int],
        host: str = "127.0.0.1",
    ) -> None:
        """Frames land only where ``fence`` admits their generation; the end marker of an
        open reservation calls ``on_landed(request_id)``."""
        self.kv_caches = kv_caches
        self.on_landed = on_landed
        self.fence = fence
        self.layer_to_group = layer_to_group
        self.block_size = kv_caches[0].shape[2]
        self._row_bytes = [2 * c.shape[3] * c.shape[4] * c.element_size() for c in kv_caches]
        self._decoder = msgspec.msgpack.Decoder(LayerFrame)
        self.num_refused_frames = 0  # frames read and dropped: reservation closed, or malformed
        super().__init__(host, "kv")

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    frame = recv_header(conn, self._decoder)
                except (msgspec.DecodeError, ValueError):
                    return  # not our framing: drop the connection
                if frame is None:
                    return
                if frame.layer == END_OF_REQUEST:
                    with self.fence.lock:
                        landed = self.fence.is_open(frame.generation)
                    if landed:
                        self.on_landed(frame.request_id)
                    continue
                if not (0 <= frame.layer < len(self.kv_caches) and 0 <= frame.num_tokens
                        and frame.num_payload_bytes == frame.num_tokens * self._row_bytes[frame.layer]
                        and frame.num_payload_bytes <= MAX_FRAME_BYTES):
                    return  # sizes that do not match the pool: a broken peer
                slots = np.empty(frame.num_tokens, dtype=np.int64)
                payload = bytearray(frame.num_payload_bytes)
                if not _recv_exact(conn, memoryview(slots).cast("B")):
                    return
                if not _recv_exact(conn, memoryview(payload)):
                    return
                self._land(frame, slots, payload)

    def _land(self, frame: LayerFrame, slots: np.ndarray, payload: bytearray) -> None:
        cache = self.kv_caches[frame.layer]
        group = self.layer_to_group[frame.layer]
        block_ids = np.unique(slots // self.block_size) if slots.size else slots
        with self.fence.lock:  # check and write as one step against the engine's close
            if slots.size == 0 or int(slots.min()) < 0 or not self.fence.admits(frame.generation, group, block_ids):
                self.num_refused_frames += 1
                return
            kv = torch.frombuffer(payload, dtype=cache.dtype).view(2, frame.num_tokens, *cache.shape[3:])
            flat = cache.view(2, -1, *cache.shape[3:])
            flat.index_copy_(1, torch.from_numpy(slots).to(flat.device), kv.to(flat.device))


class TcpKVSender:
    """Prefill side: one connection to one decode worker, written by a background thread.

    ``write`` copies the layer's KV out of the prefill worker's pages at once, so the pages
    are free to reuse as soon as ``finish`` has been called; completion (the end marker sent)
    is reported by ``poll_done``.
    """

    def __init__(self, host: str, port: int, connect_timeout: float = 5.0,
                 send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        self._sock = socket.create_connection((host, port), timeout=connect_timeout)
        self._sock.settimeout(send_timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_timeout_s = send_timeout_s
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED_LAYERS)
        self._done: list[str] = []
        self._failed: list[str] = []
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self.num_bytes_sent = 0
        self.seconds_sending = 0.0
        self.broken = False
        self._thread = threading.Thread(target=self._send_loop, name="kv-send", daemon=True)
        self._thread.start()

    def write(self, request_id: str, generation: int, layer: int, group: int, kv: torch.Tensor,
              dst_slots: torch.Tensor, dst_block_ids: np.ndarray) -> bool:
        """kv [2, n, kv_heads, head_dim], a fresh tensor (not a view of the pages) that the
        sender now owns; dst_slots [n] int64. The receiver checks the fence; True here means
        queued."""
        self._put((request_id, generation, layer, kv.contiguous(), dst_slots.to(torch.int64).contiguous()))
        return True

    def finish(self, request_id: str, generation: int) -> None:
        self._put((request_id, generation, END_OF_REQUEST, None, None))

    def _put(self, item: tuple) -> None:
        """Bounded: waits for room at most the send deadline, then the link is broken (its
        transfers fail; the caller's next request opens a new link)."""
        try:
            self._queue.put(item, timeout=self._send_timeout_s)
        except queue.Full:
            self.broken = True
            with self._lock:
                self._failed.append(item[0])

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
            request_id, generation, layer, kv, slots = item
            if self.broken:
                if layer == END_OF_REQUEST:
                    with self._lock:
                        self._failed.append(request_id)
                continue
            start = time.perf_counter()
            try:
                if layer == END_OF_REQUEST:
                    header = self._encoder.encode(LayerFrame(request_id, generation, layer, 0, 0))
                    self._sock.sendall(_HEADER.pack(len(header)) + header)
                    with self._lock:
                        self._done.append(request_id)
                    continue
                data = kv.reshape(-1).view(torch.uint8).numpy()
                header = self._encoder.encode(LayerFrame(request_id, generation, layer, slots.numel(), data.nbytes))
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
        self.broken = True
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass  # the send loop ends on the closed socket
        try:
            self._sock.close()
        except OSError:
            pass
