"""This project's shared-memory segments: how one is created (named after its creator, owner
only) and attached, and how a dead process's are found and unlinked.

No torch here: the launcher and the simulator import this, and neither needs torch.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import resource_tracker, shared_memory

# Every shared-memory segment a process of this project creates is named
# ``<prefix>-<creating pid>-<random>`` (KV pools and their ranks', state slots, write fences,
# embedding slabs): what a process that died without closing them left behind can be found.
SEGMENT_PREFIXES = ("epdserve-kv", "epdserve-kv-rank", "epdserve-state", "epdserve-fence", "epdserve-emb")
SHM_DIR = "/dev/shm"


def unlink_segments_of(pid: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the segments process ``pid`` created; call it only once ``pid`` has exited (a
    worker killed before its close). Returns their names."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        prefix, sep, rest = name.rpartition(f"-{pid}-")
        if sep and prefix in SEGMENT_PREFIXES and rest and "-" not in rest:
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except OSError:
                pass
    return removed


def create_segment(prefix: str, size: int) -> shared_memory.SharedMemory:
    """A new segment ``<prefix>-<this pid>-<random>`` of ``size`` bytes, readable and writable
    by this user only."""
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
    old_umask = os.umask(0o077)
    try:
        return shared_memory.SharedMemory(name=name, create=True, size=size)
    finally:
        os.umask(old_umask)


def attach_segment(name: str, min_bytes: int) -> shared_memory.SharedMemory:
    """Map another process's segment ``name`` (its owner unlinks it, not this process);
    ValueError when it holds fewer than ``min_bytes``."""
    segment = shared_memory.SharedMemory(name=name, create=False)
    try:
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:
        pass
    if segment.size < min_bytes:
        segment.close()
        raise ValueError(f"shared segment {name} is smaller than its layout says")
    return segment
