"""What an engine hands out: per-step outputs, whole completions and load figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.engine.sampler import TokenLogprobs
from epdserve.errors import InvalidRequestError
from epdserve.request import MMInput, TierLoad

ERROR_FINISH_REASON = "error"


@dataclass
class RequestOutput:
    """What one step produced for one sequence of a request (deltas).

    A failed request gets one output (index 0, no tokens) with ``finished``, finish reason
    "error" and ``error`` set: all of its sequences have ended.
    """

    request_id: str
    index: int  # which of the request's n sequences
    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prefill_start: float = 0.0  # seconds since the epoch; 0 when not (yet) known
    prefill_end: float = 0.0
    error: str | None = None  # why the request failed inside this engine
    tier_load: TierLoad | None = None  # what num_cached_tokens took from the tiers below the pool


@dataclass
class Completion:
    """A whole sequence, as ``LLMEngine.generate`` returns it."""

    request_id: str
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True)
class EngineLoad:
    """The engine's queues and KV block use at one moment (for load reports)."""

    num_running: int
    num_waiting: int
    num_reserved: int  # decode: requests holding blocks while their KV arrives
    num_transferring: int  # prefill: requests holding blocks while their KV leaves
    num_free_blocks: int
    num_used_blocks: int
    num_used_state_slots: int = 0  # a recurrent model's requests holding a state slot


def check_mm_inputs(mm_inputs: list[MMInput], num_prompt_tokens: int) -> None:
    """Image spans lie inside the prompt, in order, without overlapping."""
    end = 0
    for mm in mm_inputs:
        if mm.offset < end or mm.end > num_prompt_tokens or mm.num_embeds <= 0:
            raise InvalidRequestError(
                f"image span {mm.offset}..{mm.end} overlaps another or lies outside the prompt"
            )
        end = mm.end
