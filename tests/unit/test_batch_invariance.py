"""A sequence's tokens and log-probabilities are the same bits whatever else is in its steps.

On the CPU with the extension's kernels decode and prefill attention run one sequence at a
time (a prompt in chunks gets the same rows as at once), and ``packed_linear.linear_rows``
pads every matmul's rows to a count the BLAS library sums in one order. So a request decoding
alone, beside others, beside a prompt's prefill, or with its prompt cut into other chunks by
a shared token budget gets the same output. The row rule was measured on an AVX-512 CPU with
AVX512-BF16 and without AMX (an AMD EPYC); elsewhere the libraries run other kernels and these
tests skip: AMX tiles, AVX2, and AVX-512 without BF16 (on an Intel Xeon of that kind float32
decode steps of one and of four sequences differed in a log-probability's last bits).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import PROMPTS, assert_all_blocks_free

from epdserve.config import EngineArgs, cpu_has_fast_bf16
from epdserve.engine.engine import LLMEngine
from epdserve.models.layers import packed_linear, paged_attention_cpu
from epdserve.models.loader import load_model
from epdserve.sampling import SamplingParams

TRACKED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
OTHER = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
LONG = [5 + (13 * i) % 700 for i in range(150)]  # cut into chunks by a 64-token budget


def unmeasured(dtype: str) -> str | None:
    """Why this CPU is outside what the row rule was measured on, or None."""
    if (torch.backends.cpu.get_cpu_capability() != "AVX512" or paged_attention_cpu._cpu_has_amx()
            or not torch.cpu._is_avx512_bf16_supported()):
        return "rows summed in an order measured on AVX-512 CPUs with AVX512-BF16 and without AMX only"
    if dtype == "bfloat16" and not (cpu_has_fast_bf16() and paged_attention_cpu._has_prefill_attention()):
        return "no AVX512-BF16 here: bf16 runs through other kernels"
    return None


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engine(request):
    if (reason := unmeasured(request.param)) or not paged_attention_cpu.is_available():
        pytest.skip(reason or "the CPU extension is not built here")
    args = EngineArgs(dtype=request.param, kv_cache_memory_gib=0.25, max_num_batched_tokens=64,
                      enable_prefix_caching=False)
    return LLMEngine(args, loaded=load_model(None, getattr(torch, request.param)))


def run(engine: LLMEngine, prompt: list[int], before: list[list[int]] = (), after: list[list[int]] = (),
        join_after: int = 0) -> tuple[list, list]:
    """Greedy tokens and log-probabilities of ``prompt``; ``before`` queued ahead of it,
    ``after`` added after ``join_after`` steps (or at once, behind it)."""
    for other in before:
        engine.add_request(other, OTHER)
    rid = engine.add_request(prompt, TRACKED)
    tokens, logprobs, steps = [], [], 0
    if not join_after:
        for other in after:
            engine.add_request(other, OTHER)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                logprobs += out.new_logprobs
        steps += 1
        if join_after and steps == join_after:
            for other in after:
                engine.add_request(other, OTHER)
    return tokens, logprobs


@pytest.mark.slow
@pytest.mark.parametrize("case", ["decode-batch", "joins-mid-decode", "chunked-prompt"])
def test_output_same_alone_and_batched(engine, case):
    short = engine.encode_prompt(PROMPTS[5])
    others = [engine.encode_prompt(p) for p in PROMPTS[6:9]]
    if case == "decode-batch":  # prefilled together, then decoding four at a time
        prompt, batched = short, {"after": others}
    elif case == "joins-mid-decode":  # the others' prompts in the steps beside its decode
        prompt, batched = short, {"after": others, "join_after": 3}
    else:  # two prompts queued ahead: its 150 tokens in chunks of 11, 62, 62, 15, not 64, 64, 22
        if engine.config.dtype == "float32":
            pytest.skip("float32 prompts attend through torch's kernel, whose rows depend on the chunks")
        prompt, batched = LONG, {"before": [LONG[:40] + others[0], others[1]]}
    alone = run(engine, prompt)
    beside = run(engine, prompt, **batched)
    assert len(alone[0]) == TRACKED.max_tokens
    assert beside[0] == alone[0]
    assert beside[1] == alone[1]  # every log-probability the same bits
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("packed", [False, True])
def test_matmul_rows_same_at_every_row_count(dtype, packed):
    """Each row of ``packed_linear.linear``'s output is the same bits alone and among any number
    of rows. The shapes are large enough that the orders' differences show: without the
    padding, one bf16 row alone differed from the same row among others in about 1 output in
    4,000 here (``MIN_ROWS = 1``: 4 to 12 of every batch's outputs below), a float32 row in a
    block's tail in most of its outputs."""
    if reason := unmeasured(dtype):
        pytest.skip(reason)
    gen = torch.Generator().manual_seed(0)
    x = (F.silu(3 * torch.randn(80, 1536, generator=gen)) * torch.randn(80, 1536, generator=gen)).to(getattr(torch, dtype))
    weight = (0.02 * torch.randn(3072, 1536, generator=gen)).to(x.dtype)
    pack = packed_linear.pack(weight) if packed else None
    if packed and pack is None:
        pytest.skip("weights of this dtype are not packed here")
    alone = torch.cat([packed_linear.linear(x[i:i + 1], weight, None, pack) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 7, 9, 17, 64, 65, 80):
        out = packed_linear.linear(x[:rows], weight, None, pack)
        assert torch.equal(out, alone[:rows]), (rows, (out != alone[:rows]).sum().item())
