"""Fused paged decode attention for the CPU: one query token per sequence, K/V read in place.

The kernel walks each sequence's block table and reads key and value rows straight out of
the pages (no gather into a contiguous buffer) in tiles of 16 keys, with an online softmax
(running max and sum) per query head, so every K and V row of the context is read once from
memory; the next tile is prefetched. ``at::parallel_for`` splits the work over (sequence, KV
heads) tasks: all of a sequence's KV heads per task when the batch alone gives every thread
several tasks (each token row is then one contiguous read), single KV heads otherwise. The
query heads of a GQA group share each K/V row. With AVX-512, or AVX2 with FMA, and head_dim
64/128/256 a head's query and accumulator live in vector registers (bf16 scores via vdpbf16ps
where the CPU has it) and the softmax's exponentials are vectorized; other head sizes and CPUs
use plain float32 loops (on an AVX2 CPU those ran 1.5-1.8x slower than torch's path at 4-32
sequences). Accumulation is float32 throughout. bfloat16 on a CPU with AVX512-BF16 (up to 8
query heads per KV head) takes a second form of the kernel instead: three passes over a task's
context (all scores, one softmax per head over its row, then the values two keys per vdpbf16ps
with the probabilities rounded to bf16, as torch's flash kernel rounds them), 1.3x faster over
a pool-sized cache at batch 64.

``prefill_attention`` is the prompt side for bfloat16 on AVX512-BF16: one sequence's query
rows against its keys as small vdpbf16ps matrix products (keys and values packed so that each
instruction's operand is one load), the causal and window ranges per row.

The C++ source (``paged_attention_cpu.cpp`` beside this file) is compiled at first use with ``torch.utils.cpp_extension.load_inline`` for
the host CPU (``-march=native``) and cached by torch under its extensions directory; torch
holds a file lock while building, so concurrent first use by several processes builds once.
``is_available`` reports whether the build succeeded; callers fall back to the torch path
when it did not.

The same extension holds the elementwise kernels of a decoder layer on the CPU: ``rms_norm``
and ``add_rms_norm_`` (the residual add and the next norm in one pass; layers/norm.py),
``silu_and_mul`` (layers/activation.py) and ``rotary_`` (in place, layers/rotary.py). Each
replaces several torch ops (RMSNorm alone was about eight) and rounds where they round, so the
output is the same; small calls (a decode step's rows) run on the calling thread.

``decode_layers`` runs a Llama-family decoder's layers over a batch of single-token sequences
in one call (the same operations on the same kernels as the layers' Python, which a batch-1
step spent more time in than in its attention); ``llama.LlamaModel`` decides when it applies.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path
from types import ModuleType

import torch

from epdserve import envs

log = logging.getLogger("epdserve.kernels")

_EXTENSION_NAME = "epdserve_paged_attention_cpu"
# A build lock older than this was left by a process killed mid-build (a build takes seconds).
_STALE_LOCK_S = 600.0


def _cpu_tag() -> str:
    """Short hash of the CPU's feature flags: -march=native builds are not shared across CPUs."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.blake2b(flags.encode(), digest_size=4).hexdigest()


def _remove_stale_lock(name: str) -> None:
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
            log.warning("removed a stale build lock %s", lock)
    except FileNotFoundError:
        pass

# The kernel's source ships beside this module (package data, see pyproject.toml).
_CPP_SOURCE_PATH = Path(__file__).with_suffix(".cpp")

# -fopenmp: at::parallel_for is header code that runs serially without it; the extension then
# shares torch's bundled OpenMP runtime (same soname). -ffp-contract=off: a * b + c stays two
# roundings, as in the torch ops the elementwise kernels replace (the attention kernel asks for
# FMAs explicitly).
BUILD_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
BUILD_LDFLAGS = ["-fopenmp"]

