"""Simulator workloads: request lengths, arrival times and prompt token ids, with no tokenizer.

- ``random``: lengths uniform in ``len * (1 +- range_ratio)`` as vLLM's random dataset draws
  them, Poisson or Gamma arrivals at ``rate`` (bench's ``arrival_offsets``).
- ``trace``: a Mooncake JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids``) or an Azure CSV trace (``arrived_at`` s, ``num_prefill_tokens``,
  ``num_decode_tokens``), read by bench's ``traces`` parser, with ``time_scale`` /
  ``length_scale`` as in bench.

Token ids are synthetic. A trace's hash id names a fixed run of ``block_tokens`` ids, so equal
hash ids give equal prompt blocks and the engine's prefix cache sees the trace's shared
prefixes; every other prompt position gets ids no other request uses::

    hash_ids [7, 9]    | ids of block 7 | ids of block 9 | unique tail |
    random prompt      | unique id | shared filler ...                |   (no prefix hits)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from epdserve.bench import BenchError
from epdserve.bench.traces import TRACE_BLOCK_TOKENS, read_any_trace
from epdserve.bench.workloads import arrival_offsets
from epdserve.errors import ConfigError, EpdserveError

_UNIQUE_BASE = 1 << 42  # request i's unique ids start at _UNIQUE_BASE + i * 2**21
_FILLER_BASE = 1 << 41
_MAX_PROMPT_TOKENS = 1 << 21


@dataclass(frozen=True)
class SimWorkload:
    name: str
    arrival_s: np.ndarray  # float64, ascending: seconds from the start
    input_lens: np.ndarray  # int64: text prompt tokens (image tokens come on top)
    output_lens: np.ndarray  # int64: output tokens (max_tokens, ignore_eos)
    hash_ids: tuple[tuple[int, ...], ...] | None = None  # per request; None: no shared prefixes
    block_tokens: int = TRACE_BLOCK_TOKENS  # tokens behind one hash id
    num_images: int = 0  # per request
    tiles_per_image: int = 0

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.input_lens) != n or len(self.output_lens) != n:
            raise ConfigError("workload arrays differ in length")
        if self.hash_ids is not None and len(self.hash_ids) != n:
            raise ConfigError("workload hash_ids differ in length from its requests")
        if n and (int(self.input_lens.min()) < 1 or int(self.output_lens.min()) < 1):
            raise ConfigError("workload lengths must be >= 1")
        if n and int(self.input_lens.max()) >= _MAX_PROMPT_TOKENS:
            raise ConfigError(f"workload prompts must be shorter than {_MAX_PROMPT_TOKENS} tokens")
        if self.num_images < 0 or self.tiles_per_image < 0 or (self.num_images and not self.tiles_per_image):
            raise ConfigError("images per request and tiles per image must be >= 0 (tiles >= 1 with images)")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def mean_input_len(self) -> float:
        return float(self.input_lens.mean()) if len(self) else 0.0

    @property
    def mean_output_len(self) -> float:
        return float(self.output_lens.mean()) if len(self) else 0.0

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over the arrival span (inf when all arrive at once)."""
        span = self.duration_s
        return len(self) / span if span > 0 else math.inf

    def prompt_token_ids(self, index: int, filler: list[int]) -> list[int]:
        """Text prompt ids of request ``index``; ``filler`` is a shared list of at least
        ``max(input_lens)`` ids (see ``make_filler``)."""
        num_tokens = int(self.input_lens[index])
        unique = _UNIQUE_BASE + index * _MAX_PROMPT_TOKENS
        if self.hash_ids is None or not self.hash_ids[index]:
            return [unique] + filler[: num_tokens - 1]
        ids: list[int] = []
        bt = self.block_tokens
        for h in self.hash_ids[index]:
            if len(ids) >= num_tokens:
                break
            ids += range(h * bt, h * bt + bt)
        del ids[num_tokens:]
        if len(ids) < num_tokens:
            ids.append(unique)
            ids += filler[: num_tokens - len(ids)]
        return ids

    def make_filler(self) -> list[int]:
        longest = int(self.input_lens.max()) if len(self) else 0
        return list(range(_FILLER_BASE, _FILLER_BASE + longest))

    def with_arrivals(self, arrival_s: np.ndarray) -> SimWorkload:
        return SimWorkload(self.name, np.asarray(arrival_s, dtype=np.float64), self.input_lens, self.output_lens,
                           self.hash_ids, self.block_tokens, self.num_images, self.tiles_per_image)

    def head(self, num_requests: int) -> SimWorkload:
        k = min(num_requests, len(self))
        hash_ids = None if self.hash_ids is None else self.hash_ids[:k]
        return SimWorkload(self.name, self.arrival_s[:k], self.input_lens[:k], self.output_lens[:k],
                           hash_ids, self.block_tokens, self.num_images, self.tiles_per_image)


