"""A step's shape in the cost model's terms (``sim/cost_model.py``), read off a scheduler plan.

Torch-free: the worker's step trace, the profiler, the simulator and the planner all use it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epdserve.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepShape:
    num_prefill_tokens: int
    prefill_attn_pairs: int  # query-key pairs of causal attention over the prefill tokens
    num_decode_seqs: int
    decode_context_tokens: int  # sum of the decode entries' context lengths (tokens)

    @classmethod
    def from_scheduler_output(cls, out: SchedulerOutput) -> StepShape:
        num_prefill = attn_pairs = num_decode = context = 0
        for entry in out.scheduled:
            n = entry.num_new_tokens
            start = entry.start_pos
            if n > 1 or start < entry.request.num_prompt_tokens:
                num_prefill += n
                # sum over positions p = start .. start+n-1 of (p + 1)
                attn_pairs += n * start + n * (n + 1) // 2
            else:
                num_decode += 1
                context += start + 1
        return cls(num_prefill, attn_pairs, num_decode, context)

    @classmethod
    def from_dict(cls, d: dict) -> StepShape:
        return cls(**{f.name: int(d.get(f.name, 0)) for f in fields(cls)})

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def features(self) -> tuple[float, float, float, float, float]:
        """The regressors of ``StepCost``, in coefficient order (1 for the base)."""
        return (1.0, self.num_prefill_tokens, self.prefill_attn_pairs, self.num_decode_seqs, self.decode_context_tokens)
