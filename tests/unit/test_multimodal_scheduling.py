"""Images in the scheduler and the slab allocator: plain Python, no model.

A prompt computes only up to the first image whose embedding has not arrived (pipelined), or
nothing until all have (unpipelined); a request waiting for images lets later requests pass;
prefix-cache blocks of image positions are named by the image's content.
"""

import os
import stat

import pytest
import torch
from test_scheduler import make, run_all, run_step

from epdserve.engine.encoder_runner import EncoderCache
from epdserve.request import MMInput, Request
from epdserve.sampling import SamplingParams
from epdserve.transfer.descriptors import SlabEndpoint
from epdserve.transfer.slab import EmbeddingSlab, SlabAllocator, SlabRegion


def mm_req(rid, n_prompt, images, pipelined=True, max_tokens=2):
    request = Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,))
    request.mm_inputs = [MMInput(off, length, length, h) for off, length, h in images]
    request.is_mm_pipelined = pipelined
    return request


def test_pipelined_prefill_stops_at_first_pending_image():
    s = make(budget=64, block_size=4)
    r = mm_req("a", 40, [(4, 8, "aa" * 16), (20, 8, "bb" * 16)])
    s.add_request(r)
    plan, _ = run_step(s)
    assert [(e.start_pos, e.num_new_tokens) for e in plan.scheduled] == [(0, 4)]  # text before image 0
    plan, _ = run_step(s)
    assert plan.is_empty and s.num_running == 1  # still waiting for image 0
    r.mm_inputs[0].is_ready = True
    plan, _ = run_step(s)
    assert [(e.start_pos, e.num_new_tokens) for e in plan.scheduled] == [(4, 16)]  # up to image 1
    r.mm_inputs[1].is_ready = True
    plan, _ = run_step(s)
    assert [(e.start_pos, e.num_new_tokens, e.will_sample) for e in plan.scheduled] == [(20, 20, True)]
    run_all(s)
    assert s.kv_cache.is_all_free()


def test_unpipelined_prefill_waits_for_every_image():
    s = make(budget=64)
    r = mm_req("a", 40, [(4, 8, "aa" * 16), (20, 8, "bb" * 16)], pipelined=False)
    s.add_request(r)
    r.mm_inputs[0].is_ready = True
    plan, _ = run_step(s)
    assert plan.is_empty
    r.mm_inputs[1].is_ready = True
    plan, _ = run_step(s)
    assert [(e.start_pos, e.num_new_tokens) for e in plan.scheduled] == [(0, 40)]


def test_request_waiting_for_images_does_not_block_the_queue():
    s = make(budget=64)
    s.add_request(mm_req("img", 20, [(0, 8, "aa" * 16)]))
    s.add_request(mm_req("text", 12, []))
    plan, _ = run_step(s)
    assert [e.request.request_id for e in plan.scheduled] == ["text"]
    assert [r.request_id for r in s.waiting] == ["img"]  # kept its place at the head


def test_no_chunked_prefill_waits_for_all_images():
    s = make(budget=64, chunked=False, max_len=64)
    r = mm_req("a", 30, [(10, 8, "aa" * 16)])
    s.add_request(r)
    assert run_step(s)[0].is_empty
    r.mm_inputs[0].is_ready = True
    assert [(e.start_pos, e.num_new_tokens) for e in run_step(s)[0].scheduled] == [(0, 30)]


def test_prefix_cache_keys_image_positions_by_content():
    s = make(budget=64, block_size=4)
    first = mm_req("a", 24, [(4, 8, "aa" * 16)])
    first.mm_inputs[0].is_ready = True
    s.add_request(first)
    run_all(s)
    same = mm_req("b", 24, [(4, 8, "aa" * 16)])
    same.mm_inputs[0].is_ready = True
    other = mm_req("c", 24, [(4, 8, "cc" * 16)])
    other.mm_inputs[0].is_ready = True
    s.add_request(same)
    run_step(s)
    assert same.num_cached_tokens == 20  # every full block but the last token's
    s.add_request(other)
    run_step(s)
    assert other.num_cached_tokens == 4  # only the text before the image matches
    run_all(s)
    assert s.kv_cache.is_all_free()


