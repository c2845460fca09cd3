"""Emulating separate machines on one host: each worker process gets a CPU quota of its own.

On a host with fewer cores than workers, workers pinned two to a core share it: a busy worker
takes the whole core while its neighbour idles, so the host moves capacity between roles by
itself and no topology can be told from another. Giving each worker a fixed share of a core
(the Linux CFS bandwidth controller: ``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` in v1)
makes it a machine of that size: what one role leaves idle, another cannot use. Used by the
load-shift experiment; needs write access to the cgroup file system (root, or a delegated
subtree), which ``available`` checks.

A short period (``PERIOD_US``) keeps the throttling fine-grained: a worker runs at most
``share x period`` per period, so a decode step is never held back by more than one period.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from epdserve.bench import BenchError

V2_ROOT = Path("/sys/fs/cgroup")
V1_CPU = Path("/sys/fs/cgroup/cpu")
V1_UNIFIED = Path("/sys/fs/cgroup/unified")
PERIOD_US = 10_000  # 10 ms


def _v2_root() -> Path | None:
    for root in (V2_ROOT, V1_UNIFIED):
        controllers = root / "cgroup.controllers"
        if controllers.is_file() and "cpu" in controllers.read_text().split():
            return root
    return None


def _v1_root() -> Path | None:
    return V1_CPU if (V1_CPU / "cpu.cfs_quota_us").is_file() else None


def available() -> str | None:
    """Why quotas cannot be set here (None: they can)."""
    root = _v2_root() or _v1_root()
    if root is None:
        return "no cgroup CPU controller (cgroup v2 cpu.max or v1 cpu.cfs_quota_us) is mounted"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (run as root, or delegate a cgroup subtree)"
    return None


def _check_share(share: float) -> float:
    if not 0 < share <= 64:
        raise BenchError(f"a CPU share must be in (0, 64] cores, got {share}")
    return share


def pin(pid: int, cores: tuple[int, ...]) -> None:
    """Pin every thread of process ``pid`` to ``cores`` (indices into the cores this process may
    use), so that processes can be placed on cores after they started: a process's threads keep
    the affinity they were created with, so each thread is set."""
    allowed = sorted(os.sched_getaffinity(0))
    if not cores or any(not 0 <= c < len(allowed) for c in cores):
        raise BenchError(f"cores {cores} are not among the {len(allowed)} this process may use")
    chosen = {allowed[c] for c in cores}
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError as e:
        raise BenchError(f"cannot pin process {pid}: {e}") from e
    for tid in tids:
        try:
            os.sched_setaffinity(tid, chosen)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


class CpuQuotas:
    """One cgroup per process, each limited to a share of a core (one for all given here, or one
    per process to ``limit``); ``close`` removes them."""

    def __init__(self, share: float | None = None) -> None:
        if share is not None:
            _check_share(share)
        why = available()
        if why is not None:
            raise BenchError(f"cannot give workers CPU quotas: {why}")
        self.share = share
        self.v2 = _v2_root()
        self.root = self.v2 if self.v2 is not None else _v1_root()
        self.prefix = f"epdserve-quota-{uuid.uuid4().hex[:8]}"
        self.groups: list[Path] = []

    def limit(self, pid: int, name: str, share: float | None = None) -> Path:
        """Move process ``pid`` (all its threads) into a new cgroup limited to ``share`` of a
        core (default: the share given at construction)."""
        share = self.share if share is None else _check_share(share)
        if share is None:
            raise BenchError("a CPU quota needs a share: none given here or at construction")
        group = self.root / f"{self.prefix}-{name}"
        group.mkdir()
        self.groups.append(group)
        quota = max(1000, round(share * PERIOD_US))
        if self.v2 is not None:
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
        else:
            (group / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        (group / "cgroup.procs").write_text(f"{pid}\n")
        return group

    def throttled_s(self) -> dict[str, float]:
        """Seconds each group was held back by its quota so far (by group name)."""
        out = {}
        for group in self.groups:
            stat = {}
            try:
                for line in (group / "cpu.stat").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    stat[key] = int(value)
            except (OSError, ValueError):
                continue
            usec = stat.get("throttled_usec")
            out[group.name.removeprefix(self.prefix + "-")] = (
                usec / 1e6 if usec is not None else stat.get("throttled_time", 0) / 1e9)
        return out

    def close(self) -> None:
        """Move what is left back to the root group and remove the groups."""
        for group in self.groups:
            try:
                pids = (group / "cgroup.procs").read_text().split()
            except OSError:
                pids = []
            for pid in pids:
                try:
                    (self.root / "cgroup.procs").write_text(f"{pid}\n")
                except OSError:
                    pass
            try:
                group.rmdir()
            except OSError:
                pass
        self.groups.clear()
