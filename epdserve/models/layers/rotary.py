"""Rotary position embedding (RoPE), neox / Hugging Face "rotate_half" layout.

Head dimension D is split in halves (x1 = x[:D/2], x2 = x[D/2:]); pair i rotates by angle
position * inv_freq[i]:

    out[:D/2] = x1 * cos - x2 * sin
    out[D/2:] = x2 * cos + x1 * sin

cos and sin are precomputed in float32 for every position < max_position and stored in the
model dtype as one [max_position, D] cache ([cos | sin]); a forward pass gathers the rows of
its positions once and reuses them in every layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epdserve.models.layers import paged_attention_cpu

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Base frequency and optional context-extension scaling of one rotary embedding."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r} (supported: {ROPE_TYPES})")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"invalid rope parameters theta={self.theta} factor={self.factor}")

    @classmethod
    def from_hf(cls, params: Mapping[str, Any] | None, theta: float) -> RopeConfig:
        """From a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (may be None).

        ``theta`` is used where the dict carries no ``rope_theta``.
        """
        params = dict(params or {})
        rope_type = params.get("rope_type") or params.get("type") or "default"
        return cls(
            theta=float(params.get("rope_theta", theta)),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        )


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """[head_dim / 2] float32 angular frequencies, computed as Hugging Face does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_context = rope.original_max_position_embeddings
        low_freq_wavelen = old_context / rope.low_freq_factor
        high_freq_wavelen = old_context / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_context / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Holds the [max_position, head_dim] ``[cos | sin]`` cache of one RoPE configuration."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope: RopeConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = inverse_frequencies(head_dim, rope)
        positions = torch.arange(max_position, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(device=device, dtype=dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] int64 -> their [T, head_dim] rows ``[cos | sin]`` (for ``apply_rotary``)."""
        return self.cos_sin_cache.index_select(0, positions)


def apply_rotary(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, num_heads, D] by cos_sin [T, D] (``RotaryEmbedding.cos_sin``).

    On the CPU one kernel rotates x in place and returns it; elsewhere a new tensor. Either
    way each product and sum is rounded to x's dtype, as Hugging Face's rotate_half computes it.
    """
    if x.stride(-1) == 1 and cos_sin.dtype == x.dtype and paged_attention_cpu.can_run(x):
        paged_attention_cpu.rotary_(x, cos_sin)
        return x
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
