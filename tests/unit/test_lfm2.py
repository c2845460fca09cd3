"""LFM2 (short convolutions beside attention) and the "state" KV cache group.

A tiny random LFM2 checkpoint is written here with transformers (float32, conv and attention
layers mixed) next to a word-level tokenizer. The engine's greedy output must equal
transformers' ``generate(do_sample=False)``, alone, batched, in small prefill chunks and under
preemption; afterwards every block and every state slot is free. The state group's slots are
checked on their own in the KV manager and the scheduler (no model).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import LFM2_LAYER_TYPES, assert_all_blocks_free

from epdserve.config import EngineArgs, SchedulerConfig
from epdserve.engine.engine import LLMEngine
from epdserve.engine.kv_cache import KVCacheManager, make_group_specs
from epdserve.engine.scheduler import Scheduler
from epdserve.errors import ConfigError
from epdserve.faults import FaultKind, FaultSpec
from epdserve.models.loader import LoadedModel, load_model
from epdserve.request import Request
from epdserve.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 512  # conftest's tiny_lfm2
NUM_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENS = (1, 2, 5, 13, 30, 47)


@pytest.fixture(scope="module")
def checkpoint(tiny_lfm2: tuple[Path, torch.nn.Module]) -> tuple[Path, torch.nn.Module]:
    """(directory, the transformers model saved there): conftest's ``tiny_lfm2``."""
    return tiny_lfm2


