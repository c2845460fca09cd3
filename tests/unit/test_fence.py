"""The KV write fence: a write of a reservation that has ended never lands, over TCP (the
receiver checks) and shared memory (the writer checks the owner's array). Real sockets and
shared-memory segments, no model."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from epdserve.auth import new_key
from epdserve.transfer.connector import ShmLink
from epdserve.transfer.descriptors import KVEndpoint
from epdserve.transfer.fence import ReservationFence
from epdserve.transfer.shm_pool import SharedKVPool
from epdserve.transfer.tcp import TcpKVReceiver, TcpKVSender

NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM, LAYERS = 8, 4, 2, 8, 3
KEY = new_key()


def _slots(block_ids: list[int]) -> torch.Tensor:
    return torch.tensor([b * BLOCK_SIZE + i for b in block_ids for i in range(BLOCK_SIZE)], dtype=torch.long)


def _kv(value: float, num_tokens: int) -> torch.Tensor:
    return torch.full((2, num_tokens, HEADS, DIM), value)


def test_generations_are_unique_and_close_only_its_own_blocks():
    fence = ReservationFence(num_groups=2, num_blocks=NUM_BLOCKS)
    g1 = fence.open([[0, 1], [2]])
    g2 = fence.open([[3], [4, 5]])
    assert g1 != g2 and fence.is_open(g1) and fence.is_open(g2)
    assert fence.admits(g1, 0, np.array([0, 1])) and fence.admits(g1, 1, np.array([2]))
    assert not fence.admits(g1, 0, np.array([0, 3]))  # a block of another reservation
    assert not fence.admits(g1, 0, np.array([NUM_BLOCKS]))  # outside the pool
    assert not fence.admits(g1, 2, np.array([0]))  # no such group
    fence.close(g1)
    assert not fence.is_open(g1) and not fence.admits(g1, 0, np.array([0]))
    assert fence.admits(g2, 1, np.array([4, 5]))  # untouched
    g3 = fence.open([[0, 1], []])  # the same blocks again: a new generation
    assert not fence.admits(g1, 0, np.array([0])) and fence.admits(g3, 0, np.array([0, 1]))
    fence.close(g1)  # closing twice does nothing
    assert fence.admits(g3, 0, np.array([0, 1]))


@pytest.fixture
def tcp_pair():
    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM) for _ in range(LAYERS)]
    fence = ReservationFence(1, NUM_BLOCKS)
    landed: list[str] = []
    event = threading.Event()

    def on_landed(request_id: str) -> None:
        landed.append(request_id)
        event.set()

    receiver = TcpKVReceiver(caches, on_landed, fence, [0] * LAYERS, KEY)
    sender = TcpKVSender(receiver.host, receiver.port, KEY)
    yield caches, fence, receiver, sender, landed, event
    sender.close()
    receiver.close()


def _flush(sender: TcpKVSender, event: threading.Event, request_id: str, generation: int) -> None:
    """Frames on one connection land in order: an end marker after them means they landed
    (or were refused)."""
    event.clear()
    sender.finish(request_id, generation)
    assert event.wait(10), "end marker not seen"


def test_tcp_late_write_of_an_expired_reservation_is_refused(tcp_pair):
    caches, fence, receiver, sender, landed, event = tcp_pair
    blocks = [2, 3]
    g_old = fence.open([blocks], "a")
    sender.write("a", g_old, 0, 0, _kv(1.0, 8), _slots(blocks), np.array(blocks))
    _flush(sender, event, "a", g_old)
    assert landed == ["a"] and float(caches[0][:, 2:4].min()) == 1.0
    fence.close(g_old)  # expired: the blocks go to another request
    g_new = fence.open([blocks], "b")
    sender.write("b", g_new, 0, 0, _kv(2.0, 8), _slots(blocks), np.array(blocks))
    _flush(sender, event, "b", g_new)
    # The late write of "a" (old generation) and one naming a block outside the reservation.
    sender.write("a", g_old, 0, 0, _kv(9.0, 8), _slots(blocks), np.array(blocks))
    sender.write("b", g_new, 1, 0, _kv(9.0, 4), _slots([5]), np.array([5]))
    _flush(sender, event, "b", g_new)
    assert float(caches[0][:, 2:4].min()) == 2.0 and float(caches[0][:, 2:4].max()) == 2.0
    assert float(caches[1].abs().max()) == 0.0
    assert receiver.num_refused_frames == 2
    # The end marker of a closed reservation does not count as landed.
    fence.close(g_new)
    landed.clear()
    event.clear()
    sender.finish("b", g_new)
    sender.finish("c", fence.open([[6]], "c"))
    assert event.wait(10)
    assert landed == ["c"]  # in order on one connection: "b"'s marker was read first


def test_shm_writer_checks_the_owner_fence():
    pool = SharedKVPool.create(NUM_BLOCKS, BLOCK_SIZE, [(HEADS, DIM)] * LAYERS, torch.float32)
    fence = ReservationFence(1, NUM_BLOCKS, shm=True)
    endpoint = KVEndpoint(**{**_endpoint_fields(pool.endpoint()), "fence_shm_name": fence.shm_name})
    link = ShmLink(endpoint)
    try:
        blocks = [1, 2]
        g_old = fence.open([blocks])
        assert link.write("a", g_old, 0, 0, _kv(1.0, 8), _slots(blocks), np.array(blocks))
        fence.close(g_old)
        g_new = fence.open([blocks])
        assert link.write("b", g_new, 0, 0, _kv(2.0, 8), _slots(blocks), np.array(blocks))
        assert not link.write("a", g_old, 0, 0, _kv(9.0, 8), _slots(blocks), np.array(blocks))
        assert not link.write("b", g_new, 0, 0, _kv(9.0, 4), _slots([4]), np.array([4]))
        layer = pool.layers[0]
        assert float(layer[:, 1:3].min()) == 2.0 and float(layer[:, 1:3].max()) == 2.0
        assert float(layer[:, 4].abs().max()) == 0.0 and link.num_refused_writes == 2
    finally:
        link.close()
        fence.close_all()
        pool.close()


def _endpoint_fields(endpoint: KVEndpoint) -> dict:
    return {f: getattr(endpoint, f) for f in endpoint.__struct_fields__}


def test_segments_of_a_dead_process_are_found_by_its_pid(tmp_path):
    from epdserve.transfer.segments import unlink_segments_of

    names = ["epdserve-kv-123-ab12cd34", "epdserve-kv-rank-123-00ff00ff", "epdserve-fence-123-1a2b3c4d",
             "epdserve-state-123-deadbeef", "epdserve-emb-123-01234567",
             "epdserve-kv-1234-ab12cd34", "epdserve-kv-12-ab12cd34", "other-123-ab12cd34", "epdserve-kv-123"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = unlink_segments_of(123, str(tmp_path))
    assert sorted(removed) == sorted(names[:5])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[5:])

