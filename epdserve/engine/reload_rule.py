"""Reload or recompute: THE rule for a prefix found in a tier below a worker's pool.

Load the blocks when reading them (bytes / measured tier bandwidth, plus the tier's latency per
load) takes less time than the profiled prefill of their tokens; otherwise compute them. The
engine, the router's ``prefix-aware`` policy (``router/prefix_index.py``) and the simulator all
import ``PrefixCost.should_load`` from here; no other copy exists.

Plain Python (no torch, no numpy, no router imports): the engine's scheduler calls it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from epdserve.errors import ConfigError


class PrefillTerms(Protocol):
    """The prefill terms of a step-cost model (``sim/cost_model.py`` ``StepCost`` has them)."""

    per_prefill_token_s: float
    per_prefill_attn_pair_s: float

# Prefill seconds per prompt token assumed until a worker measured its own (``PrefillRate``):
# about a 135M-parameter model on two CPU cores.
PRIOR_PREFILL_S_PER_TOKEN = 5e-4


class PrefillRate:
    """Prefill compute per prompt token on this worker, measured over the last ``window`` steps
    that ran only prompt tokens (at least ``min_tokens`` of them), the first such step left out
    (it pays the process's warm-up). The engine's reload rule and the router's ``prefix-aware``
    policy read it when no profile gives the cost.

    A step costs a part that does not depend on its tokens (reading the weights once, each
    layer's fixed overhead) plus a part per token. The rule weighs the tokens a load would spare
    the step, so the rate is the per-token part: the least-squares slope of seconds over tokens
    when the window's steps differ enough in size (the largest at least ``SPREAD`` times the
    smallest). Otherwise (steps all about one size, or a slope the noise made non-positive) it is
    the median seconds per token, which counts the fixed part too: high for small steps, so it
    errs toward loading. Never above that median (a negative intercept is noise)."""

    SPREAD = 2.0

    def __init__(self, window: int = 16, min_tokens: int = 16) -> None:
        self.min_tokens = min_tokens
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._is_warm = False
        self.per_token_s = 0.0  # 0.0 until a step was measured

    def observe(self, num_prompt_tokens: int, seconds: float) -> None:
        if num_prompt_tokens < self.min_tokens or not (seconds > 0 and math.isfinite(seconds)):
            return
        if not self._is_warm:
            self._is_warm = True
            return
        self._samples.append((num_prompt_tokens, seconds))
        self.per_token_s = self._rate()

    def _rate(self) -> float:
        samples = self._samples
        median = statistics.median(s / n for n, s in samples)
        sizes = [n for n, _ in samples]
        if max(sizes) < self.SPREAD * min(sizes):
            return median
        mean_n = statistics.fmean(sizes)
        mean_s = statistics.fmean(s for _, s in samples)
        slope = (sum((n - mean_n) * (s - mean_s) for n, s in samples)
                 / sum((n - mean_n) ** 2 for n in sizes))
        return min(slope, median) if slope > 0 else median


# Bytes per second of a copy between two workers' pages in one node's shared memory, assumed
# until a link measured its own: memcpy from one thread, 17.1 GB/s measured on the development
# host (docs/experiments.md, "kv-exposure").
PRIOR_SHM_BYTES_PER_S = 17.1e9

# Where a worker can find a KV block, fastest first: its own page pool (only that worker uses
# it), the host-memory tier shared by the workers of a node, the node's local-disk tier.
TIERS = ("pool", "host", "disk")
LOAD_TIERS = TIERS[1:]  # the tiers a block is loaded from (a pool block is at hand)


def causal_attn_pairs(num_new_tokens: int, num_cached_tokens: int) -> int:
    """Query-key pairs of causal attention over positions ``num_cached_tokens`` ..
    ``num_cached_tokens + num_new_tokens - 1``: sum of (p + 1), as ``StepShape.prefill_attn_pairs``
    counts them."""
    n = num_new_tokens
    return n * num_cached_tokens + n * (n + 1) // 2


def max_cached_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Most whole blocks of a prompt the engine takes from cache: it always computes the last
    token (``KVCacheManager.find_cached_prefix``)."""
    return (num_prompt_tokens - 1) // block_size if num_prompt_tokens > 0 else 0


class PullTarget(Protocol):
    """What a prefill request knows of its decode worker's reservation (``request.Request``)."""

    kv_target: str | None
    kv_target_block_ids: list[list[int]] | None
    kv_target_num_cached: int


def pull_span(request: PullTarget, num_cached_tokens: int, block_size: int) -> tuple[int, int] | None:
    """The blocks a prefill worker may copy from its decode worker's pages instead of computing
    them (``engine/kv_pull.py``; the simulator's prefill instances take the same span): (first,
    last) block indices, from the end of its own pool hit of ``num_cached_tokens`` to the end of
    the prefix the reservation found cached on decode; None without a reservation or when decode
    holds no more whole blocks."""
    if request.kv_target is None or not request.kv_target_block_ids:
        return None
    first = num_cached_tokens // block_size
    last = request.kv_target_num_cached // block_size
    if last <= first or last >= len(request.kv_target_block_ids[0]):
        return None
    return first, last


def _check_seconds(name: str, value: Any) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (is_number and math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _frozen_tier_map(name: str, values: Any, is_rate: bool) -> Mapping[str, float]:
    if not isinstance(values, Mapping):
        raise ConfigError(f"{name} must be a mapping of tier to number, got {type(values).__name__}")
    for tier, value in values.items():
        if tier not in LOAD_TIERS:
            raise ConfigError(f"{name}: unknown tier {tier!r} (tiers loaded from: {', '.join(LOAD_TIERS)})")
        _check_seconds(f"{name}[{tier!r}]", value)
        if is_rate and value <= 0:
            raise ConfigError(f"{name}[{tier!r}] must be > 0 (leave a tier out when it has no bandwidth)")
    return MappingProxyType({tier: float(value) for tier, value in values.items()})


@dataclass(frozen=True)
class PrefixCost:
    """Seconds to get a prompt's first token computed on one worker: prefill compute of the
    tokens not in cache, and loads from the tiers below the pool. Coefficients as
    ``StepCost``'s prefill terms (``sim/cost_model.py``); all >= 0."""

    per_prefill_token_s: float  # prefill compute per uncached token
    per_prefill_attn_pair_s: float = 0.0  # per (query, key) pair of causal attention
    # Measured read bandwidth (bytes per second, > 0) per tier in LOAD_TIERS; a tier left out
    # cannot be loaded from.
    tier_bytes_per_s: Mapping[str, float] = field(default_factory=dict, hash=False)
    tier_latency_s: Mapping[str, float] = field(default_factory=dict, hash=False)  # seconds per load
    bytes_per_block: int = 0  # KV bytes of one block, every layer and group
    block_size: int = 16  # tokens per block

    def __post_init__(self) -> None:
        _check_seconds("per_prefill_token_s", self.per_prefill_token_s)
        _check_seconds("per_prefill_attn_pair_s", self.per_prefill_attn_pair_s)
        _check_int("bytes_per_block", self.bytes_per_block, 0)
        _check_int("block_size", self.block_size, 1)
        # Read-only copies: the dataclass is frozen, its maps are too.
        bytes_per_s = _frozen_tier_map("tier_bytes_per_s", self.tier_bytes_per_s, True)
        object.__setattr__(self, "tier_bytes_per_s", bytes_per_s)
        latency_s = _frozen_tier_map("tier_latency_s", self.tier_latency_s, False)
        object.__setattr__(self, "tier_latency_s", latency_s)

    @classmethod
    def from_step_cost(
        cls,
        step: PrefillTerms,
        block_size: int,
        bytes_per_block: int,
        tier_bytes_per_s: Mapping[str, float] | None = None,
        tier_latency_s: Mapping[str, float] | None = None,
    ) -> PrefixCost:
        """The prefill terms of a profiled role's ``StepCost`` and the measured tiers."""
        return cls(step.per_prefill_token_s, step.per_prefill_attn_pair_s,
                   dict(tier_bytes_per_s or {}), dict(tier_latency_s or {}), bytes_per_block, block_size)

    def prefill_s(self, num_new_tokens: int, num_cached_tokens: int) -> float:
        """Compute of ``num_new_tokens`` prompt tokens after ``num_cached_tokens`` already in
        the cache (later tokens attend to more keys, so cost more)."""
        if num_new_tokens < 0 or num_cached_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {num_new_tokens} new after "
                             f"{num_cached_tokens} cached")
        return (self.per_prefill_token_s * num_new_tokens
                + self.per_prefill_attn_pair_s * causal_attn_pairs(num_new_tokens, num_cached_tokens))

    def load_s(self, tier: str, num_blocks: int) -> float:
        """Seconds to read ``num_blocks`` blocks from ``tier`` in one load: bytes / bandwidth +
        latency; 0.0 for no blocks, else ``math.inf`` for a tier without a bandwidth."""
        bytes_per_s = self.tier_bytes_per_s.get(tier)
        if bytes_per_s is not None and num_blocks > 0:
            return num_blocks * self.bytes_per_block / bytes_per_s + self.tier_latency_s.get(tier, 0.0)
        if tier not in LOAD_TIERS:
            raise ValueError(f"unknown tier {tier!r} (tiers loaded from: {', '.join(LOAD_TIERS)})")
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        return 0.0 if num_blocks == 0 else math.inf

    def should_load(self, tier: str, num_blocks: int, num_cached_tokens: int) -> bool:
        """THE reload-or-recompute rule: load ``num_blocks`` blocks from ``tier`` (the blocks
        right after ``num_cached_tokens`` tokens already in cache) when that takes less time
        than computing their tokens there; on a tie, compute. No blocks: nothing to load."""
        if num_blocks <= 0:
            return False
        return self._beats_compute(self.load_s(tier, num_blocks), num_blocks, num_cached_tokens)

    def copy_s(self, num_blocks: int, bytes_per_s: float, latency_s: float = 0.0) -> float:
        """Seconds to copy ``num_blocks`` blocks over a medium of ``bytes_per_s`` (> 0) that
        is no tier of this cost (another worker's pages, say), plus ``latency_s``."""
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s!r}")
        return num_blocks * self.bytes_per_block / bytes_per_s + latency_s if num_blocks > 0 else 0.0

    def should_copy(self, num_blocks: int, bytes_per_s: float, latency_s: float, num_cached_tokens: int) -> bool:
        """The same rule for blocks copied from another worker's pages (``copy_s``)."""
        if num_blocks <= 0:
            return False
        return self._beats_compute(self.copy_s(num_blocks, bytes_per_s, latency_s), num_blocks, num_cached_tokens)

    def _beats_compute(self, seconds: float, num_blocks: int, num_cached_tokens: int) -> bool:
        return seconds < self.prefill_s(num_blocks * self.block_size, num_cached_tokens)

    def plan_loads(self, num_cached_tokens: int, num_host_blocks: int, num_disk_blocks: int) -> tuple[int, int, float]:
        """What to load of a prefix found below the pool: after ``num_cached_tokens`` tokens in
        the pool, a run of ``num_host_blocks`` blocks in the host tier, then a run of
        ``num_disk_blocks`` on disk. The host run is loaded when ``should_load`` says so; the
        disk run only after the whole host run (the engine computes one range, from its first
        missing token to the end), and when ``should_load`` says so at its position. Returns
        (host blocks loaded, disk blocks loaded, seconds the loads take)."""
        seconds = 0.0
        num_host = num_disk = 0
        if num_host_blocks and self.should_load("host", num_host_blocks, num_cached_tokens):
            num_host = num_host_blocks
            seconds += self.load_s("host", num_host)
            num_cached_tokens += num_host * self.block_size
        if (num_disk_blocks and num_host == num_host_blocks
                and self.should_load("disk", num_disk_blocks, num_cached_tokens)):
            num_disk = num_disk_blocks
            seconds += self.load_s("disk", num_disk)
        return num_host, num_disk, seconds
