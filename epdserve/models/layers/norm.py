"""RMS normalisation over the last dimension (replicated on every tensor-parallel rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        param.data.copy_(loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's variant, y = norm(x) * (1 + w), with checkpoints storing w.

    The parameter holds (1 + w), added once in float32 at load time, so the forward pass is
    the plain RMSNorm kernel.
    """

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        param.data.copy_(loaded_weight.float() + 1.0)
