"""Incremental detokenization and stop strings for one request.

Text is emitted only once it is stable: a trailing incomplete UTF-8 sequence (decoded as
U+FFFD) waits for the next token, and the last ``max_stop_len - 1`` characters wait until
they cannot be the start of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from epdserve.faults import FaultKind, FaultPlan
from epdserve.sampling import SamplingParams


class Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class DetokenizeResult:
    new_text: str  # text that became final with this token
    stopped: bool  # a stop string matched; the text is cut there


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""  # all text decoded so far, cut at a stop string
        self.num_emitted = 0  # characters of self.text already returned
        # token_ids[prefix_offset:read_offset] were decoded last time; decoding them again
        # together with the new tokens gets merges at the boundary right.
        self._prefix_offset = 0
        self._read_offset = 0
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    def add_token(self, token_id: int, is_last: bool) -> DetokenizeResult:
        self.token_ids.append(token_id)
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset], skip)
        full = self.tokenizer.decode(self.token_ids[self._prefix_offset :], skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            self.text += delta
            stopped = self._cut_at_stop_string(len(delta))
        else:
            stopped = False
        return DetokenizeResult(self._take(is_last or stopped), stopped)

    def prime(self, token_ids: list[int]) -> None:
        """Start from tokens whose text was already delivered (e.g. by a prefill worker)."""
        for token_id in token_ids:
            self.add_token(token_id, is_last=False)
        self.num_emitted = len(self.text)

    def flush(self) -> str:
        return self._take(True)

    def _cut_at_stop_string(self, num_new_chars: int) -> bool:
        if not self.params.stop:
            return False
        search_from = max(0, len(self.text) - num_new_chars - self._max_stop_len + 1)
        best = None
        for stop in self.params.stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
        return True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self.num_emitted, len(self.text) - max(0, self._max_stop_len - 1))
        out = self.text[self.num_emitted : end]
        self.num_emitted = end
        return out


class FaultInjectingDetokenizer(IncrementalDetokenizer):
    """Raises, as a bug in detokenization would, at the token a ``detok-error`` fault names
    (tests only). Tokens given to ``prime`` were detokenized elsewhere and never raise."""

    def __init__(self, tokenizer: Decoder, params: SamplingParams, faults: FaultPlan) -> None:
        super().__init__(tokenizer, params)
        self.faults = faults
        self._is_priming = False

    def add_token(self, token_id: int, is_last: bool) -> DetokenizeResult:
        num_output = len(self.token_ids)  # output tokens before this one
        seed = self.params.seed
        if not self._is_priming and self.faults.find(FaultKind.DETOK_ERROR, seed, num_output) is not None:
            raise RuntimeError(f"injected detokenizer fault (seed {seed}) at output token {num_output}")
        return super().add_token(token_id, is_last)

    def prime(self, token_ids: list[int]) -> None:
        self._is_priming = True
        try:
            super().prime(token_ids)
        finally:
            self._is_priming = False
