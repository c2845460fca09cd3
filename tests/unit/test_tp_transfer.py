"""Prefill at TP a hands KV to decode at TP b: the transfer plan (which rank sends which heads
where; no processes) and the pusher that follows it, into real shared-memory pools and through a
real TCP listener. Each side's ranks are stood in for by tensors holding that rank's heads of one
full KV tensor; the test checks every decode rank's pages hold exactly its heads."""

from __future__ import annotations

import time

import pytest
import torch

from epdserve.auth import new_key
from epdserve.transfer.connector import KVPusher, PushItem
from epdserve.transfer.descriptors import KVEndpoint
from epdserve.transfer.fence import ReservationFence
from epdserve.transfer.shm_pool import SharedKVPool
from epdserve.transfer.tcp import TcpKVReceiver
from epdserve.transfer.tp_plan import kv_heads_of_rank, plan_transfer

NUM_BLOCKS, BLOCK_SIZE, DIM, LAYERS = 12, 4, 8, 3
KEY = new_key()


def dst_heads_from_plan(total: int, src_tp: int, dst_tp: int) -> list[list[int]]:
    """The global heads each decode rank receives, read off the plan."""
    plan = plan_transfer(total, src_tp, dst_tp)
    out = []
    for copies in plan.copies:
        heads = [None] * plan.dst_heads
        for c in copies:
            first = kv_heads_of_rank(total, c.src_rank, src_tp)[0]
            for i in range(c.num_heads):
                assert heads[c.dst_head + i] is None, "two copies write one head"
                heads[c.dst_head + i] = first + c.src_head + i
        out.append(heads)
    return out


@pytest.mark.parametrize("total,src_tp,dst_tp", [
    (4, 1, 1), (4, 2, 2), (4, 1, 2), (4, 2, 1), (4, 2, 4), (4, 4, 2), (4, 1, 4), (4, 4, 1),
    (1, 1, 2), (1, 2, 1), (1, 2, 4), (2, 1, 4), (2, 4, 1), (2, 4, 2), (8, 2, 4),
])
def test_every_decode_rank_gets_exactly_its_heads(total, src_tp, dst_tp):
    received = dst_heads_from_plan(total, src_tp, dst_tp)
    for rank, heads in enumerate(received):
        first, count = kv_heads_of_rank(total, rank, dst_tp)
        assert heads == list(range(first, first + count))


def test_plans_name_the_sending_rank_and_when_staging_is_needed():
    same = plan_transfer(4, 2, 2)
    assert same.is_identity and all(same.is_whole(r) for r in range(2))
    up = plan_transfer(4, 2, 4)  # each decode rank takes one of a prefill rank's two heads
    assert [c.src_rank for copies in up.copies for c in copies] == [0, 0, 1, 1]
    assert not any(up.is_whole(r) for r in range(4)) and up.sent_heads() == 4
    down = plan_transfer(4, 4, 2)  # each decode rank gathers two prefill ranks' heads
    assert [[c.src_rank for c in copies] for copies in down.copies] == [[0, 1], [2, 3]]
    assert not down.is_whole(0)
    replicated = plan_transfer(1, 1, 2)  # one KV head, two decode ranks: both take it
    assert replicated.sent_heads() == 2 and all(replicated.is_whole(r) for r in range(2))
    spread = plan_transfer(1, 2, 2)  # both prefill ranks hold the head: each sends its own copy
    assert [copies[0].src_rank for copies in spread.copies] == [0, 1] and spread.is_identity
    merged = plan_transfer(8, 2, 1)  # contiguous heads of one rank travel as one copy
    assert [(c.src_rank, c.num_heads) for c in merged.copies[0]] == [(0, 4), (1, 4)]


@pytest.mark.parametrize("total,tp", [(3, 2), (4, 3), (2, 3)])
def test_heads_that_do_not_split_are_refused(total, tp):
    with pytest.raises(ValueError):
        plan_transfer(total, 1, tp)
    with pytest.raises(ValueError):
        plan_transfer(total, tp, 1)


def _full_kv(total: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(total)
    return [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, total, DIM, generator=gen) for _ in range(LAYERS)]


def _rank_caches(full: list[torch.Tensor], total: int, tp: int) -> list[list[torch.Tensor]]:
    out = []
    for rank in range(tp):
        first, count = kv_heads_of_rank(total, rank, tp)
        out.append([layer[..., first : first + count, :].contiguous() for layer in full])
    return out


class DecodeSide:
    """b ranks' pages in shared memory, a fence, and (tcp) rank 0's listener landing every rank."""

    def __init__(self, total: int, tp: int, transport: str) -> None:
        self.heads = kv_heads_of_rank(total, 0, tp)[1]
        shapes = [(self.heads, DIM)] * LAYERS
        self.pools = [SharedKVPool.create(NUM_BLOCKS, BLOCK_SIZE, shapes, torch.float32) for _ in range(tp)]
        self.fence = ReservationFence(1, NUM_BLOCKS, shm=transport == "shm")
        self.landed: list[str] = []
        base = self.pools[0].endpoint()
        fields = {f: getattr(base, f) for f in base.__struct_fields__}
        fields.update(tp_size=tp, total_kv_heads=total, rank_shm_names=[p.name for p in self.pools[1:]])
        self.receiver = None
        if transport == "shm":
            fields.update(fence_shm_name=self.fence.shm_name, transport="shm")
        else:
            self.receiver = TcpKVReceiver(self.pools[0].layers, self.landed.append, self.fence, [0] * LAYERS, KEY,
                                          rank_caches=[p.layers for p in self.pools])
            fields.update(transport="tcp", shm_name="", rank_shm_names=[], host=self.receiver.host,
                          port=self.receiver.port)
        self.endpoint = KVEndpoint(**fields)

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.fence.close_all()
        for pool in self.pools:
            pool.close()


def _push(pusher: KVPusher, item: PushItem, chunks: list[tuple[int, int]]) -> list:
    """Run the prompt's chunks as steps (layer-wise: each layer as the forward pass writes it)."""
    for start, end in chunks:
        step = PushItem(item.request_id, item.target, min(max(start, item.skip), end), end, item.src_tables,
                        item.dst_tables,
                        end == chunks[-1][1], item.generation, item.skip)
        pusher.begin_step([step])
        for layer in range(LAYERS):
            pusher.save_layer(layer)
        pusher.end_step()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        finished = pusher.poll()
        if finished:
            return finished
        time.sleep(0.01)
    raise AssertionError("the transfer did not finish")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("total,src_tp,dst_tp", [(4, 1, 2), (4, 2, 1), (4, 2, 4), (4, 4, 2), (1, 1, 2),
                                                 (1, 2, 1), (4, 2, 2)])
@pytest.mark.parametrize("layerwise", [True, False])
def test_pusher_reshards_heads_into_every_decode_rank(transport, total, src_tp, dst_tp, layerwise):
    full = _full_kv(total)
    src = _rank_caches(full, total, src_tp)
    decode = DecodeSide(total, dst_tp, transport)
    pusher = KVPusher(src[0], [0] * LAYERS, BLOCK_SIZE, layerwise, rank_caches=src, total_kv_heads=total,
                      staging_tokens=8)
    try:
        pusher.add_peer("decode-0", decode.endpoint, KEY)
        src_blocks, dst_blocks = [1, 2, 3], [7, 5, 9]  # 10 positions, different pages on each side
        generation = decode.fence.open([dst_blocks], "r")
        item = PushItem("r", "decode-0", 0, 10, [src_blocks], [dst_blocks], True, generation, skip=2)
        (stats,) = _push(pusher, item, [(0, 4), (4, 8), (8, 10)])
        assert stats.ok and stats.transport == transport
        plan = pusher._plans["decode-0"]
        per_position = LAYERS * 2 * plan.sent_heads() * DIM * 4
        assert stats.kv_bytes == 8 * per_position  # positions 2..9: the first two were held already
        assert stats.kv_bytes_skipped == 2 * per_position
        if transport == "tcp":
            deadline = time.monotonic() + 10
            while "r" not in decode.landed and time.monotonic() < deadline:
                time.sleep(0.01)
            assert decode.landed == ["r"]
        for rank, pool in enumerate(decode.pools):
            first, count = kv_heads_of_rank(total, rank, dst_tp)
            for layer in range(LAYERS):
                got = pool.layers[layer].view(2, -1, count, DIM)
                want = full[layer][..., first : first + count, :].reshape(2, -1, count, DIM)
                for p in range(2, 10):
                    dst = dst_blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                    srcp = src_blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                    torch.testing.assert_close(got[:, dst], want[:, srcp], rtol=0, atol=0)
                for p in range(2):  # held by decode already: never written
                    dst = dst_blocks[0] * BLOCK_SIZE + p
                    assert float(got[:, dst].abs().max()) == 0.0
    finally:
        pusher.close()
        decode.close()


def test_staging_buffer_is_allocated_once_and_reused():
    total = 4
    full = _full_kv(total)
    src = _rank_caches(full, total, 2)
    decode = DecodeSide(total, 4, "shm")
    pusher = KVPusher(src[0], [0] * LAYERS, BLOCK_SIZE, True, rank_caches=src, total_kv_heads=total,
                      staging_tokens=8)
    try:
        pusher.add_peer("decode-0", decode.endpoint, KEY)
        buffers = set()
        for n in range(3):
            generation = decode.fence.open([[4, 5]], f"r{n}")
            item = PushItem(f"r{n}", "decode-0", 0, 8, [[1, 2]], [[4, 5]], True, generation)
            (stats,) = _push(pusher, item, [(0, 4), (4, 8)])
            assert stats.ok
            buffers.add(pusher._staging.data_ptr())
            decode.fence.close(generation)
        assert len(buffers) == 1
    finally:
        pusher.close()
        decode.close()


def test_a_decode_worker_whose_pages_do_not_match_is_refused():
    total = 4
    src = _rank_caches(_full_kv(total), total, 2)
    decode = DecodeSide(total, 2, "shm")
    pusher = KVPusher(src[0], [0] * LAYERS, BLOCK_SIZE, True, rank_caches=src, total_kv_heads=total)
    try:
        wrong_heads = KVEndpoint(**{**{f: getattr(decode.endpoint, f) for f in decode.endpoint.__struct_fields__},
                                    "total_kv_heads": 8})
        with pytest.raises(ValueError, match="KV heads"):
            pusher.add_peer("decode-0", wrong_heads, KEY)
        missing_rank = KVEndpoint(**{**{f: getattr(decode.endpoint, f) for f in decode.endpoint.__struct_fields__},
                                     "rank_shm_names": []})
        with pytest.raises(ValueError, match="rank pools"):
            pusher.add_peer("decode-0", missing_rank, KEY)
        assert not pusher.links
    finally:
        pusher.close()
        decode.close()
