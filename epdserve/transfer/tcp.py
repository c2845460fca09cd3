"""KV over TCP: one persistent connection per (prefill, decode) worker pair.

A connection starts with the cluster handshake (epdserve/auth.py): the decode worker reads no
frame from a peer that has not proven the cluster secret. Then, frame after frame::

    | u32 header length | msgpack LayerFrame | dst slots (int64 * num_tokens) | K,V payload |

The payload is ``[2, num_tokens, num_kv_heads, head_dim]`` in the pool's dtype, for the pages of
the decode worker's tensor-parallel rank ``rank`` (its listener lands every rank's frames). A
frame of a recurrent layer (one without KV heads) carries request states instead: its "slots"
are state slot ids and each row is one request's state in that layer. Each
header is checked against the reservation it names before anything is allocated or read: the
generation must be open and reserved for the frame's request, the layer and rank in range, the size
that of ``num_tokens`` rows of that layer, and ``num_tokens`` no more than the reservation's
blocks hold; the slots must then lie in the reservation's blocks (the write fence,
``fence.py``). A frame of a reservation that has ended is read and dropped (a late write). A
frame that fails the checks is dropped and fails its request (``on_refused``); one whose size
cannot be trusted also closes the connection. A frame with ``layer == -1`` ends a request:
every earlier frame of it has landed when the receiver sees it.

Sends have a deadline (``send_timeout_s``) and the queue of layers waiting to be sent is
bounded: a peer that stops reading breaks the link (its transfers fail) instead of growing
this process's memory or blocking it for good.
"""

from __future__ import annotations

import logging
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable

import msgspec
import numpy as np
import torch

from epdserve.auth import AuthError, accept_peer, prove_to_peer
from epdserve.transfer.fence import ReservationFence

log = logging.getLogger("epdserve.transfer")

_HEADER = struct.Struct("!I")
END_OF_REQUEST = -1
MAX_HEADER_BYTES = 4096  # a header naming more is a broken peer: the connection closes
MAX_CONNECTIONS = 256  # per listener; more are refused before the handshake
_DISCARD_CHUNK = 1 << 20


class LayerFrame(msgspec.Struct, array_like=True):
    request_id: str
    generation: int  # the decode worker's reservation this KV is for
    layer: int
    num_tokens: int
    num_payload_bytes: int
    rank: int = 0  # the decode worker's tensor-parallel rank whose pages take it

SEND_TIMEOUT_S = 10.0
MAX_QUEUED_LAYERS = 1024


class BrokenPeer(Exception):
    """A frame whose framing cannot be trusted: the connection closes."""


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


def _discard(sock: socket.socket, num_bytes: int) -> bool:
    """Read and drop ``num_bytes`` (in bounded chunks); False when the peer closed."""
    scratch = memoryview(bytearray(min(num_bytes, _DISCARD_CHUNK)))
    while num_bytes > 0:
        n = min(num_bytes, len(scratch))
        if not _recv_exact(sock, scratch[:n]):
            return False
        num_bytes -= n
    return True


def recv_header(conn: socket.socket, decoder: msgspec.msgpack.Decoder) -> msgspec.Struct | None:
    """Read one ``| u32 length | msgpack header |`` off ``conn``; None when the peer closed.
    Raises BrokenPeer for a header that is too long or does not decode."""
    header_len = bytearray(_HEADER.size)
    if not _recv_exact(conn, memoryview(header_len)):
        return None
    (n,) = _HEADER.unpack(header_len)
    if n > MAX_HEADER_BYTES:
        raise BrokenPeer(f"a frame header of {n} bytes")
    raw = bytearray(n)
    if not _recv_exact(conn, memoryview(raw)):
        return None
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, ValueError) as e:
        raise BrokenPeer(f"a frame header that does not decode: {e}") from None


