"""Linear layers with weights pre-packed for oneDNN on the CPU.

``F.linear`` on a bfloat16 CPU tensor re-lays the weight out for oneDNN on every call;
packing it once after loading saves that on every step (most at small batch: decode).
The packed copy is opaque, so the plain weight stays for loading and sharding.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.config import cpu_has_fast_bf16

log = logging.getLogger(__name__)

# Rows per call the packing is tuned for: a decode batch.
DEFAULT_BATCH_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    """A bf16 CPU matrix, on a CPU where oneDNN has a bf16 matmul path (AVX-512 or AMX; on
    others it refuses the packing and ``F.linear`` is the only path)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and cpu_has_fast_bf16())


def pack(weight: torch.Tensor, batch_hint: int = DEFAULT_BATCH_HINT) -> torch.Tensor | None:
    """The oneDNN layout of ``weight`` [out, in], or None where it cannot be packed."""
    if not can_pack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    if packed is None or x.dim() != 2:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepack_model(model: nn.Module) -> int:
    """Pack every module's ``weight`` that declares a ``packed_weight`` slot; returns the count."""
    count = 0
    for module in model.modules():
        if hasattr(module, "packed_weight") and isinstance(getattr(module, "weight", None), torch.Tensor):
            try:
                module.packed_weight = pack(module.weight)
            except (RuntimeError, AttributeError) as e:  # a torch build without oneDNN
                log.warning("cannot pre-pack linear weights (%s); using F.linear", e)
                return count
            count += module.packed_weight is not None
    return count
