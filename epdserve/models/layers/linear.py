"""Linear layers shaped for tensor parallelism (TP).

Every layer holds only this rank's shard of the full Hugging Face weight and exposes
``param.weight_loader(param, full_weight, shard_id=None)``, which copies the rank's slice
of a full (unsharded) checkpoint tensor into the parameter.

    column-parallel: weight [out_total / tp, in]   output features split, no communication
    row-parallel:    weight [out, in_total / tp]   input features split, partial sums all-reduced

A column-parallel layer feeds a row-parallel one (qkv -> o_proj, gate_up -> down), so one
all-reduce per pair is the only communication. With ``tp_size == 1`` every layer is a plain
``F.linear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from epdserve.models.layers.packed_linear import linear
from epdserve.transfer.tp_plan import kv_heads_of_rank


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


def _new_param(
    shape: tuple[int, ...], dtype: torch.dtype | None, device: torch.device | str | None
) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _LinearBase(nn.Module):
    """Holds a [out_local, in_local] weight and an optional [out_local] bias."""

    def __init__(
        self,
        input_size_per_rank: int,
        output_size_per_rank: int,
        bias: bool,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} outside [0, {tp_size})")
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.input_size_per_rank = input_size_per_rank
        self.output_size_per_rank = output_size_per_rank
        self.weight = _new_param((output_size_per_rank, input_size_per_rank), dtype, device)
        self.weight.weight_loader = self.weight_loader
        self.packed_weight: torch.Tensor | None = None  # set by packed_linear.prepack_model
        if bias:
            self.bias = _new_param((output_size_per_rank,), dtype, device)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class ColumnParallelLinear(_LinearBase):
    """y = x W^T + b with W's rows (output features) split evenly across ranks."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(input_size, divide(output_size, tp_size), bias, tp_rank, tp_size, dtype, device)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        size = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers sharing one input, fused into one matmul.

    Output layout per rank: [shard 0 | shard 1 | ...], each shard this rank's slice of the
    corresponding full weight (e.g. gate_up = [gate_local | up_local]).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dtype=dtype,
            device=device,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index into {self.output_sizes}, got {shard_id!r}")
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        size = divide(self.output_sizes[shard_id], self.tp_size)
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; each rank owns whole attention heads.

    Output layout per rank: [q: num_heads * head_dim | k: num_kv_heads * head_dim | v: same].
    When ``tp_size`` exceeds the number of KV heads, each rank holds one KV head, shared by
    ``tp_size / total_num_kv_heads`` consecutive ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp_size)
        self.kv_head_start, self.num_kv_heads = kv_heads_of_rank(total_num_kv_heads, tp_rank, tp_size)
        output_size_per_rank = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        _LinearBase.__init__(self, hidden_size, output_size_per_rank, bias, tp_rank, tp_size, dtype, device)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp_rank * self.q_size
        elif shard_id == "k":
            offset, size, start = self.q_size, self.kv_size, self.kv_head_start * self.head_dim
        elif shard_id == "v":
            offset = self.q_size + self.kv_size
            size, start = self.kv_size, self.kv_head_start * self.head_dim
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, start, size))


class RowParallelLinear(_LinearBase):
    """y = x W^T + b with W's columns (input features) split across ranks.

    The input is the rank's slice of the features (the output of a column-parallel layer);
    the partial products are summed with one all-reduce, then the (replicated) bias is added.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(divide(input_size, tp_size), output_size, bias, tp_rank, tp_size, dtype, device)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if param.dim() == 1:
            param.data.copy_(loaded_weight)
            return
        size = param.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias, self.packed_weight)
        y = linear(x, self.weight, None, self.packed_weight)
        dist.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


@dataclass(frozen=True)
class Placement:
    """Where a model's layers live: tensor-parallel rank among ``tp_size``, dtype, device."""

    tp_rank: int = 0
    tp_size: int = 1
    dtype: torch.dtype | None = None
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} outside [0, {self.tp_size})")

    @property
    def parallel_args(self) -> dict[str, Any]:
        """Keyword arguments of the tensor-parallel layers."""
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size, "dtype": self.dtype, "device": self.device}

    @property
    def tensor_args(self) -> dict[str, Any]:
        """Keyword arguments of the replicated layers (norms, rotary embedding)."""
        return {"dtype": self.dtype, "device": self.device}
