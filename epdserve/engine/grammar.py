"""Structured outputs on a worker: one llguidance matcher per constrained request, a token
bitmask per step for the batch's constrained rows, applied to the logits before sampling.

A matcher is built the first time its request samples, from ``SamplingParams.grammar``, and
consumes the request's output tokens so far: on a decode worker that is the first token,
sampled (under the same grammar) by the prefill worker, so the constraint resumes exactly where
prefill left it; after a preemption it is nothing new (the matcher lives as long as the
request). Replaying costs one ``consume_token`` per token already produced.
"""

from __future__ import annotations

import logging

import llguidance
import torch

from epdserve.models.layers import paged_attention_cpu
from epdserve.models.tokenizer import Tokenizer
from epdserve.request import Request
from epdserve.structured import grammar_tokenizer

log = logging.getLogger(__name__)


class GrammarMasks:
    """The matchers of one engine's constrained requests."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width
        self._words = (vocab_size + 31) // 32
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._shifts: torch.Tensor | None = None

    @staticmethod
    def constrained(requests: list[Request]) -> bool:
        return any(r.sampling.grammar is not None for r in requests)

    def _llt(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            t = self._tokenizer
            self._lltokenizer = grammar_tokenizer(t.backend.to_str(), self.vocab_size, t.eos_token_ids)
        return self._lltokenizer

    def _matcher(self, request: Request) -> llguidance.LLMatcher:
        matcher = self._matchers.get(request.request_id)
        if matcher is None:
            matcher = llguidance.LLMatcher(self._llt(), request.sampling.grammar, log_level=0)
            if request.output_token_ids and not matcher.is_error():
                matcher.consume_tokens(request.output_token_ids)
            self._matchers[request.request_id] = matcher
        return matcher

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> dict[int, str]:
        """Mask, in place, every token the grammar of row i's request does not allow next;
        returns {row: error} for rows whose matcher is in an error state (left unmasked)."""
        rows, matchers, failed = [], [], {}
        for i, request in enumerate(requests):
            if request.sampling.grammar is None:
                continue
            matcher = self._matcher(request)
            if matcher.is_error():
                failed[i] = f"structured output: {matcher.get_error()[:300]}"
                continue
            rows.append(i)
            matchers.append(matcher)
        if not rows:
            return failed
        bitmask = torch.empty((len(rows), self._words), dtype=torch.int32)
        row_bytes = self._words * 4
        # One row after another: llguidance's parallel executor took 5-8 ms a step for 16 rows
        # here (its threads contend with the model's), this loop 0.8 ms.
        for j, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + j * row_bytes, row_bytes)
        if logits.stride(1) == 1 and paged_attention_cpu.can_run(logits):
            paged_attention_cpu.apply_token_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.long))
            return failed
        allowed = self._unpack(bitmask.to(logits.device))
        index = torch.tensor(rows, device=logits.device)
        masked = logits.index_select(0, index).masked_fill_(~allowed[:, :logits.shape[1]], float("-inf"))
        logits.index_copy_(0, index, masked)
        return failed

    def _unpack(self, bitmask: torch.Tensor) -> torch.Tensor:
        """[R, words] int32 bit words -> [R, words * 32] bool, bit b of word w = token 32 w + b."""
        if self._shifts is None or self._shifts.device != bitmask.device:
            self._shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = (bitmask.unsqueeze(-1) >> self._shifts) & 1
        return bits.view(bitmask.shape[0], -1).bool()

    def accept(self, request: Request, token_id: int) -> str | None:
        """Advance the request's matcher by its sampled token; an error message when the
        grammar refuses it (never for a token its mask allowed)."""
        if request.sampling.grammar is None:
            return None
        matcher = self._matcher(request)
        if not matcher.consume_token(token_id):
            return f"structured output: token {token_id} refused ({matcher.get_error()[:300]})"
        return None

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._matchers)
