"""The router's socket to its workers (a ZMQ ROUTER; each worker is a DEALER named by its id).

Sends never wait: a message for a worker that is not connected or whose queue is full fails
at once (ROUTER_MANDATORY) and the caller decides what that costs (``post`` says False;
``submit`` turns it into a 503 for the request it was starting). Frames are checked on the
way in: one frame of a known message, or it is dropped with a warning.

The socket is a CURVE server (epdserve/auth.py): only a peer holding the cluster secret
completes the handshake, so every frame read here comes from a member of the cluster; the
dispatcher then checks that a member speaks only for itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from epdserve.auth import CurveGate, make_curve_server
from epdserve.cluster import messages as m
from epdserve.router.admission import Overloaded, unreachable

log = logging.getLogger("epdserve.router")

SEND_HWM = 100_000  # messages queued for one worker at most; then sends to it fail


class WorkerChannel:
    def __init__(self, key: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        """``host``: the address workers connect to (bind ``0.0.0.0`` for every interface)."""
        self.ctx = zmq.asyncio.Context()
        self.gate = CurveGate(self.ctx, key)
        self.sock = self.ctx.socket(zmq.ROUTER)
        make_curve_server(self.sock, key)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its id
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"

    def post(self, worker_id: str | None, msg: m.Msg) -> bool:
        """Send without waiting; False when the message could not be sent (the worker is not
        connected, its queue is full, or the message cannot be encoded)."""
        if worker_id is None:
            return False
        try:
            # With NOBLOCK the asyncio socket tries the send at once and hands back a finished
            # future, holding the error when the send failed.
            sent = self.sock.send_multipart([worker_id.encode(), m.encode(msg)], zmq.NOBLOCK)
            error = sent.exception() if sent.done() else None
        except (zmq.ZMQError, msgspec.EncodeError, OverflowError, TypeError) as e:
            error = e
        if error is not None:
            log.warning("cannot send %s to %s: %s", type(msg).__name__, worker_id, error)
            return False
        return True

    def submit(self, worker_id: str, msg: m.Msg) -> None:
        """Send what starts a request; a worker that cannot take it is a 503 for the request."""
        if not self.post(worker_id, msg):
            raise Overloaded(unreachable(worker_id))

    async def serve(self, handle: Callable[[str, m.Message], None]) -> None:
        """Receive forever, calling ``handle(sender, message)`` for each well-formed frame."""
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:  # a worker sends one frame (the router socket adds its identity)
                log.warning("dropping a message of %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                msg = m.decode(payload)
                sender = identity.decode()
            except Exception as e:  # a malformed frame must not stop the router
                log.warning("dropping malformed message from %r: %s", identity, e)
                continue
            try:
                handle(sender, msg)
            except Exception:
                log.exception("error handling %s", type(msg).__name__)

    def close(self) -> None:
        self.sock.close()
        self.gate.stop()
        self.ctx.term()
