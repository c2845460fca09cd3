"""Prefill attention of one sequence (``Attention._attend``: torch's fused kernel, causal or
with a mask for a cached prefix or a sliding window) against a float64 reference."""

from __future__ import annotations

import pytest
import torch

from epdserve.models.layers import attention


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float, window: int | None = None
) -> torch.Tensor:
    """q [n, H, D] at positions start.., k/v [start + n, KVH, D]: causal attention in float64."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    key_pos, query_pos = torch.arange(k.shape[0])[None, :], torch.arange(start, start + q.shape[0])[:, None]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


CASES = [
    # heads, kv heads, head_dim, cached prefix, new tokens
    (9, 3, 64, 0, 300),  # a whole prompt
    (9, 3, 64, 56, 256),  # an image-sized chunk after a short text prefix
    (9, 3, 64, 1080, 130),
    (4, 1, 256, 0, 200),  # Gemma-3's shape
    (6, 6, 80, 140, 1),  # one token over a long prefix, no GQA
    (8, 2, 64, 64, 64),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}-kv{}-d{}-p{}-n{}".format(*c))
def test_matches_reference(case, dtype: torch.dtype, tol: float) -> None:
    heads, kv_heads, dim, start, n = case
    gen = torch.Generator().manual_seed(start * 7 + n)
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    k = torch.randn(start + n, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(start + n, kv_heads, dim, generator=gen).to(dtype)
    layer = attention.Attention(heads, kv_heads, dim, dim**-0.5, layer_idx=0)
    out = layer._attend(q, k, v, start)
    assert out.shape == (n, heads, dim) and out.dtype == dtype
    expected = reference(q, k, v, start, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("start", [0, 100])
def test_sliding_window_shorter_than_the_keys(start: int) -> None:
    """A window shorter than the keys masks the keys it has slid past (with and without a
    cached prefix); a window longer than them is plain causal attention."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(200, 2, 32, generator=gen)
    k, v = (torch.randn(start + 200, 2, 32, generator=gen) for _ in range(2))
    windowed = attention.Attention(2, 2, 32, 32**-0.5, layer_idx=0, sliding_window=64)
    expected = reference(q, k, v, start, 32**-0.5, window=64)
    torch.testing.assert_close(windowed._attend(q, k, v, start).double(), expected, atol=1e-5, rtol=1e-5)
    wide = attention.Attention(2, 2, 32, 32**-0.5, layer_idx=0, sliding_window=4096)
    torch.testing.assert_close(
        wide._attend(q, k, v, start).double(), reference(q, k, v, start, 32**-0.5), atol=1e-5, rtol=1e-5
    )