def test_cached_image_blocks_need_no_embedding():
    s = make(budget=64, block_size=4)
    first = mm_req("a", 24, [(4, 8, "aa" * 16)])
    first.mm_inputs[0].is_ready = True
    s.add_request(first)
    run_all(s)
    again = mm_req("b", 24, [(4, 8, "aa" * 16)])  # embedding not (yet) there, but cached KV covers it
    s.add_request(again)
    plan, _ = run_step(s)
    assert [(e.start_pos, e.num_new_tokens) for e in plan.scheduled] == [(20, 4)]


def test_slab_allocator_first_fit_coalesces_and_refuses_when_full():
    a = SlabAllocator(100)
    r1, r2, r3 = a.allocate(30), a.allocate(30), a.allocate(30)
    assert (r1.offset, r2.offset, r3.offset) == (0, 30, 60)
    assert a.allocate(20) is None and a.num_free_rows == 10
    a.free(r2)
    assert not a.can_allocate([20, 20]) and a.can_allocate([20, 10])
    assert a.num_free_rows == 40  # can_allocate changes nothing
    a.free(r1)
    assert a.allocate(60).offset == 0  # r1 and r2 merged
    with pytest.raises(ValueError, match="already free"):
        a.free(SlabRegion(95, 5))
    a.free(SlabRegion(0, 60))
    a.free(r3)
    assert a.is_all_free and a.allocate(100).offset == 0


def test_embedding_slab_is_private_shared_memory():
    slab = EmbeddingSlab.create(16, 8, torch.bfloat16, name_prefix=f"epdserve-emb-test-{os.getpid()}")
    try:
        path = f"/dev/shm/{slab.name}"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        peer = EmbeddingSlab.attach(slab.endpoint())
        peer.region(4, 2).copy_(torch.full((2, 8), 3.0))
        assert slab.rows[4:6].eq(3.0).all() and slab.rows[:4].eq(0).all()
        with pytest.raises(ValueError, match="outside the slab"):
            peer.region(15, 2)
        peer.close()
    finally:
        slab.close()
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError):
        EmbeddingSlab.attach(SlabEndpoint("shm", slab.name, 16, 8, "bfloat16"))


def test_encoder_cache_is_lru_and_byte_bounded():
    cache = EncoderCache(max_bytes=3 * 64)  # three [8, 4] float16 entries
    for key in "abc":
        cache.put(key, torch.zeros(8, 4, dtype=torch.float16))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", torch.zeros(8, 4, dtype=torch.float16))
    assert cache.get("b") is None and cache.get("a") is not None and len(cache) == 3
    assert cache.num_bytes == 192 and (cache.num_hits, cache.num_misses) == (2, 1)
    cache.put("huge", torch.zeros(100, 4, dtype=torch.float16))  # larger than the cache: skipped
    assert cache.get("huge") is None and len(cache) == 3


def test_tcp_slab_lands_only_expected_images():
    import threading

    from epdserve.auth import new_key
    from epdserve.transfer.slab_tcp import TcpSlabReceiver, TcpSlabSender

    rows = torch.zeros(8, 4, dtype=torch.bfloat16)
    landed: list[tuple[str, int]] = []
    done = threading.Event()

    def on_landed(request_id: str, index: int) -> None:
        landed.append((request_id, index))
        done.set()

    key = new_key()
    receiver = TcpSlabReceiver(rows, on_landed, lambda rid, i, offset, num_rows: rid == "live", threading.Lock(), key)
    sender = TcpSlabSender(receiver.host, receiver.port, 8, 4, torch.bfloat16, key)
    try:
        sender.send("dropped", 0, 0, torch.full((2, 4), 5.0))  # an aborted request: read, not written
        sender.send("live", 1, 2, torch.full((3, 4), 7.0))
        assert done.wait(5)
        assert landed == [("live", 1)]
        assert rows[2:5].eq(7.0).all() and rows[:2].eq(0).all() and rows[5:].eq(0).all()
        with pytest.raises(ValueError, match="do not fit"):
            sender.send("live", 2, 7, torch.zeros(2, 4))
    finally:
        sender.close()
        receiver.close()
