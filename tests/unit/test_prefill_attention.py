"""Prefill attention on the CPU (``Attention._attend_blocked``) against a float64 reference,
and against torch's ``scaled_dot_product_attention`` path it replaces."""

from __future__ import annotations

import pytest
import torch

from epdserve.models.layers import attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [start + n, KVH, D]: causal attention in float64."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    visible = torch.arange(k.shape[0])[None, :] <= torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


CASES = [
    # heads, kv heads, head_dim, cached prefix, new tokens
    (9, 3, 64, 0, 300),  # a whole prompt, blocks of 64 and a partial last block
    (9, 3, 64, 56, 256),  # an image-sized chunk after a short text prefix
    (9, 3, 64, 1080, 130),
    (4, 1, 256, 0, 200),  # Gemma-3's shape
    (6, 6, 80, 140, 1),  # one token over a long prefix, no GQA
    (8, 2, 64, 64, 64),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}-kv{}-d{}-p{}-n{}".format(*c))
def test_blocked_matches_reference(case, dtype: torch.dtype, tol: float) -> None:
    heads, kv_heads, dim, start, n = case
    gen = torch.Generator().manual_seed(start * 7 + n)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    k = torch.randn(start + n, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(start + n, kv_heads, dim, generator=gen).to(dtype)
    layer = attention.Attention(heads, kv_heads, dim, dim**-0.5, layer_idx=0)
    out = layer._attend_blocked(q, k, v, start)
    assert out.shape == (n, heads, dim) and out.dtype == dtype
    expected = reference(q, k, v, start, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_blocked_as_accurate_as_torch_sdpa(monkeypatch) -> None:
    """bf16 inputs: the blocked path's error against float64 is no worse than torch's kernel's
    (both score and normalise in float32 and round the probabilities to bf16)."""
    gen = torch.Generator().manual_seed(0)
    start, n = 312, 256
    q = (2 * torch.randn(n, 9, 64, generator=gen)).bfloat16()
    k = (2 * torch.randn(start + n, 3, 64, generator=gen)).bfloat16()
    v = torch.randn(start + n, 3, 64, generator=gen).bfloat16()
    layer = attention.Attention(9, 3, 64, 0.125, layer_idx=0)
    expected = reference(q, k, v, start, 0.125)
    monkeypatch.setattr(attention, "BLOCKED_CPU_PREFILL", True)
    blocked = (layer._attend(q, k, v, start).double() - expected).abs().mean()
    monkeypatch.setattr(attention, "BLOCKED_CPU_PREFILL", False)
    sdpa = (layer._attend(q, k, v, start).double() - expected).abs().mean()
    assert blocked <= 1.5 * sdpa


def test_sliding_window_beyond_the_window_uses_the_masked_path(monkeypatch) -> None:
    """A window shorter than the keys is not the blocked path's case: the masked path runs."""
    called = []
    monkeypatch.setattr(attention, "BLOCKED_CPU_PREFILL", True)
    monkeypatch.setattr(attention.Attention, "_attend_blocked", lambda *a: called.append(a))
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(200, 2, 32, generator=gen) for _ in range(3))
    windowed = attention.Attention(2, 2, 32, 32**-0.5, layer_idx=0, sliding_window=64)
    out = windowed._attend(q, k, v, 0)
    assert not called
    keys = torch.arange(200)
    visible = (keys[None, :] <= keys[:, None]) & (keys[None, :] > keys[:, None] - 64)
    scores = torch.einsum("qhd,khd->hqk", q, k) * 32**-0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    attention.Attention(2, 2, 32, 32**-0.5, layer_idx=0)._attend(q, k, v, 0)
    assert len(called) == 1


def test_scratch_buffers_serve_calls_inside_and_outside_inference_mode():
    """The reused score buffers are first allocated under inference mode (as in the engine)
    and then written by a call outside it, and the other way round."""
    gen = torch.Generator().manual_seed(3)
    layer = attention.Attention(4, 2, 32, 32**-0.5, layer_idx=0)
    q, k, v = (torch.randn(150, h, 32, generator=gen) for h in (4, 2, 2))
    expected = reference(q, k, v, 0, 32**-0.5)
    attention._scratch_local.__dict__.pop("buffers", None)
    with torch.inference_mode():
        inside = layer._attend_blocked(q, k, v, 0)
    outside = layer._attend_blocked(q, k, v, 0)
    with torch.inference_mode():
        again = layer._attend_blocked(q, k, v, 0)
    for out in (inside, outside, again):
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_blocked_path_taken_only_where_measured_faster(monkeypatch, fast_bf16: bool) -> None:
    """By default (``BLOCKED_CPU_PREFILL = None``) bf16 on a CPU with a bf16 matmul path takes the
    blocked path and everything else torch's; True / False force either."""
    monkeypatch.setattr(attention, "cpu_has_fast_bf16", lambda: fast_bf16)
    called = []
    monkeypatch.setattr(attention.Attention, "_attend_blocked", lambda *a: called.append(a[1].dtype))
    layer = attention.Attention(4, 2, 32, 32**-0.5, layer_idx=0)
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(150, h, 32, generator=gen).to(dtype) for h in (4, 2, 2))
        layer._attend(q, k, v, 0)
    assert called == ([torch.bfloat16] if fast_bf16 else [])
    for forced in (True, False):
        monkeypatch.setattr(attention, "BLOCKED_CPU_PREFILL", forced)
        called.clear()
        layer._attend(q, k, v, 0)
        assert called == ([torch.float32] if forced else [])
