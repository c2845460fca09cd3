"""Scheduler invariants: token budget, chunked prefill, preemption, prefix hits, stops.

The model is not the subject here: each step "samples" token 7 for every request that
completes its known tokens, so runs are exact and fast.
"""

from epdserve.config import SchedulerConfig
from epdserve.engine.kv_cache import KVCacheManager, make_group_specs
from epdserve.engine.scheduler import Scheduler
from epdserve.request import Request, RequestStatus
from epdserve.sampling import SamplingParams

EOS = 2


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, max_len=256, chunked=True, caching=True):
    groups = make_group_specs((None,), num_kv_heads=1, head_dim=8)
    kv = KVCacheManager(groups, num_blocks, block_size, caching)
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, kv)


def req(rid, n_prompt, max_tokens=4, **kw) -> Request:
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=(EOS,))


def run_step(s: Scheduler, token=7):
    plan = s.schedule()
    sampled = {e.request.request_id: token for e in plan.scheduled if e.will_sample}
    return plan, s.update(plan, sampled)


def run_all(s: Scheduler, max_steps=1000):
    finished = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return finished
        _, done = run_step(s)
        finished += done
    raise AssertionError("did not finish")


def test_budget_and_chunked_prefill():
    s = make(budget=16)
    s.add_request(req("a", 40))
    plan, _ = run_step(s)
    assert [(e.start_pos, e.num_new_tokens, e.will_sample) for e in plan.scheduled] == [(0, 16, False)]
    plan, _ = run_step(s)
    assert [(e.start_pos, e.num_new_tokens) for e in plan.scheduled] == [(16, 16)]
    plan, _ = run_step(s)
    assert [(e.start_pos, e.num_new_tokens, e.will_sample) for e in plan.scheduled] == [(32, 8, True)]
    assert s.requests["a"].output_token_ids == [7]
    plan, _ = run_step(s)
    assert [(e.start_pos, e.num_new_tokens) for e in plan.scheduled] == [(40, 1)]


def test_decodes_go_first_and_new_prompts_fill_the_budget():
    s = make(budget=10)
    s.add_request(req("a", 3, max_tokens=10))
    run_step(s)  # a prefilled
    s.add_request(req("b", 20))
    plan, _ = run_step(s)
    assert [(e.request.request_id, e.num_new_tokens) for e in plan.scheduled] == [("a", 1), ("b", 9)]
    assert plan.num_batched_tokens == 10


def test_without_chunking_a_long_prompt_waits_for_a_whole_budget():
    s = make(budget=16, chunked=False, max_len=16)
    s.add_request(req("a", 3, max_tokens=8))
    s.add_request(req("c", 3, max_tokens=8))
    run_step(s)
    s.add_request(req("b", 15, max_tokens=1))
    plan, _ = run_step(s)
    assert [e.request.request_id for e in plan.scheduled] == ["a", "c"]  # 2 + 15 > 16
    run_all(s)
    assert s.kv_cache.is_all_free()


def test_max_num_seqs_caps_running():
    s = make(max_seqs=2, budget=100)
    for i in range(4):
        s.add_request(req(f"r{i}", 4))
    plan, _ = run_step(s)
    assert len(plan.scheduled) == 2 and s.num_waiting == 2
    run_all(s)
    assert s.kv_cache.is_all_free()


def test_preemption_by_recompute_when_blocks_run_out():
    # 7 usable blocks of 4 tokens; two requests each grow to 4+12=16 tokens (4 blocks)
    s = make(num_blocks=8, block_size=4, budget=64, caching=False)
    s.add_request(req("a", 4, max_tokens=12))
    s.add_request(req("b", 4, max_tokens=12))
    preempted = []
    finished = []
    for _ in range(200):
        if not s.has_unfinished():
            break
        plan, done = run_step(s)
        preempted += plan.preempted_ids
        finished += done
    assert preempted == ["b"] or "b" in preempted
    assert sorted(r.request_id for r in finished) == ["a", "b"]
    b = next(r for r in finished if r.request_id == "b")
    assert b.num_preemptions >= 1 and len(b.output_token_ids) == 12
    assert s.kv_cache.is_all_free()


def test_prefix_hit_computes_fewer_prompt_tokens():
    s = make(budget=64, caching=True)
    s.add_request(req("a", 18, max_tokens=2))
    run_all(s)
    assert s.num_computed_prompt_tokens == 18
    s.add_request(req("b", 18, max_tokens=2))
    run_all(s)
    assert s.num_computed_prompt_tokens == 18 + 2  # 16 tokens (4 blocks) came from the cache
    assert s.kv_cache.is_all_free()


