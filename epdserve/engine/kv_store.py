"""Tiered KV block store below a worker's page pool: a host-memory tier and a local-disk tier.

Plain Python (no torch, no numpy): a block is an opaque byte blob of one fixed size per store
(``block_bytes``: the KV of one block, every layer), named by its ``HASH_BYTES``-byte chained
prefix hash.

Both tiers are one ``FileTier`` each: one file per block, named by the key's hex, under a root
directory. The host tier's root lies under /dev/shm (tmpfs, so host memory shared by every
process of the node: a block one worker wrote, another reads); the disk tier's root is a local
directory. A block file:

    | b"EPKV" | version u16 | payload length u64 | key (16 B) | XXH3-128 of payload | payload |

little-endian. The digest catches a torn, truncated or bit-flipped payload (the key names the
block: chained blake2b over its tokens, ``block_pool.py``); XXH3 checks a block at memory speed
(about 25x blake2b's rate here), so a load costs its read, not its check. A writer writes a temp file and renames it into place, so a reader never sees
half a block; a reader checks every header field and the digest, and a bad file is a miss (the
file is removed). Recency is the file's mtime (a hit bumps it); capacity is counted in blocks
and shared by every process on the root: a lock file serialises puts and evictions between
processes and holds the shared count of block files.

``TieredStore`` writes blocks on a background thread into the top tier, demotes blocks the host
tier evicts to the disk tier, answers prefix lookups and loads, and logs stored/removed events
for the router's prefix index.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import math
import os
import queue
import shutil
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from io import FileIO
from pathlib import Path
from typing import Protocol

import xxhash

from epdserve.engine.block_pool import HASH_BYTES
from epdserve.engine.reload_rule import LOAD_TIERS
from epdserve.errors import ConfigError

__all__ = [
    "FORMAT_VERSION", "Buffer", "EventLog", "FileTier", "StoreEvent", "StoreStats", "TierStats",
    "TieredStore", "find_prefix", "measure_tier_bandwidth",
]

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview  # any C-contiguous buffer is accepted where this is named

FORMAT_VERSION = 2  # 1: blake2b-128 digests
_MAGIC = b"EPKV"
_HEADER = struct.Struct(f"<4sHQ{HASH_BYTES}s16s")  # magic, version, payload length, key, digest
_COUNT = struct.Struct("<Q")  # the lock file's content: number of block files in the root
_LOCK_NAME = ".lock"
_TMP_PREFIX = ".tmp-"  # temp files: .tmp-<pid>-<n>; every name starting with "." is not a block
_BENCH_PREFIX = ".bench-"  # measure_tier_bandwidth's scratch directories
_STALE_S = 60.0  # temp files and scratch directories older than this (seconds) are a crash's leftovers
_TMP_COUNTER = itertools.count()
TIER_NAMES = LOAD_TIERS  # ("host", "disk"): top tier first


def _digest(payload: memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def _byte_view(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _write_all(fd: int, views: list[memoryview]) -> None:
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views:
            views[0] = views[0][written:]


@dataclass(frozen=True, slots=True)
class StoreEvent:
    """Blocks that became readable from (``"stored"``) or left (``"removed"``) a tier."""

    kind: str  # "stored" | "removed"
    tier: str  # "host" | "disk"
    block_hashes: tuple[bytes, ...]


@dataclass
class TierStats:
    """One tier's counters since it was opened (blocks, except the byte counts)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # bad files found (each also a miss when a read found it) and removed
    stored: int = 0
    evicted: int = 0
    demoted: int = 0  # evicted blocks written to the tier below first
    bytes_read: int = 0
    bytes_written: int = 0


@dataclass
class StoreStats:
    """A snapshot of a ``TieredStore``: per-tier counters (None for a tier it lacks), writes."""

    host: TierStats | None
    disk: TierStats | None
    writes_pending: int  # submitted, not yet finished (the one being written included)
    writes_failed: int  # reads or puts that raised


