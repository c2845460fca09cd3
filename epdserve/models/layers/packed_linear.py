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

from epdserve.config import cpu_has_onednn_bf16

log = logging.getLogger(__name__)

# Rows per call the packing is tuned for: a decode batch.
DEFAULT_BATCH_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    """A bf16 CPU matrix, on a CPU where oneDNN has a bf16 matmul path (AVX-512 or AMX; on
    others it refuses the packing and ``F.linear`` is the only path)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and cpu_has_onednn_bf16())


def pack(weight: torch.Tensor, batch_hint: int = DEFAULT_BATCH_HINT) -> torch.Tensor | None:
    """The oneDNN layout of ``weight`` [out, in], or None where it cannot be packed."""
    if not can_pack(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


EXACT_ROWS = 64  # decode batches: memory-bound, where padding rows would cost the most

# Rows are padded so that a row's output is the same bits whatever else is in its step (a
# sequence decoding alone, beside others, or beside a prompt): the BLAS libraries sum some row
# counts in another order. Measured on AVX-512 (tests/unit/test_batch_invariance.py): oneDNN's
# bf16 matmul takes a path of its own for one row and one order for any two or more; MKL's
# float32 matmul runs blocks of four rows and sums a block's one-to-three-row tail otherwise.
MIN_ROWS = 2  # bf16 (and other reduced-precision) matmuls
FLOAT32_ROW_MULTIPLE = 4


def padded_rows(num_rows: int) -> int:
    """The row count a packed matmul runs with: at least ``MIN_ROWS``, exact up to
    ``EXACT_ROWS``, above that rounded up to a multiple of 1/8 of its power of two (65-128 by 8,
    129-256 by 16, ...: under 1/8 extra).

    oneDNN builds and caches a primitive per input shape, each with buffers of its own, and a
    serving worker's steps have every row count from 1 to the token budget: with exact shapes
    the process grew by gigabytes (``benchmarks/packed_linear_memory.py``); with these about
    100 row counts up to 2048 it stays bounded.
    """
    if num_rows <= EXACT_ROWS:
        return max(num_rows, MIN_ROWS)
    step = 1 << (num_rows.bit_length() - 4)  # num_rows in (2^k, 2^(k+1)]: step 2^(k-3)
    return -(-num_rows // step) * step


def linear_rows(num_rows: int, dtype: torch.dtype, packed: bool) -> int:
    """Rows a CPU matmul of ``num_rows`` runs with: ``padded_rows`` for packed weights; for
    plain ones, float32 in whole blocks of ``FLOAT32_ROW_MULTIPLE``, others at least
    ``MIN_ROWS``."""
    if packed:
        return padded_rows(num_rows)
    if dtype == torch.float32:
        return -(-num_rows // FLOAT32_ROW_MULTIPLE) * FLOAT32_ROW_MULTIPLE
    return max(num_rows, MIN_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``, on the CPU with ``linear_rows`` rows (no row count makes
    cuBLAS's kernels batch-invariant: CUDA runs the rows as they come)."""
    if x.dim() != 2 or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    num_rows = x.shape[0]
    rows = linear_rows(num_rows, x.dtype, packed is not None)
    if rows != num_rows:
        x = F.pad(x, (0, 0, 0, rows - num_rows))
    if packed is None:
        out = F.linear(x, weight, bias)
    else:
        out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out if rows == num_rows else out[:num_rows]


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
