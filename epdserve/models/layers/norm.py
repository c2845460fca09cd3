"""RMS normalisation over the last dimension (replicated on every tensor-parallel rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.models.layers import paged_attention_cpu


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last ``hidden_size`` features."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if paged_attention_cpu.can_rms_norm(x, self.weight):  # one kernel call on the CPU
            return paged_attention_cpu.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: ``residual = x + residual`` (rounded to the dtype),
        returned with ``norm(residual)``. Both inputs may be overwritten (on the CPU one kernel
        writes the sum into ``residual`` and the norm into ``x``)."""
        if (paged_attention_cpu.can_rms_norm(x, self.weight) and residual.is_contiguous()
                and residual.dtype == x.dtype and residual.shape == x.shape):
            paged_attention_cpu.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        residual = x.add_(residual)
        return self(residual), residual


class GemmaRMSNorm(RMSNorm):
    """Gemma's variant, y = norm(x) * (1 + w), with checkpoints storing w.

    The parameter holds (1 + w), added once in float32 at load time, so the forward pass is
    the plain RMSNorm kernel.
    """

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        param.data.copy_(loaded_weight.float() + 1.0)


class QKNorm(nn.Module):
    """Per-head RMSNorm of the query and key heads in one call (Qwen3, Gemma3).

    Input is the fused [T, num_heads + num_kv_heads, head_dim] block of q and k heads; the
    parameter is [num_heads + num_kv_heads, head_dim], rows [:num_heads] holding the
    checkpoint's ``q_norm`` weight and the rest its ``k_norm`` weight, so one normalisation
    and one multiply cover both. Loaded with shard_id "q" or "k".
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(num_heads + num_kv_heads, head_dim, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader

    def _stored_value(self, loaded_weight: torch.Tensor) -> torch.Tensor:
        return loaded_weight

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id == "q":
            rows = param.data[: self.num_heads]
        elif shard_id == "k":
            rows = param.data[self.num_heads :]
        else:
            raise ValueError(f"shard_id must be 'q' or 'k', got {shard_id!r}")
        rows.copy_(self._stored_value(loaded_weight).expand_as(rows))

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(qk, (self.head_dim,), None, self.eps).mul_(self.weight)


class GemmaQKNorm(QKNorm):
    """``QKNorm`` with Gemma's (1 + w) weights, stored with the 1 added."""

    def _stored_value(self, loaded_weight: torch.Tensor) -> torch.Tensor:
        return loaded_weight.float() + 1.0
