"""A rate-limited link between two network namespaces, for measuring KV over a real NIC rate.

    namespace <prefix>-p                          namespace <prefix>-d
    [prefill worker] 10.213.7.1 --veth (tbf RATE)--> 10.213.7.2 [decode worker's KV listener]
          |                                                  |
    relay listener on its 127.0.0.1          relay listener on its 127.0.0.1
          `----------------> router on this namespace's 127.0.0.1 <------------'

Both veth ends and their addresses live inside namespaces created here, so nothing outside
them changes. Only the KV stream crosses the veth; each worker reaches the router (which
listens on this namespace's loopback) through a relay whose listening socket was created
inside the worker's namespace (``setns`` changes the namespace of sockets created after it).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import subprocess
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
PREFILL_ADDR = "10.213.7.1"  # inside the prefill namespace only
DECODE_ADDR = "10.213.7.2"  # inside the decode namespace only
PREFIX_LEN = 30
TBF_BURST = "256kb"  # bytes the link may send at once above the rate
TBF_LATENCY = "50ms"  # longest a packet may wait in the shaper


class NetnsUnavailable(Exception):
    """This machine does not let the process create namespaces, veth pairs or tbf qdiscs."""


@dataclass(frozen=True)
class VethLink:
    prefill_ns: str
    decode_ns: str
    rate: str  # tc rate, e.g. "10gbit", applied prefill -> decode

    @property
    def prefill_addr(self) -> str:
        return PREFILL_ADDR

    @property
    def decode_addr(self) -> str:
        return DECODE_ADDR


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetnsUnavailable(f"'ip {' '.join(args)}' failed: {proc.stderr.strip() or proc.returncode}")


def create_veth_link(rate: str) -> VethLink:
    """Two fresh namespaces joined by a veth pair, shaped to ``rate`` from prefill to decode.

    Raises NetnsUnavailable (after removing whatever it created) when the machine refuses.
    """
    tag = f"epd{os.getpid()}{secrets.token_hex(2)}"
    link = VethLink(f"{tag}-p", f"{tag}-d", rate)
    created: list[str] = []
    try:
        for ns in (link.prefill_ns, link.decode_ns):
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("link", "add", f"{tag}p", "netns", link.prefill_ns, "type", "veth",
            "peer", "name", f"{tag}d", "netns", link.decode_ns)
        for ns, dev, addr in ((link.prefill_ns, f"{tag}p", PREFILL_ADDR), (link.decode_ns, f"{tag}d", DECODE_ADDR)):
            _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("netns", "exec", link.prefill_ns, "tc", "qdisc", "add", "dev", f"{tag}p", "root", "tbf",
            "rate", rate, "burst", TBF_BURST, "latency", TBF_LATENCY)
    except (NetnsUnavailable, OSError) as e:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        raise NetnsUnavailable(str(e)) from None
    return link


def delete_veth_link(link: VethLink) -> None:
    """Remove both namespaces; the veth pair and its qdisc go with them."""
    for ns in (link.prefill_ns, link.decode_ns):
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def _setns(fd: int) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


class InNamespace:
    """``with InNamespace(name):`` sockets created by this thread inside the block belong to
    network namespace ``name``; they keep it after the block restores the thread's own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._home = -1

    def __enter__(self) -> None:
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)

    def __exit__(self, *exc: object) -> None:
        try:
            _setns(self._home)
        finally:
            os.close(self._home)
