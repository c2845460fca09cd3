"""A worker's sockets to the router: the control socket, and heartbeats from a thread.

The heartbeat thread (its own socket, identity ``<worker id>/hb``) keeps beating while the
worker's loop is busy in a long step, so the router tells a slow worker from a dead one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from epdserve.cluster import messages as m


def connect_to_router(ctx: zmq.Context, router: str, identity: str) -> zmq.Socket:
    """A DEALER socket to the router's ``tcp://HOST:PORT``, named ``identity``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(router)
    return sock


def start_heartbeats(
    ctx: zmq.Context, router: str, worker_id: str, load: Callable[[], m.Load], period_s: float,
    stop: threading.Event,
) -> threading.Thread:
    """Send ``Heartbeat(worker_id, load())`` every ``period_s`` seconds until ``stop`` is set."""

    def beat() -> None:
        sock = connect_to_router(ctx, router, f"{worker_id}/hb")
        while not stop.wait(period_s):
            try:
                sock.send(m.encode(m.Heartbeat(worker_id, load())), zmq.NOBLOCK)
            except (zmq.ZMQError, RuntimeError):
                pass  # the context is closing, or the router is gone: the next beat retries
        sock.close()

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread
