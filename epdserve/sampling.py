"""Per-request sampling parameters, validated on construction.

They travel between processes as they are: control messages carry a ``SamplingParams`` field
(msgspec encodes the dataclass, and decoding one runs the same checks as constructing it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from epdserve.errors import InvalidRequestError

# Temperatures below this are treated as greedy (argmax).
GREEDY_EPSILON = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filtering
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top alternatives to return with each token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Added to the logits of the named tokens before sampling (OpenAI's logit_bias): (id, bias)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The llguidance grammar the output must follow (``epdserve.structured``); None: free text
    grammar: str | None = None
    # The worker's queue order, lower first (``epdserve.service.schedule_key``: the service
    # class's rank, then vLLM's ``priority``); 0 is an interactive request of priority 0.
    priority: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}"),
            (
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= 20,
                f"logprobs must be between 0 and 20, got {self.logprobs}",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
             "logit_bias takes token ids and biases in [-100, 100]"),
            (self.grammar is None or not (self.ignore_eos or self.min_tokens),
             "a structured output ends where its grammar does: ignore_eos and min_tokens do not apply"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    def split(self, request_id: str) -> list[tuple[str, SamplingParams]]:
        """The request's ``n`` sequences as requests of their own, with their ids: ``n=1`` each,
        sequence i named ``request_id#i`` and seeded ``seed + i`` (when seeded), so each is
        reproducible on any worker. One sequence keeps the request's id."""
        if self.n == 1:
            return [(request_id, self)]
        return [(f"{request_id}#{i}", replace(self, n=1, seed=None if self.seed is None else self.seed + i))
                for i in range(self.n)]