def test_sibling_waits_for_leader_prompt_then_hits_cache():
    s = make(budget=64)
    a, b = req("a", 18), req("b", 18)
    b.wait_for_request_id = "a"
    s.add_request(a)
    s.add_request(b)
    plan, _ = run_step(s)
    assert [e.request.request_id for e in plan.scheduled] == ["a"]
    plan, _ = run_step(s)
    entry = next(e for e in plan.scheduled if e.request.request_id == "b")
    assert entry.start_pos == 16 and b.num_cached_tokens == 16
    run_all(s)
    assert s.kv_cache.is_all_free()


def test_stop_conditions():
    s = make()
    s.add_request(req("len", 3, max_tokens=2))
    s.add_request(req("eos", 3, max_tokens=9))
    s.add_request(req("ign", 3, max_tokens=3, ignore_eos=True))
    s.add_request(req("min", 3, max_tokens=5, min_tokens=2))
    s.add_request(req("stopid", 3, max_tokens=5, stop_token_ids=(9,)))
    statuses = {}
    for step in range(10):
        if not s.has_unfinished():
            break
        token = EOS if step >= 0 else 7
        plan = s.schedule()
        sampled = {}
        for e in plan.scheduled:
            if e.will_sample:
                rid = e.request.request_id
                sampled[rid] = 9 if rid == "stopid" else (7 if rid == "len" else token)
        for r in s.update(plan, sampled):
            statuses[r.request_id] = (r.status, len(r.output_token_ids))
    assert statuses["len"] == (RequestStatus.FINISHED_LENGTH, 2)
    assert statuses["eos"] == (RequestStatus.FINISHED_STOPPED, 1)
    assert statuses["ign"] == (RequestStatus.FINISHED_LENGTH, 3)
    assert statuses["min"] == (RequestStatus.FINISHED_STOPPED, 2)
    assert statuses["stopid"] == (RequestStatus.FINISHED_STOPPED, 1)
    assert s.kv_cache.is_all_free()


def test_max_model_len_ends_generation():
    s = make(max_len=8)
    s.add_request(req("a", 5, max_tokens=100))
    (r,) = run_all(s)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 8


def test_abort_frees_blocks_anywhere():
    s = make(max_seqs=1)
    s.add_request(req("a", 5, max_tokens=50))
    s.add_request(req("b", 5))
    run_step(s)
    assert s.finish_request("a", RequestStatus.FINISHED_ABORTED).status is RequestStatus.FINISHED_ABORTED
    assert s.finish_request("b", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish_request("nope", RequestStatus.FINISHED_ABORTED) is None
    assert not s.has_unfinished() and s.kv_cache.is_all_free()


def test_scheduler_module_has_no_torch():
    import subprocess
    import sys

    code = (
        "import sys; import epdserve.engine.scheduler, epdserve.engine.kv_cache; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- service classes (epdserve/service.py) ---------------------------------------------------
def test_waiting_requests_go_in_priority_order_then_arrival():
    from epdserve.service import schedule_key

    s = make(max_seqs=1)
    batch, inter, rt = schedule_key("batch"), schedule_key("interactive"), schedule_key("realtime")
    for rid, key in (("b1", batch), ("i1", inter), ("b2", batch), ("r1", rt), ("i2", inter), ("i0", inter - 5)):
        s.add_request(req(rid, 4, max_tokens=1, priority=key))
    assert [r.request_id for r in s.waiting] == ["r1", "i0", "i1", "i2", "b1", "b2"]
    order = [r.request_id for r in run_all(s)]
    assert order == ["r1", "i0", "i1", "i2", "b1", "b2"]


def test_a_waiting_interactive_request_preempts_running_batch_work():
    from epdserve.service import schedule_key

    s = make(max_seqs=2)
    for rid in ("b1", "b2"):
        s.add_request(req(rid, 4, max_tokens=50, priority=schedule_key("batch")))
    for _ in range(3):
        run_step(s)
    assert [r.request_id for r in s.running] == ["b1", "b2"]
    s.add_request(req("i1", 4, max_tokens=2))  # interactive, priority 0: key 0 < batch's
    plan, _ = run_step(s)
    # The latest batch request gives its seat (recomputed later), and i1 starts in this step.
    assert plan.preempted_ids == ["b2"] and "i1" in [e.request.request_id for e in plan.scheduled]
    assert [r.request_id for r in s.waiting] == ["b2"] and s.num_preemptions == 1
    finished = [r.request_id for r in run_all(s)]
    assert finished[0] == "i1" and sorted(finished) == ["b1", "b2", "i1"]
    assert s.kv_cache.is_all_free() or s.kv_cache.num_used_blocks() == 0


def test_equal_priorities_never_preempt_each_other():
    s = make(max_seqs=1)
    s.add_request(req("a", 4, max_tokens=5))
    run_step(s)
    s.add_request(req("b", 4, max_tokens=5))
    plan, _ = run_step(s)
    assert not plan.preempted_ids and [r.request_id for r in s.running] == ["a"]
