"""The fused CPU paged decode-attention kernel against a float64 gather + softmax reference,
the prefill attention kernel against a float64 reference and torch's kernel, the elementwise
kernels, and the engine's greedy outputs with the kernels on and off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import PROMPTS

from epdserve import envs
from epdserve.models.layers import paged_attention_cpu

pytestmark = pytest.mark.skipif(
    not paged_attention_cpu.is_available(), reason="CPU paged attention kernel could not be built here"
)


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """Gathers each sequence's keys/values and attends in float64: [B, H, D]."""
    _, _, block_size, num_kv_heads, _ = cache.shape
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, context_len in enumerate(context_lens.tolist()):
        num_blocks = -(-context_len // block_size)
        pages = cache[:, block_tables[b, :num_blocks]].double()  # [2, n, bs, KVH, D]
        keys = pages[0].flatten(0, 1)[:context_len].repeat_interleave(group, dim=1)  # [L, H, D]
        values = pages[1].flatten(0, 1)[:context_len].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].double(), keys) * scale
        if sliding_window:
            scores[:, : max(0, context_len - sliding_window)] = float("-inf")
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values)
    return out


def random_case(
    batch: int, num_heads: int, num_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q and pages; each sequence gets distinct shuffled blocks, its table padded with
    block 0 (a zero-filled null block, as the engine's tables are)."""
    gen = torch.Generator().manual_seed(seed)
    block_size = 16
    max_blocks = -(-max_len // block_size) + 2  # trailing padding in every row
    num_blocks = 1 + batch * max_blocks
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    cache[:, 0] = 0
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    context_lens[0] = max_len
    block_tables = torch.zeros(batch, max_blocks, dtype=torch.int64)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for b, context_len in enumerate(context_lens.tolist()):
        used = -(-context_len // block_size)
        block_tables[b, :used] = torch.tensor([free.pop() for _ in range(used)])
    return q, cache, block_tables, context_lens


CASES = [
    # batch, heads, kv heads, head_dim, max context
    (1, 4, 4, 64, 1),
    (3, 9, 3, 64, 37),
    (8, 8, 2, 64, 130),
    (5, 4, 1, 256, 77),
    (4, 8, 2, 128, 90),
    (16, 9, 3, 64, 301),
    (2, 6, 2, 80, 50),
    (2, 18, 2, 64, 45),  # 9 query heads per KV head: bf16 takes the online-softmax kernel
]


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("sliding_window", [0, 24])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-h{}-kv{}-d{}-L{}".format(*c))
def test_kernel_matches_reference(case, sliding_window: int, dtype: torch.dtype, rtol: float) -> None:
    batch, num_heads, num_kv_heads, head_dim, max_len = case
    q, cache, tables, lens = random_case(
        batch, num_heads, num_kv_heads, head_dim, max_len, dtype, seed=sum(case)
    )
    scale = head_dim**-0.5
    out = paged_attention_cpu.paged_decode_attention(q, cache, tables, lens, scale, sliding_window)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, cache, tables, lens, scale, sliding_window)
    # Relative to the output's magnitude: bf16 output rounding alone is ~4e-3 of it.
    tolerance = rtol * expected.abs().max().item()
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=tolerance)


def test_kernel_accepts_strided_inputs() -> None:
    """q as a view of a wider activation, block tables as rows of a larger table (as in the engine)."""
    q, cache, tables, lens = random_case(4, 9, 3, 64, 40, torch.float32, seed=7)
    wide_q = torch.randn(6, 9, 64 * 2)[:4, :, :64]
    wide_q.copy_(q)
    wide_tables = torch.cat([tables, torch.zeros(4, 5, dtype=torch.int64)], dim=1)
    wide_tables = torch.cat([wide_tables, wide_tables])[:4]
    out = paged_attention_cpu.paged_decode_attention(wide_q, cache, wide_tables, lens, 0.125, 0)
    torch.testing.assert_close(
        out.double(), reference(q, cache, tables, lens, 0.125, 0), rtol=1e-5, atol=1e-5
    )


def prefill_reference(q, k, v, start_pos: int, scale: float, window: int) -> torch.Tensor:
    """Causal (optionally windowed) attention of q [n, H, D] at positions start_pos.. over
    k, v [S, KVH, D] in float64: [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1)
    values = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.double(), keys) * scale
    q_pos = torch.arange(start_pos, start_pos + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    seen = k_pos <= q_pos
    if window:
        seen &= k_pos > q_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(dim=-1), values)


def prefill_case(n: int, start_pos: int, heads: int, kv_heads: int, dim: int, seed: int):
    """q, k, v as the engine's views of one fused qkv activation (token stride > row)."""
    gen = torch.Generator().manual_seed(seed)
    total = start_pos + n
    qkv = (torch.randn(total, (heads + 2 * kv_heads) * dim, generator=gen) * 2).bfloat16()
    q = qkv[start_pos:, : heads * dim].view(n, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(total, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(total, kv_heads, dim)
    return q, k, v


needs_prefill_kernel = pytest.mark.skipif(
    not paged_attention_cpu.is_available() or not paged_attention_cpu._has_prefill_attention(),
    reason="the prefill attention kernel needs a CPU with AVX512-BF16",
)


@needs_prefill_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 1, 256), (8, 8, 128)])
@pytest.mark.parametrize(
    "n,start_pos,window", [(256, 0, 0), (37, 0, 0), (100, 300, 0), (256, 0, 100), (1, 50, 0), (300, 17, 64), (5, 0, 1)]
)
def test_prefill_kernel_matches_reference(heads, kv_heads, dim, n, start_pos, window) -> None:
    """Within bf16 rounding of the float64 reference, and as close as torch's own bf16 kernel."""
    q, k, v = prefill_case(n, start_pos, heads, kv_heads, dim, seed=n + start_pos)
    # taken by the engine where it is the faster kernel (not on AMX CPUs)
    assert paged_attention_cpu.can_prefill(q, k, v) == paged_attention_cpu._PREFILL_KERNEL_PREFERRED
    scale = dim**-0.5
    got = paged_attention_cpu.prefill_attention(q, k, v, start_pos, scale, window)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    expected = prefill_reference(q, k, v, start_pos, scale, window)
    q_pos = torch.arange(start_pos, start_pos + n)[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
    torch_bf16 = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )[0].transpose(0, 1)
    torch_error = (torch_bf16.double() - expected).abs().max().item()
    assert (got.double() - expected).abs().max().item() <= max(1.25 * torch_error, 1e-6)
    # Both round the probabilities to bf16 before the value product: mostly the same bits.
    assert (got == torch_bf16).float().mean().item() > 0.8


@needs_prefill_kernel
@pytest.mark.parametrize("window", [0, 40])
def test_prefill_kernel_same_bits_in_chunks(window) -> None:
    """A prompt attended in chunks (a cached prefix, chunked prefill) gives the rows the same
    bits as attended at once: each row's keys and sums do not depend on the call's rows."""
    q, k, v = prefill_case(300, 0, 9, 3, 64, seed=3)
    whole = paged_attention_cpu.prefill_attention(q, k, v, 0, 0.125, window)
    for start in (0, 1, 17, 160, 299):
        for end in (start + 1, min(300, start + 33), 300):
            part = paged_attention_cpu.prefill_attention(q[start:end], k[:end], v[:end], start, 0.125, window)
            assert torch.equal(part, whole[start:end]), (start, end)


@needs_prefill_kernel
def test_prefill_kernel_refuses_bad_inputs() -> None:
    q, k, v = prefill_case(8, 4, 4, 2, 64, seed=1)
    with pytest.raises(RuntimeError):  # k must hold start_pos + n tokens
        paged_attention_cpu.prefill_attention(q, k[:-1], v[:-1], 4, 0.125, 0)
    with pytest.raises(RuntimeError):
        paged_attention_cpu.prefill_attention(q, k, v[:, :1], 4, 0.125, 0)
    with pytest.raises(RuntimeError):
        paged_attention_cpu.prefill_attention(q.float(), k, v, 4, 0.125, 0)
    with pytest.raises(RuntimeError):  # head size without registers for it
        qq, kk, vv = (t[..., :32] for t in (q, k, v))
        paged_attention_cpu.prefill_attention(qq, kk, vv, 4, 0.125, 0)
    assert not paged_attention_cpu.can_prefill(q.float(), k.float(), v.float())
    assert not paged_attention_cpu.can_prefill(q[..., :32], k[..., :32], v[..., :32])


@pytest.mark.slow  # compiles the extension from scratch (~20 s)
def test_concurrent_first_build(tmp_path) -> None:
    """Two processes building into an empty extensions directory at once both get the kernel."""
    script = textwrap.dedent(
        """
        import torch
        from epdserve.models.layers import paged_attention_cpu as p
        assert p.is_available()
        q = torch.ones(1, 1, 64)
        cache = torch.ones(2, 1, 16, 1, 64)
        out = p.paged_decode_attention(q, cache, torch.zeros(1, 1, dtype=torch.int64),
                                       torch.tensor([3]), 0.125, 0)
        assert torch.equal(out, q)
        """
    )
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE) for _ in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr.decode()


