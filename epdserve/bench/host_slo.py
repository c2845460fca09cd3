"""An SLO sized to the host from its profile: what one request costs there alone, times a margin.

A fixed SLO set on one host means something else on another: a CPU without a fast bf16 matmul
prefills about five times slower, and a TTFT bound that leaves room for queueing on one host is
missed there by the prompts' own prefill at any load. The benchmarks that derive their SLO from
the profile (``benchmarks/sim_fidelity.py``, ``bench experiment prefix-cache``) use these two
rules, so the same margin means the same on every host.
"""

from __future__ import annotations

from epdserve.engine.step_shape import StepShape
from epdserve.sim.cost_model import StepCost

TTFT_PREFILLS = 4.0  # TTFT within this many times the request's prefill alone
TPOT_STEPS = 5.0  # TPOT within this many times a decode step of one sequence alone


def _ms(seconds: float) -> float:
    """Milliseconds rounded to 10 ms."""
    return round(seconds * 100) * 10.0


def ttft_slo_ms(step: StepCost, prompt_tokens: int, extra_s: float = 0.0) -> float:
    """``TTFT_PREFILLS`` times one prompt of ``prompt_tokens`` prefilled alone in one step on
    ``step`` (no cached prefix, nothing batched with it), plus ``extra_s`` per request before
    its prefill (an image's encode), in ms rounded to 10 ms."""
    n = prompt_tokens
    return _ms(TTFT_PREFILLS * (step.time_s(StepShape(n, n * (n + 1) // 2, 0, 0)) + extra_s))


def tpot_slo_ms(step: StepCost, context_tokens: int) -> float:
    """``TPOT_STEPS`` times a decode step of one sequence of ``context_tokens`` on ``step``, in
    ms rounded to 10 ms."""
    return _ms(TPOT_STEPS * step.time_s(StepShape(0, 0, 1, context_tokens)))
