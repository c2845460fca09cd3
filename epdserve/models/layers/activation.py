"""Gated activations over a fused [gate | up] projection: [T, 2 * I] -> [T, I]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.models.layers import paged_attention_cpu


class SiluAndMul(nn.Module):
    """silu(gate) * up (SwiGLU: Llama, Qwen)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.is_contiguous() and paged_attention_cpu.can_run(gate_up):  # one kernel on the CPU
            return paged_attention_cpu.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (GeGLU with the tanh approximation: Gemma)."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)


_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
}


def get_gated_activation(name: str) -> nn.Module:
    """The gated activation for a Hugging Face ``hidden_act`` name."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}")
    return _ACTIVATIONS[name]()