@pytest.mark.slow
def test_engine_greedy_same_with_and_without_kernel(monkeypatch) -> None:
    from epdserve.config import EngineArgs
    from epdserve.engine.engine import LLMEngine
    from epdserve.sampling import SamplingParams

    engine = LLMEngine(EngineArgs(dtype="float32", kv_cache_memory_gib=0.1))
    texts = PROMPTS[:8]
    prompts = [engine.encode_prompt(t) for t in texts]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    calls = []
    # The kernel runs from Python (a step with prompt tokens) or inside decode_layers (a decode
    # step of the Llama family's layers in one extension call).
    for name in ("paged_decode_attention", "decode_layers"):
        kernel = getattr(paged_attention_cpu, name)
        monkeypatch.setattr(paged_attention_cpu, name, lambda *a, kernel=kernel: calls.append(1) or kernel(*a))
    with_kernel = [c.token_ids for (c,) in engine.generate(prompts, params)]
    assert calls, "the decode steps did not use the kernel"
    monkeypatch.setenv(envs.EPDSERVE_DISABLE_CPU_KERNELS, "1")
    assert not paged_attention_cpu.is_available()
    without_kernel = [c.token_ids for (c,) in engine.generate(prompts, params)]
    assert with_kernel == without_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (37, 576), (3, 4, 64)])
