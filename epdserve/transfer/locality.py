"""Which machine a process runs on, so two workers can tell whether they share memory.

A node is named by ``$EPDSERVE_NODE_ID`` when set (a Ray actor gets its Ray node's id), else
by this host's name and boot id: two processes of one boot share ``/dev/shm``. A peer on the
same node is written through shared memory; any other over TCP (``pick_transport``).
"""

from __future__ import annotations

import functools
import socket

from epdserve.envs import get_node_id

TRANSPORTS = ("auto", "shm", "tcp")


@functools.cache
def _boot_node() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def this_node() -> str:
    return get_node_id() or _boot_node()


def pick_transport(offered: str, shm_name: str, port: int, node: str) -> str:
    """"shm" or "tcp": how a writer on this node reaches an endpoint that offers ``offered``
    (its shared segment ``shm_name`` on ``node``, its TCP listener on ``port``). Raises
    ValueError when it offers no way this node can use."""
    if shm_name and node in ("", this_node()) and offered in ("shm", "auto"):
        return "shm"
    if port and offered in ("tcp", "auto"):
        return "tcp"
    raise ValueError(f"the endpoint offers {offered!r} on node {node!r}: shared memory on another node "
                     "cannot be reached (serve it with --kv-transport auto or tcp)")