def connect(host: str, port: int, key: bytes, purpose: bytes, timeout_s: float) -> socket.socket:
    """A connection to a listener that proved ``key`` (and saw this side prove it)."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        prove_to_peer(sock, key, purpose, timeout_s)
    except AuthError:
        sock.close()
        raise
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class FrameListener:
    """Listens on ``host`` (any free port) and serves each connection in a thread of its own,
    once the peer has proven ``key`` for ``purpose``; subclasses read frames in ``_serve``
    until the peer closes (or ``BrokenPeer``)."""

    def __init__(self, host: str, name: str, key: bytes, purpose: bytes) -> None:
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        # The address offered to peers: a wildcard bind offers this host's name's address.
        self.host = socket.gethostbyname(socket.gethostname()) if host in ("", "0.0.0.0") else host
        self._name = name
        self._key = key
        self._purpose = purpose
        self._closed = False
        self._num_connections = 0
        self._count_lock = threading.Lock()
        self.num_refused_peers = 0  # connections that did not prove the cluster key
        threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._count_lock:
                if self._num_connections >= MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._num_connections += 1
            threading.Thread(target=self._connection, args=(conn,), name=f"{self._name}-recv", daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            try:
                accept_peer(conn, self._key, self._purpose)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._serve(conn)
            except AuthError as e:
                self.num_refused_peers += 1
                log.warning("%s listener: refused a connection: %s", self._name, e)
            except BrokenPeer as e:
                log.warning("%s listener: closing a connection: %s", self._name, e)
            except OSError:
                pass  # the peer went away
            finally:
                with self._count_lock:
                    self._num_connections -= 1

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
        key: bytes,
        host: str = "127.0.0.1",
        on_refused: Callable[[str, str], None] = lambda request_id, reason: None,
        rank_caches: list[list[torch.Tensor]] | None = None,
        state_caches: list[torch.Tensor] | None = None,
    ) -> None:
        """Frames land only where ``fence`` admits their generation; the end marker of an
        open reservation calls ``on_landed(request_id)``; a frame that fails its checks calls
        ``on_refused(request_id, reason)`` (the request fails). ``rank_caches``: at tensor
        parallelism, every rank's pages (rank 0's are ``kv_caches``), all laid out alike.
        ``state_caches``: a recurrent model's state per layer (``[num_slots, ...]``, empty for
        an attention layer)."""
        self.kv_caches = kv_caches
        self.rank_caches = rank_caches or [kv_caches]
        self.state_caches = state_caches
        self.on_landed = on_landed
        self.on_refused = on_refused
        self.fence = fence
        self.layer_to_group = layer_to_group
        self.block_size = kv_caches[0].shape[2]
        self.max_tokens = kv_caches[0].shape[1] * self.block_size  # the whole pool
        self._row_bytes = [2 * c.shape[3] * c.shape[4] * c.element_size() for c in kv_caches]
        # A recurrent layer's rows are request states, addressed by slot id.
        self._is_state = [bool(state_caches is not None and state_caches[i].numel()) for i in range(len(kv_caches))]
        for i, is_state in enumerate(self._is_state):
            if is_state:
                state = state_caches[i]  # type: ignore[index]
                self._row_bytes[i] = state[0].numel() * state.element_size()
        self._decoder = msgspec.msgpack.Decoder(LayerFrame)
        self.num_refused_frames = 0  # frames read and dropped: reservation closed, or failing a check
        super().__init__(host, "kv", key, b"kv")

    def _serve(self, conn: socket.socket) -> None:
        while True:
            frame = recv_header(conn, self._decoder)
            if frame is None:
                return
            if frame.layer == END_OF_REQUEST:
                with self.fence.lock:
                    reservation = self.fence.reservation(frame.generation)
                if reservation is not None and reservation[0] == frame.request_id:
                    self.on_landed(frame.request_id)
                continue
            if not self._read_frame(conn, frame):
                return

    def _refuse(self, frame: LayerFrame, reason: str) -> None:
        self.num_refused_frames += 1
        log.warning("refused a KV frame of %s: %s", frame.request_id, reason)
        self.on_refused(frame.request_id, reason)

    def _read_frame(self, conn: socket.socket, frame: LayerFrame) -> bool:
        """Check, read and land one layer frame; False when the peer closed."""
        if not 0 <= frame.layer < len(self.kv_caches):
            self._refuse(frame, f"layer {frame.layer} out of range")
            raise BrokenPeer("a frame of an unknown layer")
        if not 0 <= frame.rank < len(self.rank_caches) or (self._is_state[frame.layer] and frame.rank):
            self._refuse(frame, f"rank {frame.rank} out of range")
            raise BrokenPeer("a frame of an unknown rank")
        row_bytes = self._row_bytes[frame.layer]
        if not 0 < frame.num_tokens <= self.max_tokens or frame.num_payload_bytes != frame.num_tokens * row_bytes:
            self._refuse(frame, f"{frame.num_tokens} tokens in {frame.num_payload_bytes} bytes do not fit the pool")
            raise BrokenPeer("a frame whose size does not match the pool")
        num_bytes = frame.num_tokens * (8 + row_bytes)
        group = self.layer_to_group[frame.layer]
        with self.fence.lock:
            reservation = self.fence.reservation(frame.generation)
        if reservation is None:  # ended (landed, aborted, expired): a late write
            self.num_refused_frames += 1
            return _discard(conn, num_bytes)
        request_id, block_ids = reservation
        if request_id != frame.request_id:
            self._refuse(frame, "the frame names another request's reservation")
            return _discard(conn, num_bytes)
        is_state = self._is_state[frame.layer]
        if frame.num_tokens > len(block_ids[group]) * (1 if is_state else self.block_size):
            self._refuse(frame, f"{frame.num_tokens} tokens exceed the reservation")
            raise BrokenPeer("a frame larger than its reservation")
        slots = np.empty(frame.num_tokens, dtype=np.int64)
        if not _recv_exact(conn, memoryview(slots).cast("B")):
            return False
        ids = np.unique(slots if is_state else slots // self.block_size)
        if int(slots.min()) < 0 or not set(ids.tolist()) <= set(block_ids[group]):
            self._refuse(frame, "slots outside the reservation's blocks")
            return _discard(conn, frame.num_payload_bytes)
        payload = bytearray(frame.num_payload_bytes)
        if not _recv_exact(conn, memoryview(payload)):
            return False
        self._land(frame, group, slots, ids, payload)
        return True

    def _land(self, frame: LayerFrame, group: int, slots: np.ndarray, block_ids: np.ndarray,
              payload: bytearray) -> None:
        with self.fence.lock:  # check and write as one step against the engine's close
            if not self.fence.admits(frame.generation, group, block_ids):
                self.num_refused_frames += 1
                return
            if self._is_state[frame.layer]:
                state = self.state_caches[frame.layer]  # type: ignore[index]
                rows = torch.frombuffer(payload, dtype=state.dtype).view(frame.num_tokens, *state.shape[1:])
                state.index_copy_(0, torch.from_numpy(slots).to(state.device), rows.to(state.device))
                return
            cache = self.rank_caches[frame.rank][frame.layer]
            kv = torch.frombuffer(payload, dtype=cache.dtype).view(2, frame.num_tokens, *cache.shape[3:])
            flat = cache.view(2, cache.shape[1] * cache.shape[2], *cache.shape[3:])
            flat.index_copy_(1, torch.from_numpy(slots).to(flat.device), kv.to(flat.device))


class TcpKVSender:
    """Prefill side: one connection to one decode worker, written by a background thread.

    ``write`` copies the layer's KV out of the prefill worker's pages at once, so the pages
    are free to reuse as soon as ``finish`` has been called; completion (the end marker sent)
    is reported by ``poll_done``.
    """

    def __init__(self, host: str, port: int, key: bytes, connect_timeout: float = 5.0,
                 send_timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Raises OSError (AuthError included) when the decode worker cannot be reached or
        does not prove the cluster secret ``key``."""
        self._sock = connect(host, port, key, b"kv", connect_timeout)
        self._sock.settimeout(send_timeout_s)
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
              dst_slots: torch.Tensor, dst_block_ids: np.ndarray, rank: int = 0) -> bool:
        """kv [2, n, kv_heads, head_dim], a fresh tensor (not a view of the pages) that the
        sender now owns, for the receiver's rank ``rank``; dst_slots [n] int64. The receiver
        checks the fence; True here means queued."""
        self._put((request_id, generation, layer, kv.contiguous(), dst_slots.to(torch.int64).contiguous(), rank))
        return True

    def finish(self, request_id: str, generation: int) -> None:
        self._put((request_id, generation, END_OF_REQUEST, None, None, 0))

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
            request_id, generation, layer, kv, slots, rank = item
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
                header = self._encoder.encode(LayerFrame(request_id, generation, layer, slots.numel(), data.nbytes,
                                                         rank))
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
