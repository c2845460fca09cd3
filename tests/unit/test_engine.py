"""The engine on the real default models, against Hugging Face transformers (fp32, same weights)."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, assert_all_blocks_free, hf_greedy

from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.models.loader import load_model
from epdserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

GREEDY_32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_fp32():
    return load_model(None, torch.float32)


def make_engine(loaded, **kw) -> LLMEngine:
    args = EngineArgs(dtype="float32", kv_cache_memory_gib=0.25, **kw)
    return LLMEngine(args, loaded=loaded)


def encode_all(engine: LLMEngine, prompts: list[str]) -> list[list[int]]:
    return [engine.encode_prompt(p) for p in prompts]


def test_greedy_matches_transformers_smollm2(smollm2_fp32, hf_smollm2):
    engine = make_engine(smollm2_fp32)
    prompts = encode_all(engine, PROMPTS[:6])
    results = engine.generate(prompts, GREEDY_32)
    for ids, (completion,) in zip(prompts, results):
        assert completion.token_ids == hf_greedy(hf_smollm2, ids, 32)
        assert completion.finish_reason == "length"
    assert_all_blocks_free(engine)


def test_batching_does_not_change_results(smollm2_fp32):
    engine = make_engine(smollm2_fp32, max_num_batched_tokens=64)  # forces chunked, mixed steps
    prompts = encode_all(engine, PROMPTS)
    together = [c[0].token_ids for c in engine.generate(prompts, GREEDY_32)]
    alone = [engine.generate([p], GREEDY_32)[0][0].token_ids for p in prompts]
    assert together == alone
    assert_all_blocks_free(engine)


def test_prefix_cache_hit_same_output_fewer_tokens(smollm2_fp32):
    engine = make_engine(smollm2_fp32)
    prompt = engine.encode_prompt("Here is a long shared system prompt. " * 8 + "Question: what is 2+2?")
    assert len(prompt) > 40
    first = engine.generate([prompt], GREEDY_32)[0][0]
    computed_before = engine.scheduler.num_computed_prompt_tokens
    second = engine.generate([prompt], GREEDY_32)[0][0]
    computed = engine.scheduler.num_computed_prompt_tokens - computed_before
    block = engine.config.cache.block_size
    assert second.token_ids == first.token_ids
    assert second.num_cached_tokens == (len(prompt) - 1) // block * block
    assert computed == len(prompt) - second.num_cached_tokens
    assert_all_blocks_free(engine)


def test_preemption_gives_same_greedy_output(smollm2_fp32):
    roomy = make_engine(smollm2_fp32)
    prompts = encode_all(roomy, PROMPTS[:8])
    expected = [c[0].token_ids for c in roomy.generate(prompts, GREEDY_32)]
    # 8 requests of ~40 tokens need ~24 blocks of 16; 14 forces preemption.
    tight = make_engine(smollm2_fp32, num_kv_blocks=14, enable_prefix_caching=False)
    got = [c[0].token_ids for c in tight.generate(prompts, GREEDY_32)]
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert_all_blocks_free(tight)


def test_sampling_seed_n_stop_logprobs(smollm2_fp32):
    engine = make_engine(smollm2_fp32)
    prompt = engine.encode_prompt("Tell me a story about a dragon who")
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = engine.generate([prompt], params)[0][0].token_ids
    b = engine.generate([prompt, prompt[:5]], params)[0][0].token_ids
    assert a == b  # a seeded request does not depend on its batch

    n_params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    completions = engine.generate([prompt * 3], n_params)[0]
    assert len(completions) == 3
    assert len({tuple(c.token_ids) for c in completions}) > 1
    block = engine.config.cache.block_size
    assert all(c.num_cached_tokens == (len(prompt * 3) - 1) // block * block for c in completions[1:])

    greedy = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0][0]
    word = greedy.text.split()[2]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=(word,)))[0][0]
    assert stopped.finish_reason == "stop"
    assert word not in stopped.text and greedy.text.startswith(stopped.text)

    lp = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0][0]
    assert len(lp.logprobs) == len(lp.token_ids)
    for token_id, entry in zip(lp.token_ids, lp.logprobs):
        assert entry.token_id == token_id and entry.top_token_ids[0] == token_id
        assert len(entry.top_logprobs) == 3 and entry.logprob == pytest.approx(entry.top_logprobs[0])
    assert_all_blocks_free(engine)


def test_gemma3_long_prompt_matches_transformers(gemma3_gguf, hf_gemma3):
    loaded = load_model(str(gemma3_gguf), torch.float32)
    assert loaded.spec.sliding_windows.count(512) == 15 and loaded.spec.sliding_windows.count(None) == 3
    engine = LLMEngine(
        EngineArgs(dtype="float32", kv_cache_memory_gib=0.25, max_num_batched_tokens=256), loaded=loaded
    )
    assert engine.kv_cache.enable_prefix_caching  # full and sliding-window groups both rebuild a prefix
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} marbles." for i in range(60))
    prompt = engine.encode_prompt(text + " Summary:")
    assert len(prompt) > 600
    (completion,) = engine.generate([prompt], GREEDY_32)[0]
    expected = hf_greedy(hf_gemma3, prompt, 32)
    assert completion.token_ids == expected
    # Again: the prefix comes from the cache (chunks of 256 let the sliding layers' first
    # blocks go during the first prefill; the window before the hit point is what counts).
    (again,) = engine.generate([prompt], GREEDY_32)[0]
    block = engine.config.cache.block_size
    assert again.num_cached_tokens == (len(prompt) - 1) // block * block
    assert again.token_ids == expected
    assert_all_blocks_free(engine)


def _bf16_agreement(path: str | None, hf_model, prompts: list[str]) -> float:
    loaded = load_model(path, torch.bfloat16)
    agree = total = 0
    for text in prompts:
        ids = loaded.tokenizer.encode(text)
        reference = hf_greedy(hf_model, ids, 32)
        sequence = ids + reference
        with torch.inference_mode():
            positions = torch.arange(len(sequence))
            hidden = loaded.model(torch.tensor(sequence), positions)
            logits = loaded.model.compute_logits(hidden[len(ids) - 1 : -1])
        predicted = logits.argmax(-1).tolist()
        agree += sum(int(p == r) for p, r in zip(predicted, reference))
        total += len(reference)
    return agree / total


def test_bf16_top1_agreement_smollm2(hf_smollm2):
    assert _bf16_agreement(None, hf_smollm2, PROMPTS[:5]) >= 0.95


def test_bf16_top1_agreement_gemma3(gemma3_gguf, hf_gemma3):
    assert _bf16_agreement(str(gemma3_gguf), hf_gemma3, PROMPTS[:5]) >= 0.95