_module: ModuleType | None = None
_build_failed = False

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _load() -> ModuleType | None:
    """Builds (or loads torch's cached build of) the extension once per process."""
    global _module, _build_failed
    if _module is None and not _build_failed:
        try:
            from torch.utils.cpp_extension import load_inline

            source = _CPP_SOURCE_PATH.read_text(encoding="utf-8")
            # The source's hash in the name: two versions of the package on one machine each
            # keep their build (under one name torch would rebuild whenever the other ran).
            source_tag = hashlib.blake2b(source.encode(), digest_size=4).hexdigest()
            name = f"{_EXTENSION_NAME}_{_cpu_tag()}_{source_tag}"
            _remove_stale_lock(name)
            _module = load_inline(
                name=name,
                cpp_sources=[source],
                functions=["paged_decode_attention", "rms_norm", "add_rms_norm_", "silu_and_mul", "rotary_",
                           "argmax_rows", "apply_token_bitmask_", "decode_layers", "has_prefill_attention",
                           "prefill_attention"],
                extra_cflags=BUILD_CFLAGS,
                extra_ldflags=BUILD_LDFLAGS,
            )
        except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: torch path
            _build_failed = True
            log.warning("CPU paged attention kernel unavailable, using the torch path: %s", exc)
    return _module


def is_available() -> bool:
    """The kernel is built (building it on the first call) and not disabled by the env."""
    if envs.is_cpu_kernels_disabled():
        return False
    return _load() is not None


