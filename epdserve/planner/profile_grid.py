"""What ``epdserve profile`` measures: the steps of each role's grid, within the role's limits.

A point is one engine step: prefill entries (context already in the cache, new tokens) and
decode entries of one context length. Prefill points cover single chunks at several contexts
and several prompts batched in one step (what a busy worker schedules); decode points cover
batch sizes x contexts; colocated points add mixed steps (decodes plus a prefill chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

from epdserve.errors import ConfigError


@dataclass(frozen=True)
class StepPoint:
    """One step to time: prefill entries (context already cached, new tokens) and decode entries."""

    prefills: tuple[tuple[int, int], ...] = ()  # (start_pos, num_new_tokens) per prompt
    num_decode_seqs: int = 0
    decode_context: int = 0  # tokens of every decode entry's context (start_pos + 1)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + self.num_decode_seqs

    @property
    def num_seqs(self) -> int:
        return len(self.prefills) + self.num_decode_seqs

    @property
    def max_len(self) -> int:
        return max([s + n for s, n in self.prefills] + [self.decode_context])

    @property
    def num_kv_tokens(self) -> int:
        return sum(s + n for s, n in self.prefills) + self.num_decode_seqs * self.decode_context


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure. Points that exceed a role's limits (batched tokens, sequences, model
    length, ``max_kv_tokens``) are skipped."""

    prefill_chunks: tuple[int, ...]  # one prompt's chunk at context 0
    context_chunks: tuple[int, ...]  # chunks measured again at each of prefill_contexts
    prefill_contexts: tuple[int, ...]
    batched_prefills: tuple[tuple[int, int], ...]  # (prompts, tokens each) in one step
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    mixed: tuple[tuple[int, int, int], ...]  # colocated: (decode seqs, their context, chunk at context 0)
    encoder_tiles: tuple[int, ...]
    max_kv_tokens: int  # KV tokens one step may hold (sizes the probe's cache)
    min_repeats: int
    max_repeats: int
    min_time_s: float  # keep repeating (up to max_repeats) until this much time is spent
    # A point whose runs took this long stops before min_repeats (after one run at least): a
    # step of seconds varies little against its length, and the longest steps (2048 prompt
    # tokens: 5-7 s on an AVX2 core in float32) would otherwise take most of the profile's time.
    max_point_s: float = float("inf")

    def __post_init__(self) -> None:
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise ConfigError("profile grid needs 1 <= min_repeats <= max_repeats")
        if not self.max_point_s > 0:
            raise ConfigError("profile grid needs max_point_s > 0")

    def prefill_points(self) -> list[StepPoint]:
        points = [StepPoint(((0, n),)) for n in self.prefill_chunks]
        points += [StepPoint(((c, n),)) for c in self.prefill_contexts for n in self.context_chunks]
        points += [StepPoint(((0, n),) * k) for k, n in self.batched_prefills]
        return points

    def decode_points(self) -> list[StepPoint]:
        return [StepPoint((), b, c) for b in self.decode_batches for c in self.decode_contexts]

    def mixed_points(self) -> list[StepPoint]:
        return [StepPoint(((0, n),), b, c) for b, c, n in self.mixed]

    def points(self, role: str, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[StepPoint]:
        """The steps to time for a step role, within its limits."""
        chosen = {
            "prefill": self.prefill_points(),
            "decode": self.decode_points(),
            "colocated": self.prefill_points() + self.decode_points() + self.mixed_points(),
        }[role]
        return [
            p for p in chosen
            if p.num_tokens <= max_num_batched_tokens and p.num_seqs <= max_num_seqs
            and p.max_len < max_model_len and p.num_kv_tokens <= self.max_kv_tokens
        ]


FULL_GRID = ProfileGrid(
    prefill_chunks=(16, 32, 64, 128, 192, 256, 384, 512, 1024, 2048),
    context_chunks=(32, 128, 512),
    prefill_contexts=(256, 1024, 2048),
    batched_prefills=((2, 64), (2, 128), (2, 256), (3, 256), (4, 128), (4, 256), (6, 256), (8, 256), (2, 512),
                      (3, 512)),
    decode_batches=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128),
    decode_contexts=(64, 256, 512, 1024, 2048),
    mixed=tuple((b, c, n) for b in (2, 8, 16, 32) for c in (256, 1024) for n in (32, 128, 256, 512)),
    encoder_tiles=(1, 2, 4, 8),
    max_kv_tokens=65536,
    min_repeats=3,
    max_repeats=7,
    min_time_s=0.3,
    max_point_s=3.0,
)
QUICK_GRID = ProfileGrid(
    prefill_chunks=(8, 32, 64),
    context_chunks=(16,),
    prefill_contexts=(64,),
    batched_prefills=((2, 16),),
    decode_batches=(1, 4),
    decode_contexts=(16, 64),
    mixed=((2, 64, 16),),
    encoder_tiles=(1, 2),
    max_kv_tokens=1024,
    min_repeats=1,
    max_repeats=2,
    min_time_s=0.0,
)
