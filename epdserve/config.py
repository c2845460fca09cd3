"""Engine configuration: frozen dataclasses, validated on construction.

``EngineArgs`` holds what a user asked for (with "auto" values); ``EngineArgs.resolve`` turns
it into a frozen ``EngineConfig`` once the model's spec is known.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

from epdserve.errors import ConfigError
from epdserve.faults import FaultSpec

DTYPES = ("bfloat16", "float32", "float16")
# Images per encoder forward pass: the default of serve, its encode workers, simulate and plan.
ENCODE_BATCH_IMAGES = 1


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # tokens computed in one step, all requests together
    max_model_len: int = 4096  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        _require(
            self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
            "without chunked prefill, max_num_batched_tokens must be >= max_model_len",
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 1024  # per KV cache group, including the reserved null block
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(self.num_blocks >= 2, f"num_blocks must be >= 2, got {self.num_blocks}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None
    dtype: str
    device: str
    seed: int
    scheduler: SchedulerConfig
    cache: CacheConfig

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


@dataclass(frozen=True)
class TierOptions:
    """The tiers below an engine's pool: capacities in GiB (0 = no such tier) and roots."""

    host_gib: float = 0.0
    disk_gib: float = 0.0
    host_dir: str | None = None  # default: default_host_dir()
    disk_dir: str | None = None  # default: default_disk_dir()
    # The reload rule's read bandwidth per tier in GB/s, in place of the one measured at start
    # (latency then 0): to reproduce a decision for other hardware. None: measure.
    host_read_gbps: float | None = None
    disk_read_gbps: float | None = None

    def __post_init__(self) -> None:
        for name in ("host_gib", "disk_gib"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
                raise ConfigError(f"kv {name.replace('_gib', '')} tier size must be >= 0 GiB, got {value!r}")
        for name in ("host_read_gbps", "disk_read_gbps"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and 0 < value < float("inf")):
                raise ConfigError(f"kv {name.split('_')[0]} tier read bandwidth must be > 0 GB/s, got {value!r}")

    def read_gbps(self, tier: str) -> float | None:
        return self.host_read_gbps if tier == "host" else self.disk_read_gbps

    @property
    def enabled(self) -> bool:
        return self.host_gib > 0 or self.disk_gib > 0


def default_host_dir() -> str:
    """Where the host tier lives unless told: tmpfs, one directory per user."""
    return f"/dev/shm/epdserve-kv-{os.getuid()}"


def default_disk_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "epdserve", "kv")


@dataclass
class EngineArgs:
    """User-facing options; "auto" and None are resolved against the model in ``resolve``."""

    model: str | None = None
    dtype: str = "auto"  # bfloat16 on CUDA and on CPUs with bf16 dot products in hardware, else float32
    device: str = "auto"  # cuda when available, else cpu
    seed: int = 0
    max_model_len: int | None = None  # None: min(model's context length, 4096)
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: max(2048, max_model_len) w/o chunking
    enable_chunked_prefill: bool = True
    block_size: int = 16
    kv_cache_memory_gib: float = 2.0  # KV pool size across all layers and groups
    num_kv_blocks: int | None = None  # overrides kv_cache_memory_gib
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1  # rank processes of this engine (engine/tp.py)
    kv_tiers: TierOptions = field(default_factory=TierOptions)  # the KV store below the pool
    faults: tuple[FaultSpec, ...] = ()  # injected faults (tests; epdserve/faults.py)
    extra: dict = field(default_factory=dict)

    def resolve(self, model_max_len: int, bytes_per_block: int) -> EngineConfig:
        """``bytes_per_block``: K and V of one block in every layer of every group."""
        max_model_len = self.max_model_len or min(model_max_len, 4096)
        _require(
            2 <= max_model_len <= model_max_len,
            f"max_model_len must be between 2 and the model's {model_max_len}, got {max_model_len}",
        )
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        num_blocks = self.num_kv_blocks
        if num_blocks is None:
            _require(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib must be positive")
            num_blocks = int(self.kv_cache_memory_gib * 2**30) // bytes_per_block
        return EngineConfig(
            model=self.model,
            dtype=resolve_dtype_name(self.dtype, resolve_device_name(self.device)),
            device=resolve_device_name(self.device),
            seed=self.seed,
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
        )


def resolve_dtype_name(dtype: str, device: str = "cpu") -> str:
    """``auto`` -> bfloat16 on CUDA and on CPUs with bf16 dot products in hardware
    (AVX512-BF16 or AMX, ``cpu_has_fast_bf16``); float32 on other CPUs (AVX2 only, or AVX-512
    without BF16), where bf16 matmuls are emulated and several times slower than float32.
    ``device``: a resolved device name."""
    if dtype == "auto":
        return "bfloat16" if not device.startswith("cpu") or cpu_has_fast_bf16() else "float32"
    aliases = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16"}
    name = aliases.get(dtype, dtype)
    _require(name in DTYPES, f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    return name


@functools.cache
def cpu_has_onednn_bf16() -> bool:
    """oneDNN has a bf16 matmul path here (its own check) and packs bf16 weights: in hardware on
    AVX512-BF16 and AMX, emulated on other AVX-512 CPUs."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """This CPU runs bf16 matmuls in hardware: oneDNN's bf16 path on AVX512-BF16 or AMX tiles.
    On AVX-512 without them oneDNN emulates bf16 (an Intel Xeon of that kind: a 256 x 576 x
    1,536 matmul 4.3x slower in bf16 than in float32, prefill 2.8x slower, see
    docs/benchmarks.md), so it does not count."""
    import torch

    if not cpu_has_onednn_bf16():
        return False
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if not any(checks):  # a torch without these checks: oneDNN's word
        return True
    return any(bool(check()) for check in checks if check is not None)


def resolve_device_name(device: str) -> str:
    """``auto`` -> cuda where torch sees a GPU, else cpu; other names are checked here so a
    bad ``--device`` is a one-line error, not a worker's traceback."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from None
    if parsed.type == "cuda":
        _require(torch.cuda.is_available(), f"device {device!r}: this torch build sees no CUDA device")
        _require(parsed.index is None or parsed.index < torch.cuda.device_count(),
                 f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    else:
        _require(parsed.type == "cpu", f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return device