def can_decode(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """The kernel can serve this decode: CPU tensors of one supported dtype, and it is available."""
    return (
        cache.device.type == "cpu"
        and q.dtype == cache.dtype
        and q.dtype in SUPPORTED_DTYPES
        and q.stride(-1) == 1
        and cache.is_contiguous()
        and is_available()
    )


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Attention of one query token per sequence over its pages.

    q [B, H, D]; cache [2, num_blocks, block_size, KVH, D] (K pages then V pages), same dtype
    as q (float32 or bfloat16); block_tables [B, max_blocks] int64; context_lens [B] int64
    (the query is the last of a sequence's context_len tokens). ``sliding_window`` W > 0: the
    query at position p = context_len - 1 sees keys p-W+1 .. p; 0 means no window.
    Returns [B, H, D] in q's dtype. Requires ``is_available()``.
    """
    module = _load()
    assert module is not None, "paged_decode_attention called without is_available()"
    return module.paged_decode_attention(
        q, cache, block_tables, context_lens, float(scale), int(sliding_window)
    )


PREFILL_HEAD_DIMS = (64, 128, 256)


def _cpu_has_amx() -> bool:
    is_supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(is_supported and is_supported())


# On a CPU with AMX torch's flash kernel runs its bf16 products on the AMX tiles through oneDNN:
# 2,048 causal tokens of SmolLM2's heads took 11.4 ms a layer there (0.42 TFLOP/s), where this
# kernel, on AVX512-BF16 alone, took 16.5 on the AMD host (torch's took 42.7 on that host). So
# torch's kernel is kept on AMX CPUs (the two were not measured side by side on one).
_PREFILL_KERNEL_PREFERRED = not _cpu_has_amx()


@functools.cache
def _has_prefill_attention() -> bool:
    """The extension was built with the prefill kernel (a compile-time fact of the build, asked
    once rather than at every layer's call). Requires ``is_available()``."""
    module = _load()
    return module is not None and module.has_prefill_attention()


def can_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``prefill_attention`` can take these and is the faster kernel here: bfloat16 CPU
    tensors, unit last strides, a head size it has registers for, the extension built for a
    CPU with AVX512-BF16, and no AMX on the CPU (see ``_PREFILL_KERNEL_PREFERRED``)."""
    return (
        _PREFILL_KERNEL_PREFERRED
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and q.shape[-1] in PREFILL_HEAD_DIMS
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and is_available()
        and _has_prefill_attention()
    )


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float, sliding_window: int = 0
) -> torch.Tensor:
    """Causal attention of one sequence's query tokens: q [n, H, D] at positions start_pos..,
    k and v [start_pos + n, KVH, D] (any token and head strides). ``sliding_window`` W > 0: the
    row at position p sees keys p-W+1 .. p. Returns [n, H, D] bfloat16; rounds as torch's CPU
    flash attention does for bfloat16 (float32 scores and sums, bf16 probabilities in the value
    product). Requires ``can_prefill(q, k, v)``."""
    module = _load()
    assert module is not None, "prefill_attention called without is_available()"
    return module.prefill_attention(q, k, v, int(start_pos), float(scale), int(sliding_window))


def can_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel can normalise ``x`` with ``weight``: contiguous CPU tensors of one supported
    dtype, and it is available."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in SUPPORTED_DTYPES
            and x.is_contiguous() and is_available())


def can_run(x: torch.Tensor) -> bool:
    """An elementwise kernel can take ``x``: a CPU tensor of a supported dtype, and the
    extension is available (each kernel's own layout requirements are its caller's)."""
    return x.device.type == "cpu" and x.dtype in SUPPORTED_DTYPES and is_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = weight * dtype(x * rsqrt(mean(x^2) + eps)) over the last dimension (float32 sums).
    Requires ``can_rms_norm(x, weight)``."""
    module = _load()
    assert module is not None, "rms_norm called without is_available()"
    return module.rms_norm(x, weight, float(eps))


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual = dtype(x + residual)``, then ``x = rms_norm(residual)``. Contiguous
    tensors of one dtype, x and residual of one shape. Requires ``can_rms_norm(x, weight)``."""
    module = _load()
    assert module is not None, "add_rms_norm_ called without is_available()"
    module.add_rms_norm_(x, residual, weight, float(eps))


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[.., 2 I] contiguous -> [.., I]: dtype(dtype(silu(gate)) * up). Requires ``can_run``."""
    module = _load()
    assert module is not None, "silu_and_mul called without is_available()"
    return module.silu_and_mul(gate_up)


def rotary_(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] (last dim contiguous, any token and head strides) in place by
    cos_sin [T, D] (= [cos | sin], contiguous, x's dtype), rounding as ``rotary.apply_rotary``
    does. Requires ``can_run(x)``."""
    module = _load()
    assert module is not None, "rotary_ called without is_available()"
    module.rotary_(x, cos_sin)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] (rows contiguous, V > 0) -> [N] int64: each row's first maximum, a NaN counting
    as the maximum, as ``logits.max(-1).indices``. Requires ``can_run(logits)``."""
    module = _load()
    assert module is not None, "argmax_rows called without is_available()"
    return module.argmax_rows(logits)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] ([R, ceil(V / 32)] int32,
    bit b of word w is token 32 w + b) is 0. Rows of ``logits`` contiguous; requires
    ``can_run(logits)``. 0.14 ms for 64 x 49,152 bf16, where unpacking the bits with torch ops
    took 10.7 ms."""
    module = _load()
    assert module is not None, "apply_token_bitmask_ called without is_available()"
    module.apply_token_bitmask_(logits, bitmask, rows)


# Per layer, the tensors decode_layers takes (its C++ comment names them; an empty tensor: absent).
DECODE_LAYER_PARAMS = 11


def decode_layers(
    hidden: torch.Tensor, cos_sin: torch.Tensor, params: list[torch.Tensor], caches: list[torch.Tensor],
    slot_mappings: list[torch.Tensor], block_tables: list[torch.Tensor], layer_to_group: list[int],
    sliding_windows: list[int], context_lens: torch.Tensor, final_norm: torch.Tensor, num_heads: int,
    num_kv_heads: int, head_dim: int, scale: float, eps: float, packed: bool, linear_rows: int,
) -> torch.Tensor:
    """A Llama-family decoder over B single-token sequences: hidden [B, hidden] (the token
    embeddings, used as scratch) -> the final norm's output [B, hidden], writing each layer's K and
    V into its pages as ``Attention`` does. ``params``: DECODE_LAYER_PARAMS tensors per layer
    (input norm, qkv weight and bias, qk-norm weight, o weight and bias, post-attention norm,
    gate_up weight and bias, down weight and bias); weights oneDNN-packed where ``packed``; every
    matmul runs on ``linear_rows`` rows (``packed_linear.linear_rows``). Requires
    ``is_available()``."""
    module = _load()
    assert module is not None, "decode_layers called without is_available()"
    return module.decode_layers(
        hidden, cos_sin, params, caches, slot_mappings, block_tables, layer_to_group, sliding_windows,
        context_lens, final_norm, num_heads, num_kv_heads, head_dim, float(scale), float(eps), packed, linear_rows,
    )
