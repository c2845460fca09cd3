"""The tiered KV block store: file format and integrity checks, LRU capacity shared across
processes, the background writer, host-to-disk demotion, prefix lookups and the bandwidth probe.
Plain files under tmp_path (disk tier) and a fresh /dev/shm directory per test (host tier)."""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
import struct
import threading
import uuid
from pathlib import Path

import pytest

from epdserve.engine.block_pool import HASH_BYTES
from epdserve.engine.kv_store import (
    EventLog,
    FileTier,
    StoreEvent,
    TieredStore,
    measure_tier_bandwidth,
)
from epdserve.errors import ConfigError

BLOCK_BYTES = 4096
HEADER_BYTES = struct.calcsize("<4sHQ16s16s")
KEY_OFFSET = 4 + 2 + 8  # magic, version, payload length
WAIT_S = 10.0  # bound on every wait for the writer thread or a child process


def key_of(i: int) -> bytes:
    return i.to_bytes(HASH_BYTES, "little")


def payload_of(i: int, size: int = BLOCK_BYTES) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


@pytest.fixture
def shm_root() -> Path:
    root = Path("/dev/shm") / f"epdserve-test-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def disk_root(tmp_path: Path) -> Path:
    return tmp_path / "disk"


def set_mtime(tier: FileTier, key: bytes, when: float) -> None:
    os.utime(tier.root / key.hex(), (when, when))


# -- FileTier ---------------------------------------------------------------------------------

