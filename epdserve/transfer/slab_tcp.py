"""Embedding slabs over TCP, for encode workers on another host.

The consumer keeps its slab in its own memory (or the shared segment that encode workers on
its node map) and listens; each encode worker on another node holds one persistent
connection to it, opened with the cluster handshake (epdserve/auth.py). One frame per image::

    | u32 header length | msgpack SlabFrame | rows x hidden payload (the slab's dtype) |

The header is checked before the payload is read: rows inside the slab and a size of exactly
those rows, or the connection closes. The receiver lands a frame only if the consumer still
expects that image in those rows (``accepts``, checked under the consumer's lock, which its
abort also takes): a frame of an aborted request is read and dropped, never written into rows
that may have been given to another request.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable

import msgspec
import torch

from epdserve.transfer.tcp import BrokenPeer, FrameListener, _recv_exact, connect, recv_header

_HEADER = struct.Struct("!I")


class SlabFrame(msgspec.Struct, array_like=True):
    request_id: str
    image_index: int
    row_offset: int
    num_rows: int
    num_payload_bytes: int


class TcpSlabReceiver(FrameListener):
    """Consumer side: accepts encode workers' connections and lands frames into ``rows``."""

    def __init__(
        self,
        rows: torch.Tensor,
        on_landed: Callable[[str, int], None],
        accepts: Callable[[str, int, int, int], bool],
        lock: threading.Lock,
        key: bytes,
        host: str = "127.0.0.1",
    ) -> None:
        self.rows = rows  # [num_rows, hidden]
        self.on_landed = on_landed
        self.accepts = accepts
        self.lock = lock
        self._decoder = msgspec.msgpack.Decoder(SlabFrame)
        self.num_refused_frames = 0
        super().__init__(host, "slab", key, b"slab")

    def _serve(self, conn: socket.socket) -> None:
        num_rows, hidden = self.rows.shape
        row_bytes = hidden * self.rows.element_size()
        while True:
            frame = recv_header(conn, self._decoder)
            if frame is None:
                return
            end = frame.row_offset + frame.num_rows
            if (frame.row_offset < 0 or frame.num_rows <= 0 or end > num_rows
                    or frame.num_payload_bytes != frame.num_rows * row_bytes):
                self.num_refused_frames += 1
                raise BrokenPeer(f"a slab frame of rows {frame.row_offset}..{end} in {frame.num_payload_bytes} "
                                 f"bytes (the slab has {num_rows} rows of {row_bytes} bytes)")
            payload = bytearray(frame.num_payload_bytes)
            if not _recv_exact(conn, memoryview(payload)):
                return
            data = torch.frombuffer(payload, dtype=self.rows.dtype).view(frame.num_rows, hidden)
            with self.lock:
                if not self.accepts(frame.request_id, frame.image_index, frame.row_offset, frame.num_rows):
                    self.num_refused_frames += 1
                    continue
                self.rows[frame.row_offset : end].copy_(data)
            self.on_landed(frame.request_id, frame.image_index)


class TcpSlabSender:
    """Encode side: one connection to one consumer; ``send`` returns when the bytes are sent."""

    def __init__(self, host: str, port: int, num_rows: int, hidden_size: int, dtype: torch.dtype, key: bytes,
                 connect_timeout: float = 5.0, send_timeout_s: float = 30.0) -> None:
        self._sock = connect(host, port, key, b"slab", connect_timeout)
        self._sock.settimeout(send_timeout_s)
        self.num_rows = num_rows
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, request_id: str, image_index: int, row_offset: int, rows: torch.Tensor) -> int:
        """Write ``rows`` [n, hidden] at ``row_offset`` of the consumer's slab; returns bytes sent.
        Raises ValueError for rows outside the slab, OSError when the connection fails."""
        if row_offset < 0 or row_offset + rows.shape[0] > self.num_rows or rows.shape[1] != self.hidden_size:
            raise ValueError(f"rows {row_offset}..{row_offset + rows.shape[0]} do not fit the slab")
        data = rows.to(self.dtype).contiguous().view(-1).view(torch.uint8).numpy()
        header = self._encoder.encode(SlabFrame(request_id, image_index, row_offset, rows.shape[0], data.nbytes))
        self._sock.sendall(_HEADER.pack(len(header)) + header)
        self._sock.sendall(memoryview(data))
        return data.nbytes

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