@pytest.fixture(scope="module")
def loaded(checkpoint: tuple[Path, torch.nn.Module]) -> LoadedModel:
    return load_model(str(checkpoint[0]), torch.float32)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(4, VOCAB_SIZE, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(checkpoint: tuple[Path, torch.nn.Module], prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens for each prompt (EOS does not stop it)."""
    reference = checkpoint[1]
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                                           eos_token_id=None, pad_token_id=0)
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            out = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
            outputs.append(out[0, len(ids):].tolist())
    assert len({tuple(o) for o in outputs}) == len(outputs)  # the prompts lead somewhere different
    assert all(len(set(o)) > 1 for o in outputs)
    return outputs


def make_engine(loaded: LoadedModel, **kw) -> LLMEngine:
    args = EngineArgs(dtype="float32", block_size=4, num_kv_blocks=kw.pop("num_kv_blocks", 128), max_model_len=256,
                      **kw)
    return LLMEngine(args, loaded=loaded)


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [c[0].token_ids for c in engine.generate(prompts, GREEDY)]


# ---- the model -------------------------------------------------------------------------


def test_spec_and_logits_match_transformers(loaded: LoadedModel, checkpoint: tuple[Path, torch.nn.Module]):
    spec = loaded.spec
    assert spec.architecture == "lfm2" and spec.head_dim == 16
    assert spec.state_shapes == tuple((64, 2) if kind == "conv" else None for kind in LFM2_LAYER_TYPES)
    ids = torch.randint(0, VOCAB_SIZE, (23,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ours = loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))
        theirs = checkpoint[1](ids[None]).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_greedy_matches_transformers_one_at_a_time(loaded, prompts, expected):
    engine = make_engine(loaded)
    assert [greedy(engine, [p])[0] for p in prompts] == expected
    assert_all_blocks_free(engine)


def test_batched_matches_one_at_a_time(loaded, prompts, expected):
    engine = make_engine(loaded)
    assert greedy(engine, prompts) == expected
    assert engine.kv_cache.num_state_slots == engine.config.scheduler.max_num_seqs
    assert_all_blocks_free(engine)


def test_chunked_prefill_matches(loaded, prompts, expected):
    # 7 tokens a step: long prompts take several chunks (their conv state carried from chunk to
    # chunk, also across chunks shorter than the kernel) while others decode beside them.
    engine = make_engine(loaded, max_num_batched_tokens=7)
    assert greedy(engine, prompts) == expected
    assert_all_blocks_free(engine)
    engine = make_engine(loaded, max_num_batched_tokens=2)  # chunks of 1 and 2 tokens
    assert greedy(engine, prompts[3:5]) == expected[3:5]
    assert_all_blocks_free(engine)


def test_preempted_requests_recompute_from_a_fresh_state(loaded, prompts, expected):
    # 6 requests need ~45 blocks of 4 by the end; 24 forces preemption (slot freed, taken again).
    engine = make_engine(loaded, num_kv_blocks=24)
    assert greedy(engine, prompts) == expected
    assert engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_reused_slots_start_from_zero(loaded, prompts, expected):
    engine = make_engine(loaded, max_num_seqs=2)  # two slots, taken in turn by all six
    assert engine.kv_cache.num_state_slots == 2
    assert greedy(engine, prompts) == expected
    assert greedy(engine, prompts[::-1]) == expected[::-1]
    assert_all_blocks_free(engine)


def test_aborted_and_failed_requests_free_their_slots(loaded, prompts, expected):
    # The request with seed 7 fails in sampling at its fourth token (an injected fault).
    engine = make_engine(loaded, faults=(FaultSpec(FaultKind.SAMPLE_ERROR, seed=7, after=3),))
    num_slots = engine.kv_cache.num_state_slots
    engine.add_request(prompts[4], GREEDY, request_id="a")
    engine.step()
    assert engine.kv_cache.num_free_slots() == num_slots - 1
    engine.abort("a")
    assert engine.kv_cache.num_free_slots() == num_slots
    doomed = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, seed=7)
    (failed,), (ok,) = engine.generate([prompts[5], prompts[3]], [doomed, GREEDY])
    assert failed.error is not None and len(failed.token_ids) == 3
    assert ok.error is None and ok.token_ids == expected[3]
    assert_all_blocks_free(engine)


def test_prefix_caching_is_off_and_says_why(loaded, caplog):
    with caplog.at_level(logging.INFO, logger="epdserve.engine"):
        engine = make_engine(loaded)
    assert not engine.kv_cache.enable_prefix_caching
    assert "recurrent state" in engine.kv_cache.prefix_caching_off_reason
    assert any("prefix caching is off" in r.getMessage() for r in caplog.records)
    assert [g.kind for g in engine.kv_cache.groups] == ["full", "state"]


def test_tensor_parallel_is_refused(checkpoint):
    # Both ranks load their shard of the conv channels; the engine then refuses.
    args = EngineArgs(model=str(checkpoint[0]), dtype="float32", num_kv_blocks=16, max_model_len=256,
                      tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor-parallel-size 1"):
        LLMEngine(args)


# ---- the state group, no model -----------------------------------------------------------


def stateful(num_blocks=16, block_size=4, num_slots=2) -> KVCacheManager:
    groups = make_group_specs((None, None, None), num_kv_heads=1, head_dim=8, state_shapes=((8, 2), None, (8, 2)))
    return KVCacheManager(groups, num_blocks, block_size, enable_prefix_caching=True, num_state_slots=num_slots)


def test_group_specs_put_state_layers_last():
    groups = make_group_specs((None, 4, None, None), num_kv_heads=2, head_dim=4,
                              state_shapes=((16, 2), None, None, (16, 2)))
    assert [(g.group_id, g.kind, g.layer_ids, g.name) for g in groups] == [
        (0, "full", (2,), "full"), (1, "sliding", (1,), "sliding4"), (2, "state", (0, 3), "state")]
    state = groups[2]
    assert not state.is_paged and not state.is_prefix_cacheable and state.state_shape == (16, 2)
    assert state.bytes_per_block(16, 2) == 0 and state.bytes_per_slot(2) == 2 * 16 * 2 * 2
    assert groups[0].bytes_per_slot(2) == 0


def test_slots_one_per_request_kept_until_free():
    kv = stateful(num_slots=2)
    assert not kv.enable_prefix_caching and kv.prefix_caching_off_reason is not None
    assert kv.allocate("a", 0, 6)
    slot_a = kv.block_tables("a")[1]
    assert len(slot_a) == 1 and kv.num_free_slots() == 1
    for n in range(6, 20):  # chunks and decode steps keep the slot, only blocks grow
        assert kv.allocate("a", n, 1)
    assert kv.block_tables("a")[1] == slot_a and len(kv.block_tables("a")[0]) == 5
    assert kv.allocate("b", 0, 3)
    assert kv.block_tables("b")[1] != slot_a and kv.num_free_slots() == 0
    kv.free("a")
    assert kv.num_free_slots() == 1 and not kv.is_all_free()
    kv.free("b")
    kv.free("b")  # freeing twice (an abort after a finish) is a no-op
    assert kv.is_all_free()


def test_no_free_slot_refuses_without_changing_anything():
    kv = stateful(num_slots=1)
    assert kv.allocate("a", 0, 4)
    free_blocks = kv.num_free_blocks()
    assert not kv.can_allocate("b", 0, 4)
    assert not kv.allocate("b", 0, 4)
    assert kv.num_free_blocks() == free_blocks and kv.num_free_slots() == 0
    assert kv.allocate("a", 4, 4)  # the holder still grows
    kv.free("a")
    assert kv.allocate("b", 0, 4) and kv.block_tables("b")[1] == [0]
    kv.free("b")
    assert kv.is_all_free()


def test_a_request_without_a_slot_waits_in_the_scheduler():
    kv = stateful(num_blocks=64, num_slots=1)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64), kv)
    for rid in ("a", "b"):
        scheduler.add_request(Request(rid, list(range(10, 16)), SamplingParams(max_tokens=2), eos_token_ids=(2,)))
    finished = []
    order = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        order.append(sorted(e.request.request_id for e in plan.scheduled))
        assert kv.num_free_slots() == (0 if plan.scheduled else 1)
        finished += scheduler.update(plan, {e.request.request_id: 7 for e in plan.scheduled if e.will_sample})
    assert order == [["a"], ["a"], ["b"], ["b"]]  # b waited for a's slot, then ran
    assert [r.request_id for r in finished] == ["a", "b"]
    assert kv.is_all_free()


def test_preemption_frees_the_slot():
    kv = stateful(num_blocks=5, num_slots=2)  # 4 blocks of 4
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64), kv)
    for rid in ("a", "b"):
        scheduler.add_request(Request(rid, list(range(10, 17)), SamplingParams(max_tokens=8), eos_token_ids=(2,)))
    preempted = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        preempted += plan.preempted_ids
        held = len(scheduler.running)
        assert kv.num_free_slots() == 2 - held
        scheduler.update(plan, {e.request.request_id: 7 for e in plan.scheduled if e.will_sample})
    assert preempted
    assert kv.is_all_free()