def test_rms_norm_kernel_rounds_as_the_reference(dtype, shape):
    """Hugging Face's LlamaRMSNorm: float32 statistics, the normalised row cast to the dtype,
    then times the weight."""
    x = torch.randn(shape, dtype=dtype) * 3
    weight = torch.randn(shape[-1], dtype=dtype)
    assert paged_attention_cpu.can_rms_norm(x, weight)
    got = paged_attention_cpu.rms_norm(x, weight, 1e-5)
    xf = x.float()
    expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    # bfloat16: a rounding step apart at most (the float32 sums run in another order)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.01}
    torch.testing.assert_close(got, expected, **tol)
    assert got.dtype == dtype and got.shape == x.shape


# Tolerances of the elementwise kernels against the torch ops they replace: bfloat16 rounds each
# op as torch does (a rounding step apart at most where float32 sums run in another order);
# float32 differs by float32 rounding (sum order, the exponential's polynomial).
_EXACT = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 0.0, "rtol": 0.0}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (64, 576), (2048, 576), (5, 37)])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, shape):
    """residual <- dtype(x + residual) exactly; x <- rms_norm(residual) as the kernel alone."""
    gen = torch.Generator().manual_seed(shape[0])
    x, residual = ((torch.randn(shape, generator=gen) * 3).to(dtype) for _ in range(2))
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    expected_sum = x + residual
    expected_norm = paged_attention_cpu.rms_norm(expected_sum, weight, 1e-6)
    paged_attention_cpu.add_rms_norm_(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_sum)
    assert torch.equal(x, expected_norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 3072), (64, 3072), (3, 2, 26), (700, 3072)])
def test_silu_and_mul_matches_torch(dtype, shape):
    gen = torch.Generator().manual_seed(shape[0])
    gate_up = (torch.randn(shape, generator=gen) * 4).to(dtype)
    gate_up[..., 0] = torch.tensor([-200.0, 200.0, 0.0][shape[0] % 3])  # exp's far ends
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate).mul_(up)
    got = paged_attention_cpu.silu_and_mul(gate_up)
    assert got.shape == expected.shape and got.dtype == dtype
    if dtype == torch.bfloat16:  # a rounding step apart, and only where a product ties
        diff = got.float() - expected.float()
        # At exp's far end (x = -200) the kernel's vector exp, built for AVX2, saturates where
        # torch's gives inf: its silu is then ~-7e-36 where torch's is -0. That is 0 for every
        # purpose here, and not a rounding step.
        assert (diff.abs() > 1e-30).float().mean() < 1e-3
        torch.testing.assert_close(got, expected, atol=0.02, rtol=0.01)
    else:
        torch.testing.assert_close(got, expected, **_EXACT[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 12, 64), (64, 12, 64), (9, 5, 256), (3, 2, 10)])
def test_rotary_in_place_matches_rotate_half(dtype, tokens, heads, dim):
    """In place over the q and k heads of a fused qkv row (strided), leaving v untouched; each
    product and sum rounded as torch's ops round them."""
    from epdserve.models.layers import rotary

    gen = torch.Generator().manual_seed(tokens * heads)
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=gen).to(dtype)
    cos_sin = torch.randn(tokens, dim, generator=gen).to(dtype)
    x = qkv[:, : heads * dim].view(tokens, heads, dim)
    v_before = qkv[:, heads * dim :].clone()
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    assert rotary.apply_rotary(x, cos_sin) is x
    assert torch.equal(x, expected)
    assert torch.equal(qkv[:, heads * dim :], v_before)


def test_elementwise_kernels_refuse_bad_inputs():
    """Shape and dtype mismatches raise (a RuntimeError), never write out of bounds."""
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError):
        paged_attention_cpu.add_rms_norm_(x, torch.randn(4, 9), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError):
        paged_attention_cpu.add_rms_norm_(x, torch.randn(4, 8).bfloat16(), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError):
        paged_attention_cpu.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(RuntimeError):
        paged_attention_cpu.rotary_(torch.randn(4, 2, 8), torch.randn(3, 8))
    with pytest.raises(RuntimeError):
        paged_attention_cpu.rotary_(torch.randn(4, 2, 8), torch.randn(4, 8).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 5, 17, 49152])
def test_argmax_rows_is_torch_first_maximum(dtype, vocab):
    """The first maximum of each row, ties, infinities and NaNs (the first NaN wins) as torch's
    max(dim).indices; rows may be strided."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab + 3, generator=gen).to(dtype)[:, :vocab]
    logits[1] = 1.0  # all tied: index 0
    logits[2] = float("-inf")
    logits[3, -1] = float("inf")
    logits[4, vocab // 2] = float("nan")
    logits[5, -1] = float("nan")
    logits[6, vocab // 3 :] = 7.0  # a tie after the start
    got = paged_attention_cpu.argmax_rows(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.max(dim=-1).indices)