def test_put_get_round_trip_bytes_and_memoryview(shm_root: Path) -> None:
    tier = FileTier("host", shm_root, 8, BLOCK_BYTES)
    assert tier.put(key_of(1), payload_of(1))
    assert tier.put(key_of(2), memoryview(bytearray(payload_of(2))))
    assert tier.put(key_of(3), memoryview(bytearray(payload_of(3))).cast("B", (64, BLOCK_BYTES // 64)))
    assert tier.get(key_of(1)) == payload_of(1)
    assert tier.get(key_of(2)) == payload_of(2)
    assert tier.get(key_of(3)) == payload_of(3)
    assert tier.get(key_of(4)) is None
    assert tier.contains(key_of(1)) and not tier.contains(key_of(4))
    assert os.stat(shm_root).st_mode & 0o777 == 0o700
    assert sorted(os.listdir(shm_root)) == sorted([".lock"] + [key_of(i).hex() for i in (1, 2, 3)])
    stats = tier.stats()
    assert (stats.stored, stats.hits, stats.misses, stats.corrupt) == (3, 3, 1, 0)
    assert stats.bytes_read == 3 * BLOCK_BYTES
    assert tier.events.poll() == [StoreEvent("stored", "host", (key_of(1), key_of(2), key_of(3)))]
    tier.remove_root()
    assert not shm_root.exists()


def test_get_into_fills_the_buffer(disk_root: Path) -> None:
    tier = FileTier("disk", disk_root, 4, BLOCK_BYTES)
    tier.put(key_of(1), payload_of(1))
    out = bytearray(BLOCK_BYTES)
    assert tier.get_into(key_of(1), memoryview(out))
    assert bytes(out) == payload_of(1)
    assert not tier.get_into(key_of(2), memoryview(out))
    with pytest.raises(ValueError):
        tier.get_into(key_of(1), memoryview(bytearray(BLOCK_BYTES - 1)))
    with pytest.raises(ValueError):
        tier.get_into(key_of(1), memoryview(bytes(BLOCK_BYTES)))  # read-only
    tier.close()


def test_bad_put_raises(disk_root: Path) -> None:
    tier = FileTier("disk", disk_root, 4, BLOCK_BYTES)
    with pytest.raises(ValueError):
        tier.put(key_of(1), b"x" * (BLOCK_BYTES + 1))
    with pytest.raises(ValueError):
        tier.put(b"short", payload_of(1))
    assert tier.num_blocks() == 0
    assert [name for name in os.listdir(disk_root) if name.startswith(".tmp-")] == []
    tier.close()


def test_put_of_a_present_key_refreshes_it(disk_root: Path) -> None:
    tier = FileTier("disk", disk_root, 4, BLOCK_BYTES)
    assert tier.put(key_of(1), payload_of(1))
    set_mtime(tier, key_of(1), 1000.0)
    assert not tier.put(key_of(1), payload_of(1))
    assert os.stat(disk_root / key_of(1).hex()).st_mtime > 1000.0
    assert tier.stats().stored == 1
    assert tier.events.poll() == [StoreEvent("stored", "disk", (key_of(1),))]
    tier.close()


def test_lru_eviction_respects_get_bumps(disk_root: Path) -> None:
    tier = FileTier("disk", disk_root, 3, BLOCK_BYTES)
    for i, when in ((1, 1000.0), (2, 2000.0), (3, 3000.0)):
        tier.put(key_of(i), payload_of(i))
        set_mtime(tier, key_of(i), when)
    assert tier.get(key_of(1)) == payload_of(1)  # now the most recently used
    tier.put(key_of(4), payload_of(4))
    assert [tier.contains(key_of(i)) for i in (1, 2, 3, 4)] == [True, False, True, True]
    tier.put(key_of(5), payload_of(5))
    assert [tier.contains(key_of(i)) for i in (1, 2, 3, 4, 5)] == [True, False, False, True, True]
    assert tier.num_blocks() == 3
    assert tier.stats().evicted == 2
    assert tier.events.poll() == [
        StoreEvent("stored", "disk", (key_of(1), key_of(2), key_of(3), key_of(4))),
        StoreEvent("removed", "disk", (key_of(2),)),
        StoreEvent("stored", "disk", (key_of(5),)),
        StoreEvent("removed", "disk", (key_of(3),)),
    ]
    tier.close()


def test_capacity_is_shared_by_tiers_on_one_root(shm_root: Path) -> None:
    first = FileTier("host", shm_root, 2, BLOCK_BYTES)
    second = FileTier("host", shm_root, 2, BLOCK_BYTES)  # as another process would open it
    first.put(key_of(1), payload_of(1))
    set_mtime(first, key_of(1), 1000.0)
    second.put(key_of(2), payload_of(2))
    set_mtime(second, key_of(2), 2000.0)
    assert second.get(key_of(1)) == payload_of(1)  # bumped: key 2 is now the oldest
    first.put(key_of(3), payload_of(3))
    assert first.num_blocks() == 2
    assert second.contains(key_of(1)) and second.contains(key_of(3)) and not second.contains(key_of(2))
    second.put(key_of(4), payload_of(4))
    assert first.num_blocks() == 2
    assert second.stats().evicted == 1 and first.stats().evicted == 1
    first.close()
    second.close()


def _put_in_child(root: str, key: bytes, payload: bytes) -> None:
    tier = FileTier("host", root, 2, len(payload))
    tier.put(key, payload)
    tier.close()


def test_block_written_by_another_process_is_read(shm_root: Path) -> None:
    tier = FileTier("host", shm_root, 2, BLOCK_BYTES)
    tier.put(key_of(1), payload_of(1))
    set_mtime(tier, key_of(1), 1000.0)
    tier.put(key_of(2), payload_of(2))
    child = multiprocessing.get_context("spawn").Process(
        target=_put_in_child, args=(str(shm_root), key_of(3), payload_of(3)))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        child.join(timeout=WAIT_S)
    assert child.exitcode == 0
    assert tier.get(key_of(3)) == payload_of(3)
    assert not tier.contains(key_of(1))  # the child evicted the oldest to stay within capacity
    assert tier.num_blocks() == 2
    tier.close()


CORRUPTIONS = {
    "truncated": lambda raw: raw[: HEADER_BYTES + BLOCK_BYTES // 2],
    "header only": lambda raw: raw[:HEADER_BYTES],
    "trailing bytes": lambda raw: raw + b"\0",
    "payload byte flipped": lambda raw: raw[:-1] + bytes([raw[-1] ^ 0xFF]),
    "key flipped": lambda raw: raw[:KEY_OFFSET] + bytes([raw[KEY_OFFSET] ^ 0x01]) + raw[KEY_OFFSET + 1:],
    "bad magic": lambda raw: b"XXXX" + raw[4:],
    "bad version": lambda raw: raw[:4] + struct.pack("<H", 99) + raw[6:],
    "empty": lambda raw: b"",
}


@pytest.mark.parametrize("reader", ["get", "get_into"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_file_is_a_counted_miss_and_removed(disk_root: Path, corruption: str, reader: str) -> None:
    tier = FileTier("disk", disk_root, 4, BLOCK_BYTES)
    tier.put(key_of(1), payload_of(1))
    tier.events.poll()
    path = disk_root / key_of(1).hex()
    path.write_bytes(CORRUPTIONS[corruption](path.read_bytes()))
    if reader == "get":
        assert tier.get(key_of(1)) is None
    else:
        assert not tier.get_into(key_of(1), memoryview(bytearray(BLOCK_BYTES)))
    assert not path.exists()
    stats = tier.stats()
    assert (stats.corrupt, stats.misses, stats.hits) == (1, 1, 0)
    assert tier.events.poll() == [StoreEvent("removed", "disk", (key_of(1),))]
    assert tier.put(key_of(1), payload_of(1))  # the shared count went back down with the file
    assert tier.get(key_of(1)) == payload_of(1)
    tier.close()


def test_stale_temp_files_are_removed_on_open_and_never_counted(disk_root: Path) -> None:
    disk_root.mkdir()
    stale, fresh = disk_root / ".tmp-1-1", disk_root / ".tmp-1-2"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    os.utime(stale, (1000.0, 1000.0))
    tier = FileTier("disk", disk_root, 1, BLOCK_BYTES)
    assert not stale.exists() and fresh.exists()
    assert tier.num_blocks() == 0
    tier.put(key_of(1), payload_of(1))
    assert tier.num_blocks() == 1 and tier.stats().evicted == 0
    tier.close()


def test_clear_removes_every_block(disk_root: Path) -> None:
    tier = FileTier("disk", disk_root, 4, BLOCK_BYTES)
    tier.put(key_of(1), payload_of(1))
    tier.put(key_of(2), payload_of(2))
    tier.events.poll()
    tier.clear()
    assert tier.num_blocks() == 0
    [event] = tier.events.poll()
    assert (event.kind, event.tier) == ("removed", "disk")
    assert sorted(event.block_hashes) == [key_of(1), key_of(2)]  # in the file system's listing order
    tier.put(key_of(3), payload_of(3))
    assert tier.num_blocks() == 1
    tier.close()


def test_event_log_coalesces_runs_in_order() -> None:
    events = EventLog()
    events.record("stored", "host", [key_of(1), key_of(2)])
    events.record("stored", "host", [key_of(3)])
    events.record("stored", "disk", [key_of(1)])
    events.record("removed", "host", [key_of(1)])
    events.record("stored", "host", [key_of(4)])
    assert events.poll() == [
        StoreEvent("stored", "host", (key_of(1), key_of(2), key_of(3))),
        StoreEvent("stored", "disk", (key_of(1),)),
        StoreEvent("removed", "host", (key_of(1),)),
        StoreEvent("stored", "host", (key_of(4),)),
    ]
    assert events.poll() == []


@pytest.mark.parametrize(
    "make",
    [
        lambda shm, disk: FileTier("host", shm, 0, BLOCK_BYTES),
        lambda shm, disk: FileTier("host", shm, 4, 0),
        lambda shm, disk: FileTier("pool", shm, 4, BLOCK_BYTES),
        lambda shm, disk: TieredStore(None, None),
        lambda shm, disk: TieredStore(FileTier("host", shm, 4, BLOCK_BYTES), FileTier("disk", disk, 4, 512)),
        lambda shm, disk: TieredStore(FileTier("disk", disk, 4, BLOCK_BYTES), None),
    ],
    ids=["capacity 0", "block_bytes 0", "bad name", "no tiers", "block sizes differ", "tier in wrong slot"],
)
def test_bad_config_raises(shm_root: Path, disk_root: Path, make) -> None:
    with pytest.raises(ConfigError):
        make(shm_root, disk_root)


# -- TieredStore ------------------------------------------------------------------------------

@pytest.fixture
def store(shm_root: Path, disk_root: Path) -> TieredStore:
    host = FileTier("host", shm_root, 2, BLOCK_BYTES)
    store = TieredStore(host, FileTier("disk", disk_root, 8, BLOCK_BYTES))
    yield store
    store.close(timeout_s=WAIT_S)


def test_writer_thread_stores_and_reports(store: TieredStore) -> None:
    assert store.submit_write(key_of(1), lambda: payload_of(1))
    assert store.submit_write(key_of(2), lambda: memoryview(bytearray(payload_of(2))))
    assert store.flush(WAIT_S)
    assert sorted(store.poll_written()) == [key_of(1), key_of(2)]
    assert store.poll_written() == []
    assert store.load(key_of(1), "host") == payload_of(1)
    out = bytearray(BLOCK_BYTES)
    assert store.load_into(key_of(2), "host", memoryview(out)) and bytes(out) == payload_of(2)
    assert store.load(key_of(1), "disk") is None
    assert store.poll_events() == [StoreEvent("stored", "host", (key_of(1), key_of(2)))]
    stats = store.stats()
    assert stats.host.stored == 2 and stats.host.hits == 2 and stats.disk.misses == 1
    assert (stats.writes_pending, stats.writes_failed) == (0, 0)
    with pytest.raises(ValueError):
        store.load(key_of(1), "pool")


def test_present_or_queued_key_is_not_read_again(store: TieredStore) -> None:
    calls: list[int] = []
    store.host.put(key_of(1), payload_of(1))
    assert not store.submit_write(key_of(1), lambda: calls.append(1) or payload_of(1))
    release = threading.Event()

    def slow_read() -> bytes:
        assert release.wait(WAIT_S)
        return payload_of(2)

    assert store.submit_write(key_of(2), slow_read)
    assert not store.submit_write(key_of(2), lambda: calls.append(2) or payload_of(2))
    assert store.stats().writes_pending == 1
    release.set()
    assert store.flush(WAIT_S)
    assert store.poll_written() == [key_of(2)]
    assert calls == []
    assert store.load(key_of(2), "host") == payload_of(2)


def test_failed_read_does_not_stop_the_writer(store: TieredStore) -> None:
    def broken_read() -> bytes:
        raise RuntimeError("device gone")

    assert store.submit_write(key_of(1), broken_read)
    assert store.submit_write(key_of(2), lambda: b"short")  # the put raises
    assert store.submit_write(key_of(3), lambda: payload_of(3))
    assert store.flush(WAIT_S)
    assert store.poll_written() == [key_of(1), key_of(2), key_of(3)]
    assert store.stats().writes_failed == 2
    assert store.find_prefix([key_of(3)]) == ["host"]
    assert not store.host.contains(key_of(1)) and not store.host.contains(key_of(2))
    assert store.submit_write(key_of(1), lambda: payload_of(1))  # a failed key may be written again
    assert store.flush(WAIT_S) and store.load(key_of(1), "host") == payload_of(1)


def test_host_eviction_demotes_to_disk(store: TieredStore) -> None:
    for i, when in ((1, 1000.0), (2, 2000.0)):
        store.submit_write(key_of(i), lambda i=i: payload_of(i))
        assert store.flush(WAIT_S)
        set_mtime(store.host, key_of(i), when)
    store.submit_write(key_of(3), lambda: payload_of(3))
    assert store.flush(WAIT_S)
    assert not store.host.contains(key_of(1))
    assert store.load(key_of(1), "disk") == payload_of(1)
    assert store.find_prefix([key_of(1), key_of(2), key_of(3)]) == ["disk"]
    assert store.find_prefix([key_of(2), key_of(3), key_of(1)]) == ["host", "host", "disk"]
    assert store.poll_events() == [
        StoreEvent("stored", "host", (key_of(1), key_of(2), key_of(3))),
        StoreEvent("stored", "disk", (key_of(1),)),
        StoreEvent("removed", "host", (key_of(1),)),
    ]
    stats = store.stats()
    assert (stats.host.evicted, stats.host.demoted, stats.disk.stored) == (1, 1, 1)


def test_corrupt_host_victim_is_dropped_not_demoted(store: TieredStore) -> None:
    for i, when in ((1, 1000.0), (2, 2000.0)):
        store.host.put(key_of(i), payload_of(i))
        set_mtime(store.host, key_of(i), when)
    path = store.host.root / key_of(1).hex()
    raw = path.read_bytes()
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 0xFF]))
    os.utime(path, (1000.0, 1000.0))
    assert store.submit_write(key_of(3), lambda: payload_of(3))
    assert store.flush(WAIT_S)
    assert not store.host.contains(key_of(1)) and not store.disk.contains(key_of(1))
    stats = store.stats()
    assert (stats.host.evicted, stats.host.demoted, stats.host.corrupt) == (1, 0, 1)


def test_find_prefix_walks_host_then_disk(shm_root: Path, disk_root: Path) -> None:
    host = FileTier("host", shm_root, 16, BLOCK_BYTES)
    disk = FileTier("disk", disk_root, 16, BLOCK_BYTES)
    store = TieredStore(host, disk)
    for i in (0, 1, 2, 4, 7):
        host.put(key_of(i), payload_of(i))
    for i in (2, 3, 5, 6, 8):
        disk.put(key_of(i), payload_of(i))
    keys = [key_of(i) for i in range(9)]
    assert store.find_prefix(keys) == ["host", "host", "host", "disk"]  # key 4 on host only: end
    assert store.find_prefix(keys[5:]) == ["disk", "disk"]  # key 7 on host only, after the disk run
    assert store.find_prefix([key_of(0), key_of(9), key_of(1)]) == ["host"]  # a gap ends the walk
    assert store.find_prefix([key_of(9)]) == []
    assert store.find_prefix([]) == []
    store.close(timeout_s=WAIT_S)

    disk_only = TieredStore(None, FileTier("disk", disk_root, 16, BLOCK_BYTES))
    assert disk_only.find_prefix(keys[2:]) == ["disk", "disk"]
    assert disk_only.load(key_of(0), "host") is None
    assert disk_only.submit_write(key_of(9), lambda: payload_of(9))
    assert disk_only.flush(WAIT_S) and disk_only.load(key_of(9), "disk") == payload_of(9)
    disk_only.close(timeout_s=WAIT_S)


def test_flush_and_close_are_bounded(shm_root: Path) -> None:
    store = TieredStore(FileTier("host", shm_root, 4, BLOCK_BYTES), None)
    started, release = threading.Event(), threading.Event()
    calls: list[int] = []

    def stuck_read() -> bytes:
        started.set()
        release.wait(WAIT_S)
        return payload_of(1)

    store.submit_write(key_of(1), stuck_read)
    store.submit_write(key_of(2), lambda: calls.append(2) or payload_of(2))
    assert started.wait(WAIT_S)
    assert not store.flush(0.01)
    store.close(timeout_s=0.01)  # returns with the writer still inside read()
    assert not store.submit_write(key_of(3), lambda: payload_of(3))
    release.set()
    store._thread.join(WAIT_S)
    assert not store._thread.is_alive()
    assert calls == []  # the write not yet started was dropped
    assert store.poll_written() == [key_of(1), key_of(2)]
    assert store.stats().writes_failed == 1  # the tier was closed under the stuck write


# -- measure_tier_bandwidth -------------------------------------------------------------------

@pytest.mark.parametrize("name", ["host", "disk"])
def test_measure_tier_bandwidth(shm_root: Path, disk_root: Path, name: str) -> None:
    tier = FileTier(name, shm_root if name == "host" else disk_root, 4, 64 * 1024)
    tier.put(key_of(1), payload_of(1, 64 * 1024))
    bytes_per_s, latency_s = measure_tier_bandwidth(tier, num_blocks=8)
    assert math.isfinite(bytes_per_s) and bytes_per_s > 0
    assert math.isfinite(latency_s) and latency_s > 0
    assert tier.num_blocks() == 1 and tier.contains(key_of(1))
    assert sorted(os.listdir(tier.root)) == [".lock", key_of(1).hex()]
    assert tier.stats().evicted == 0
    tier.close()


# -- KVOffload: an engine's pages over the store -----------------------------------------------

def _offload(disk_root: Path, num_layers: int = 3):
    import torch

    from epdserve.config import TierOptions
    from epdserve.engine.block_pool import BlockPool
    from epdserve.engine.kv_offload import KVOffload
    from epdserve.engine.reload_rule import PrefillRate

    gen = torch.Generator().manual_seed(0)
    # one tensor per layer: [2, num_blocks, block_size, heads, head_dim]
    kv = [torch.randn(2, 8, 4, 2, 8, generator=gen).to(torch.bfloat16) for _ in range(num_layers)]
    options = TierOptions(disk_gib=0.001, disk_dir=str(disk_root), disk_read_gbps=1000.0)  # the rule loads
    return kv, KVOffload.open(options, "test-model", kv, BlockPool(8, True), 4, PrefillRate())


def test_offload_loads_written_blocks_into_other_pages_layer_by_layer(disk_root: Path) -> None:
    """Blocks gathered from pages 1 and 2 (every layer's K and V) come back byte for byte into
    pages 5 and 6 of every layer; a corrupt block ends the load there (the rest is computed)."""
    kv, offload = _offload(disk_root)
    keys = [key_of(1), key_of(2), key_of(3)]
    try:
        for key, page in zip(keys, (1, 2, 3)):
            assert offload.store.submit_write(key, lambda p=page: offload._gather(p))
        assert offload.store.flush(WAIT_S)
        load = offload.plan_load(keys[:2], num_cached_tokens=0)
        assert load is not None and load.num_blocks == 2 and load.num_disk_blocks == 2
        other = offload.plan_load(keys[2:], num_cached_tokens=8)  # a second request in the same step
        load.block_ids, other.block_ids = [5, 6], [4]
        offload.apply([load, other])
        for layer in kv:
            assert layer[:, 5].equal(layer[:, 1]) and layer[:, 6].equal(layer[:, 2]) and layer[:, 4].equal(layer[:, 3])
        assert offload.num_loaded_blocks == {"host": 0, "disk": 3}
        # The second block's file corrupted: the load stops after the first.
        path = offload.store.disk.root / keys[1].hex()
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
        load = offload.plan_load(keys, num_cached_tokens=0)
        assert load.num_chosen_blocks == 3 and load.num_blocks == 1 and offload.num_load_failures == 1
        load.block_ids = [7]
        offload.apply([load])
        assert all(layer[:, 7].equal(layer[:, 1]) for layer in kv)
    finally:
        offload.close()