class EventLog:
    """Thread-safe log of stored/removed blocks, handed out coalesced: each poll returns one
    event per run of equal (kind, tier), in the order they happened."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[str, str, bytes]] = []

    def record(self, kind: str, tier: str, keys: Sequence[bytes]) -> None:
        with self._lock:
            self._entries.extend((kind, tier, key) for key in keys)

    def poll(self) -> list[StoreEvent]:
        with self._lock:
            entries, self._entries = self._entries, []
        events: list[StoreEvent] = []
        for (kind, tier), run in itertools.groupby(entries, key=lambda e: (e[0], e[1])):
            events.append(StoreEvent(kind, tier, tuple(e[2] for e in run)))
        return events


class FileTier:
    """One tier: block files under ``root``, at most ``capacity_blocks`` of them (shared by every
    process that opens the same root), least recently used evicted first.

    Thread-safe; safe across processes. Never raises for a bad file: it is a miss."""

    def __init__(self, name: str, root: str | Path, capacity_blocks: int, block_bytes: int) -> None:
        if name not in TIER_NAMES:
            raise ConfigError(f"tier name must be one of {', '.join(TIER_NAMES)}, got {name!r}")
        for field_name, value in (("capacity_blocks", capacity_blocks), ("block_bytes", block_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} tier: {field_name} must be an integer >= 1, got {value!r}")
        self.name = name
        self.root = Path(root)
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.file_bytes = _HEADER.size + block_bytes
        # A full tier evicts down to capacity - slack, so it lists its directory about once per
        # capacity/64 puts rather than on every put.
        self._evict_slack = capacity_blocks // 64
        self.events = EventLog()  # a TieredStore shares one log between its tiers
        self._stats = TierStats()
        self._stats_lock = threading.Lock()
        # flock excludes other open files, not other threads on this one: a thread lock too.
        self._thread_lock = threading.Lock()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = os.open(self.root / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():
            self._remove_stale()
            self._write_count(len(self._list_blocks()))

    # -- paths, lock, shared count ------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        if len(key) != HASH_BYTES:
            raise ValueError(f"a block key is {HASH_BYTES} bytes, got {len(key)}")
        return self.root / key.hex()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            if self._lock_fd < 0:
                raise RuntimeError(f"{self.name} tier at {self.root} is closed")
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_count(self) -> int:  # under the lock
        raw = os.pread(self._lock_fd, _COUNT.size, 0)
        return _COUNT.unpack(raw)[0] if len(raw) == _COUNT.size else len(self._list_blocks())

    def _write_count(self, count: int) -> None:  # under the lock
        os.pwrite(self._lock_fd, _COUNT.pack(max(count, 0)), 0)

    def _list_blocks(self) -> list[os.DirEntry[str]]:
        with os.scandir(self.root) as entries:
            return [e for e in entries if not e.name.startswith(".") and len(e.name) == 2 * HASH_BYTES]

    def _remove_stale(self) -> None:
        cutoff = time.time() - _STALE_S
        with os.scandir(self.root) as entries:
            for entry in entries:
                try:
                    if entry.name.startswith(_TMP_PREFIX) and entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                    elif entry.name.startswith(_BENCH_PREFIX) and entry.stat().st_mtime < cutoff:
                        shutil.rmtree(entry.path, ignore_errors=True)
                except FileNotFoundError:
                    pass

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for field_name, delta in deltas.items():
                setattr(self._stats, field_name, getattr(self._stats, field_name) + delta)

    # -- reads --------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """Whether the tier holds ``key`` (one stat; the file is not checked)."""
        return self._path(key).exists()

    def get(self, key: bytes) -> bytes | None:
        """The block's payload; None when missing or bad (a bad file is removed). A hit makes the
        block the most recently used."""
        path = self._path(key)
        with self._open_checked(key, path) as opened:
            if opened is None:
                return None
            f, digest = opened
            data = f.readall()  # the rest: block_bytes, the size was checked
            if len(data) == self.block_bytes and _digest(memoryview(data)) == digest:
                self._hit(f)
                return data
            self._remove_corrupt(key, path, f)
            return None

    def get_into(self, key: bytes, out: memoryview) -> bool:
        """Read the block's payload into ``out`` (writable, ``block_bytes`` long); False when
        missing or bad (then ``out``'s contents are undefined)."""
        view = _byte_view(out)
        if view.readonly or view.nbytes != self.block_bytes:
            raise ValueError(f"out must be a writable buffer of {self.block_bytes} bytes")
        path = self._path(key)
        with self._open_checked(key, path) as opened:
            if opened is None:
                return False
            f, digest = opened
            filled = 0
            while filled < self.block_bytes:
                n = f.readinto(view[filled:])
                if not n:
                    break
                filled += n
            if filled == self.block_bytes and _digest(view) == digest:
                self._hit(f)
                return True
            self._remove_corrupt(key, path, f)
            return False

    @contextmanager
    def _open_checked(self, key: bytes, path: Path) -> Iterator[tuple[FileIO, bytes] | None]:
        """The open file past a header that checks out, with the payload's digest; None on a
        miss or a bad header (the file removed)."""
        try:
            f = open(path, "rb", buffering=0)  # closed below
        except FileNotFoundError:
            self._count(misses=1)
            yield None
            return
        try:
            header = f.read(_HEADER.size) if os.fstat(f.fileno()).st_size == self.file_bytes else b""
            if len(header) == _HEADER.size:
                magic, version, length, file_key, digest = _HEADER.unpack(header)
                if (magic, version, length, file_key) == (_MAGIC, FORMAT_VERSION, self.block_bytes, key):
                    yield f, digest
                    return
            self._remove_corrupt(key, path, f)
            yield None
        finally:
            f.close()

    def _hit(self, f: FileIO) -> None:
        os.utime(f.fileno())  # the inode just read: recency, even if it was replaced since
        self._count(hits=1, bytes_read=self.block_bytes)

    def _remove_corrupt(self, key: bytes, path: Path, f: FileIO) -> None:
        self._count(misses=1, corrupt=1)
        opened = os.fstat(f.fileno())
        with self._locked():
            try:
                current = os.stat(path)
            except FileNotFoundError:
                return
            if (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino):
                return  # replaced by a good write since it was opened
            os.unlink(path)
            self._write_count(self._read_count() - 1)
        log.warning("%s tier: removed corrupt block file %s", self.name, path.name)
        self.events.record("removed", self.name, (key,))

    # -- writes -------------------------------------------------------------------------------

    def put(self, key: bytes, payload: Buffer,
            on_evict: Callable[[bytes, bytes], None] | None = None) -> bool:
        """Store ``payload`` (exactly ``block_bytes``) as ``key``; True when written, False when
        the key was present (its recency is refreshed instead). Past capacity, least recently used
        blocks are evicted; ``on_evict(key, payload)`` is called for each readable victim before
        its file is removed (demotion; an OSError from it loses the block, nothing more)."""
        path = self._path(key)
        view = _byte_view(payload)
        if view.nbytes != self.block_bytes:
            raise ValueError(f"{self.name} tier: a block is {self.block_bytes} bytes, got {view.nbytes}")
        if self._refresh(path):
            return False
        header = _HEADER.pack(_MAGIC, FORMAT_VERSION, self.block_bytes, key, _digest(view))
        tmp = self.root / f"{_TMP_PREFIX}{os.getpid()}-{next(_TMP_COUNTER)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                _write_all(fd, [memoryview(header), view])
            finally:
                os.close(fd)
            with self._locked():
                if self._refresh(path):
                    return False
                os.replace(tmp, path)
                self._count(stored=1, bytes_written=self.file_bytes)
                self.events.record("stored", self.name, (key,))
                count = self._read_count() + 1
                try:
                    if count > self.capacity_blocks:
                        count = self._evict(keep=path.name, on_evict=on_evict)
                finally:
                    self._write_count(count)
            return True
        finally:
            if tmp.exists():
                tmp.unlink()

    def _refresh(self, path: Path) -> bool:
        try:
            os.utime(path)
        except FileNotFoundError:
            return False
        return True

    def _evict(self, keep: str, on_evict: Callable[[bytes, bytes], None] | None) -> int:
        """Under the lock: evict least recently used blocks (never ``keep``) down to capacity less
        the slack; returns the number of block files left."""
        aged = []
        for entry in self._list_blocks():
            try:
                aged.append((entry.stat().st_mtime_ns, entry.name))
            except FileNotFoundError:
                pass
        num_left = len(aged)
        num_victims = num_left - (self.capacity_blocks - self._evict_slack)
        aged.sort()
        victims = [name for _, name in aged if name != keep][:max(num_victims, 0)]
        for name in victims:
            key = bytes.fromhex(name)
            if on_evict is not None:
                payload = self._read_victim(key)
                if payload is not None:
                    try:
                        on_evict(key, payload)
                        self._count(demoted=1)
                    except OSError as e:
                        log.warning("%s tier: demoting block %s failed: %s", self.name, name, e)
            try:
                os.unlink(self.root / name)
            except FileNotFoundError:
                continue
            num_left -= 1
            self._count(evicted=1)
            self.events.record("removed", self.name, (key,))
        return num_left

    def _read_victim(self, key: bytes) -> bytes | None:
        """A victim's payload when it checks out (no recency bump, no hit counted, no lock taken)."""
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                raw = f.read(self.file_bytes + 1)
        except FileNotFoundError:
            return None
        if len(raw) != self.file_bytes:
            self._count(corrupt=1)
            return None
        magic, version, length, file_key, digest = _HEADER.unpack_from(raw)
        payload = raw[_HEADER.size:]
        if (magic, version, length, file_key) != (_MAGIC, FORMAT_VERSION, self.block_bytes, key) \
                or _digest(memoryview(payload)) != digest:
            self._count(corrupt=1)
            return None
        return payload

    # -- housekeeping -------------------------------------------------------------------------

    def num_blocks(self) -> int:
        """Block files in the root now (lists the directory)."""
        return len(self._list_blocks())

    def stats(self) -> TierStats:
        with self._stats_lock:
            return replace(self._stats)

    def clear(self) -> None:
        """Remove every block file (a removed event for each)."""
        removed = []
        with self._locked():
            for entry in self._list_blocks():
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue
                removed.append(bytes.fromhex(entry.name))
            self._write_count(0)
        self.events.record("removed", self.name, removed)

    def close(self) -> None:
        with self._thread_lock:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def remove_root(self) -> None:
        """Close and delete the root with every block in it (the launcher that made a host tier
        does this at exit)."""
        self.close()
        shutil.rmtree(self.root, ignore_errors=True)


_STOP = object()


class TieredStore:
    """The tiers below a worker's page pool: host over disk, either optional, not both.

    Writes go to the top tier on one daemon thread; blocks the host tier evicts are demoted to
    the disk tier. Every submitted write is reported once by ``poll_written`` when done."""

    def __init__(self, host: FileTier | None, disk: FileTier | None) -> None:
        if host is None and disk is None:
            raise ConfigError("a KV store needs a host tier, a disk tier or both")
        for expected, tier in (("host", host), ("disk", disk)):
            if tier is not None and tier.name != expected:
                raise ConfigError(f"the {expected} tier is named {tier.name!r}")
        if host is not None and disk is not None:
            if host.block_bytes != disk.block_bytes:
                raise ConfigError(f"host and disk tiers differ in block_bytes: "
                                  f"{host.block_bytes} vs {disk.block_bytes}")
            if host.root.resolve() == disk.root.resolve():
                raise ConfigError(f"host and disk tiers share a root: {host.root}")
        self.host = host
        self.disk = disk
        self.tiers = tuple(t for t in (host, disk) if t is not None)  # top first
        self.top = self.tiers[0]
        self.block_bytes = self.top.block_bytes
        self._events = EventLog()
        for tier in self.tiers:
            tier.events = self._events
        self._cond = threading.Condition()
        self._queued: set[bytes] = set()  # submitted and not finished, the one being written included
        self._written: list[bytes] = []
        self._num_failed = 0
        self._is_closing = False
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        self._thread.start()

    def _tier(self, name: str) -> FileTier | None:
        if name not in TIER_NAMES:
            raise ValueError(f"unknown tier {name!r} (tiers: {', '.join(TIER_NAMES)})")
        return self.host if name == "host" else self.disk

    # -- writes -------------------------------------------------------------------------------

    def submit_write(self, key: bytes, read: Callable[[], Buffer]) -> bool:
        """Queue ``key`` for the top tier; the writer thread calls ``read()`` for its bytes. Never
        blocks. False when skipped (already queued, already in the top tier, or the store is
        closing): then ``read`` is not called and ``poll_written`` will not report the key."""
        with self._cond:
            if self._is_closing or key in self._queued:
                return False
            if self.top.contains(key):
                return False
            self._queued.add(key)
        self._queue.put((key, read))
        return True

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            key, read = item
            try:
                if not self._is_closing and not self.top.contains(key):
                    self.top.put(key, read(), on_evict=self._demote if self.top is self.host else None)
            except Exception:
                log.exception("KV store: writing block %s failed", key.hex())
                with self._cond:
                    self._num_failed += 1
            with self._cond:
                self._queued.discard(key)
                self._written.append(key)
                self._cond.notify_all()

    def _demote(self, key: bytes, payload: bytes) -> None:
        if self.disk is not None:
            self.disk.put(key, payload)

    def poll_written(self) -> list[bytes]:
        """Keys whose write finished (stored, skipped or failed) since the last poll."""
        with self._cond:
            written, self._written = self._written, []
        return written

    def poll_events(self) -> list[StoreEvent]:
        """Stored/removed events since the last poll, one per run of equal (kind, tier), in order."""
        return self._events.poll()

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for every submitted write to finish; whether they did."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued, timeout=timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the writer (queued writes not yet started are dropped, reported as done) and close
        the tiers. Waits at most ``timeout_s`` seconds for a write in progress."""
        with self._cond:
            self._is_closing = True
        self._queue.put(_STOP)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.warning("KV store: the writer thread did not stop within %.1f s", timeout_s)
        for tier in self.tiers:
            tier.close()

    # -- reads --------------------------------------------------------------------------------

    def find_prefix(self, keys: Sequence[bytes]) -> list[str]:
        """The tier of each leading key found (``find_prefix``)."""
        return find_prefix(self.tiers, keys)

    def load(self, key: bytes, tier: str) -> bytes | None:
        """The block from ``tier``; None on a miss, a bad file or a tier the store lacks."""
        source = self._tier(tier)
        return source.get(key) if source is not None else None

    def load_into(self, key: bytes, tier: str, out: memoryview) -> bool:
        """Read the block from ``tier`` into ``out`` (``block_bytes``); False as ``load``'s None."""
        source = self._tier(tier)
        return source.get_into(key, out) if source is not None else False

    def stats(self) -> StoreStats:
        with self._cond:
            num_pending, num_failed = len(self._queued), self._num_failed
        return StoreStats(self.host.stats() if self.host is not None else None,
                          self.disk.stats() if self.disk is not None else None, num_pending, num_failed)


def measure_tier_bandwidth(tier: FileTier, num_blocks: int = 32) -> tuple[float, float]:
    """(read bytes per second, seconds of latency per load) of ``tier``'s medium: blocks written
    to a scratch directory in its root (the tier's blocks and capacity are left alone), dropped
    from the page cache where the OS allows, then read back with ``get_into``. Fit of
    t(n) = latency + n * block_bytes / bandwidth on single-block reads and one ``num_blocks`` run."""
    num_blocks = max(num_blocks, 2)
    num_singles = 3  # single-block reads, the fastest kept
    scratch = FileTier(tier.name, tier.root / f"{_BENCH_PREFIX}{os.getpid()}-{next(_TMP_COUNTER)}",
                       num_blocks + num_singles, tier.block_bytes)
    try:
        payload = os.urandom(tier.block_bytes)
        keys = [os.urandom(HASH_BYTES) for _ in range(num_blocks + num_singles)]
        for key in keys:
            scratch.put(key, payload)
        if hasattr(os, "posix_fadvise"):
            for key in keys:
                fd = os.open(scratch._path(key), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        out = memoryview(bytearray(tier.block_bytes))
        single_s = math.inf
        for key in keys[num_blocks:]:
            start = time.perf_counter()
            scratch.get_into(key, out)
            single_s = min(single_s, time.perf_counter() - start)
        start = time.perf_counter()
        for key in keys[:num_blocks]:
            scratch.get_into(key, out)
        run_s = time.perf_counter() - start
    finally:
        scratch.remove_root()
    per_block_s = (run_s - single_s) / (num_blocks - 1)
    if not per_block_s > 0:  # noise swamped the slope: charge it all to bandwidth
        per_block_s = run_s / num_blocks
    bytes_per_s = min(max(tier.block_bytes / per_block_s, 1e3), 1e13)
    latency_s = min(max(single_s - per_block_s, 1e-7), 1.0)
    return bytes_per_s, latency_s


class _NamedTier(Protocol):
    name: str

    def contains(self, key: bytes) -> bool: ...


def find_prefix(tiers: Sequence[_NamedTier], keys: Sequence[bytes]) -> list[str]:
    """The tier of each leading key found in ``tiers`` (top first): a run on host, then a run
    on disk (the walk only moves down a tier), ending at the first key the current tier and
    those below lack. The store and the simulator's model of it (``sim/kv_tiers.py``) walk so."""
    found: list[str] = []
    level = 0
    for key in keys:
        while level < len(tiers) and not tiers[level].contains(key):
            level += 1
        if level == len(tiers):
            break
        found.append(tiers[level].name)
    return found