def random_lengths(num_requests: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's random dataset lengths: uniform integers in [len*(1-r), len*(1+r)]."""
    if not 0.0 <= range_ratio < 1.0:
        raise ConfigError(f"random range ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ConfigError("random input and output lengths must be >= 1")
    rng = np.random.default_rng(seed)
    in_low = max(1, math.floor(input_len * (1 - range_ratio)))
    in_high = math.ceil(input_len * (1 + range_ratio))
    out_low = max(1, math.floor(output_len * (1 - range_ratio)))
    out_high = max(1, math.ceil(output_len * (1 + range_ratio)))
    return (rng.integers(in_low, in_high + 1, size=num_requests, dtype=np.int64),
            rng.integers(out_low, out_high + 1, size=num_requests, dtype=np.int64))


def poisson_arrivals(num_requests: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    try:
        return np.asarray(arrival_offsets(num_requests, rate, burstiness, seed), dtype=np.float64)
    except EpdserveError as e:
        raise ConfigError(str(e).replace("--request-rate", "rate").replace("--burstiness", "burstiness")) from None


def random_workload(num_requests: int, rate: float, input_len: int = 1024, output_len: int = 128,
                    range_ratio: float = 0.0, burstiness: float = 1.0, seed: int = 0,
                    num_images: int = 0, tiles_per_image: int = 0) -> SimWorkload:
    if num_requests < 1:
        raise ConfigError(f"the workload needs at least one request, got {num_requests}")
    input_lens, output_lens = random_lengths(num_requests, input_len, output_len, range_ratio, seed)
    arrivals = poisson_arrivals(num_requests, rate, burstiness, seed)
    return SimWorkload("random", arrivals, input_lens, output_lens, None, TRACE_BLOCK_TOKENS, num_images, tiles_per_image)


def trace_workload(path: str, time_scale: float = 1.0, length_scale: float = 1.0, rate: float | None = None,
                   duration_s: float | None = None, num_requests: int | None = None, is_looped: bool = False,
                   num_images: int = 0, tiles_per_image: int = 0) -> SimWorkload:
    """Replay a trace. ``rate`` (requests/s) rescales its timestamps to that mean rate after
    ``time_scale``; ``is_looped`` repeats it (hash ids shifted: repeats share no prefixes) until
    ``duration_s`` or ``num_requests`` is reached; either one also cuts the trace short."""
    if time_scale <= 0 or length_scale <= 0:
        raise ConfigError("time scale and length scale must be > 0")
    if not Path(path).is_file():
        raise ConfigError(f"cannot read trace {path}: no such file")
    try:
        records = read_any_trace(path)
    except BenchError as e:
        raise ConfigError(str(e)) from None
    t0 = records[0].arrival_s
    times = np.array([r.arrival_s - t0 for r in records]) * time_scale
    if rate is not None:
        if rate <= 0:
            raise ConfigError(f"rate must be > 0, got {rate}")
        span = times[-1]
        if span > 0:
            times = times * ((len(records) / span) / rate)
    input_lens = np.array([max(1, round(r.input_length * length_scale)) for r in records], dtype=np.int64)
    output_lens = np.array([max(1, round(r.output_length * length_scale)) for r in records], dtype=np.int64)
    hash_ids = tuple(r.hash_ids for r in records)
    if is_looped:
        if duration_s is None and num_requests is None:
            raise ConfigError("a looped trace needs a duration or a number of requests")
        period = float(times[-1]) + (float(times[-1]) / max(1, len(records) - 1) or 1.0)
        max_hash = max((max(h) for h in hash_ids if h), default=-1) + 1
        limit = num_requests if num_requests is not None else math.inf
        num_loops = 1
        while num_loops * len(records) < limit and (duration_s is None or num_loops * period <= duration_s):
            num_loops += 1
        times = np.concatenate([times + k * period for k in range(num_loops)])
        input_lens = np.tile(input_lens, num_loops)
        output_lens = np.tile(output_lens, num_loops)
        hash_ids = tuple(tuple(h + k * max_hash for h in ids) for k in range(num_loops) for ids in hash_ids)
    keep = len(times)
    if duration_s is not None:
        keep = int(np.searchsorted(times, duration_s, side="right"))
    if num_requests is not None:
        keep = min(keep, num_requests)
    if keep < 1:
        raise ConfigError(f"{path}: no request arrives within the duration")
    block_tokens = max(1, round(TRACE_BLOCK_TOKENS * length_scale))
    has_hashes = any(hash_ids[:keep])
    return SimWorkload(Path(path).name, times[:keep].astype(np.float64), input_lens[:keep], output_lens[:keep],
                       hash_ids[:keep] if has_hashes else None, block_tokens, num_images, tiles_per_image)
