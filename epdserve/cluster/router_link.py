"""A worker's sockets to the router: the control socket, and heartbeats from a thread.

The heartbeat thread (its own socket, identity ``<worker id>/hb``) keeps beating while the
worker's loop is busy in a long step, so the router tells a slow worker from a dead one; each
beat also says how long the loop's current step has run, so the router tells a slow step from
a hung one.

Sends never block for good: a socket holds at most ``SEND_HWM`` messages for a router that
does not read them, and a send waits at most ``SEND_TIMEOUT_MS`` for room (then ``zmq.Again``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq

from epdserve.auth import make_curve_client
from epdserve.cluster import messages as m

log = logging.getLogger("epdserve.worker")

SEND_HWM = 100_000  # messages queued for the router at most
SEND_TIMEOUT_MS = 10_000


def connect_to_router(ctx: zmq.Context, router: str, identity: str, key: bytes) -> zmq.Socket:
    """A DEALER socket to the router's ``tcp://HOST:PORT``, named ``identity``, proving the
    cluster secret ``key`` (CURVE; a router without it is never talked to)."""
    sock = ctx.socket(zmq.DEALER)
    make_curve_client(sock, key)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    sock.connect(router)
    return sock


@dataclass(frozen=True)
class MalformedFrame:
    """A frame from the router that did not decode as the message it claims to be (this
    process's stand-in, never sent): what could be read of it, so the request it was about
    fails alone instead of waiting for a message that will never come."""

    kind: str  # the message type it names ("" when unreadable)
    request_id: str
    reason: str
    kv_target: str = ""  # Submit: the decode worker a prefill would have written to
    image_index: int = -1  # EncodeImage


def recv_message(sock: zmq.Socket) -> m.Message | MalformedFrame | None:
    """The next control message on ``sock`` (one is ready); a MalformedFrame for a frame that
    names a request but does not check out, None for one that names nothing (dropped)."""
    data = sock.recv()
    try:
        return m.decode(data)
    except msgspec.DecodeError as e:
        reason = f"malformed {type(e).__name__}: {e}"
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        raw = None
    fields = raw if isinstance(raw, dict) else {}
    request_id = fields.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        log.warning("dropping a malformed message from the router: %s", reason)
        return None
    kind, kv_target, index = fields.get("type"), fields.get("kv_target"), fields.get("image_index")
    log.warning("malformed %s for %s: %s", kind, request_id, reason)
    return MalformedFrame(kind if isinstance(kind, str) else "", request_id, reason,
                          kv_target if isinstance(kv_target, str) else "",
                          index if isinstance(index, int) and not isinstance(index, bool) else -1)


class StepProgress:
    """The worker loop's progress, written by the loop and read by the heartbeat thread."""

    def __init__(self) -> None:
        self.num_steps = 0
        self._busy_since = 0.0  # monotonic seconds; 0 while the loop waits for work

    def begin(self) -> None:
        self._busy_since = time.monotonic()

    def end(self) -> None:
        self._busy_since = 0.0
        self.num_steps += 1

    @property
    def age_s(self) -> float:
        """How long the loop has been inside its current pass (0 while it waits)."""
        since = self._busy_since
        return time.monotonic() - since if since else 0.0


def start_heartbeats(
    ctx: zmq.Context, router: str, worker_id: str, key: bytes, load: Callable[[], m.Load], period_s: float,
    stop: threading.Event, progress: StepProgress | None = None,
) -> threading.Thread:
    """Send ``Heartbeat(worker_id, load(), progress)`` every ``period_s`` seconds until ``stop``
    is set."""

    def beat() -> None:
        sock = connect_to_router(ctx, router, f"{worker_id}/hb", key)
        while not stop.wait(period_s):
            try:
                num_steps, age_s = (progress.num_steps, progress.age_s) if progress else (0, 0.0)
                sock.send(m.encode(m.Heartbeat(worker_id, load(), num_steps, age_s)), zmq.NOBLOCK)
            except (zmq.ZMQError, RuntimeError):
                pass  # the context is closing, or the router is gone: the next beat retries
        sock.close()

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread
