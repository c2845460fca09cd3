"""Where a prefill step's time goes: the engine's default model prefilling ``--prompts`` fresh
prompts of ``--prompt-len`` tokens in one step, with the time of each kind of operation.

    python benchmarks/prefill_step_profile.py [--prompts 8] [--prompt-len 256] [--steps 3]

Each layer operation is timed around its call (the packed matmuls, prefill attention, the
extension's elementwise kernels); the step's rest (embedding, LM head rows, sampling, the
engine's Python) is what the step took beyond their sum. One warm-up step, then ``--steps``
steps of new prompts (none found in the prefix cache); prints the mean per step.
"""

from __future__ import annotations

import argparse
import collections
import random
import time
from collections.abc import Callable

from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.models.layers import attention, linear, paged_attention_cpu
from epdserve.sampling import SamplingParams

TIMED = {  # (module, attribute) -> label
    (linear, "linear"): "packed matmuls",
    (attention.Attention, "_attend"): "prefill attention (Attention._attend)",
    (paged_attention_cpu, "silu_and_mul"): "SwiGLU",
    (paged_attention_cpu, "add_rms_norm_"): "norms",
    (paged_attention_cpu, "rms_norm"): "norms",
    (paged_attention_cpu, "rotary_"): "rotary",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    ns = parser.parse_args()

    engine = LLMEngine(EngineArgs(dtype=ns.dtype, max_num_batched_tokens=max(2048, ns.prompts * ns.prompt_len)))
    totals: dict[str, float] = collections.defaultdict(float)

    def timed(fn: Callable, label: str) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start
        return wrapper

    for (owner, name), label in TIMED.items():
        setattr(owner, name, timed(getattr(owner, name), label))
    rng = random.Random(0)
    vocab = engine.loaded.spec.vocab_size
    step_s = 0.0
    for step in range(ns.steps + 1):
        for _ in range(ns.prompts):
            engine.add_request([rng.randrange(1000, vocab - 1000) for _ in range(ns.prompt_len)],
                               SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished():
            engine.step()
        if step == 0:
            totals.clear()  # the warm-up step
        else:
            step_s += elapsed
    tokens = ns.prompts * ns.prompt_len
    print(f"prefill step of {ns.prompts} x {ns.prompt_len} tokens: {step_s / ns.steps * 1e3:.1f} ms "
          f"({tokens * ns.steps / step_s:.0f} tok/s)")
    for label, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<58} {seconds / ns.steps * 1e3:8.1f} ms")
    print(f"  {'the rest':<58} {(step_s - sum(totals.values())) / ns.steps * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
