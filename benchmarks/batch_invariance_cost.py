"""What the batch-invariant row rule costs a decode step: steps with every matmul on the rows
``packed_linear.linear_rows`` gives against steps with the rule off (``MIN_ROWS`` and
``FLOAT32_ROW_MULTIPLE`` 1: a row alone runs the libraries' one-row paths), alternating in one
process on one engine.

    python benchmarks/batch_invariance_cost.py [--model smollm2|gemma3] [--batch 1]
        [--rounds 20] [--steps 20]

The rule only changes steps with a single row per matmul (a sequence decoding alone), so the
default is batch 1. The default dtype (bf16 where the CPU has a bf16 matmul path).
"""

from __future__ import annotations

import argparse
import statistics
import time

from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.models.layers import packed_linear
from epdserve.models.loader import resolve_model_path
from epdserve.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model name or path (default: the embedded SmolLM2)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding at once")
    parser.add_argument("--rounds", type=int, default=20, help="alternating rounds, each arm once per round")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per arm per round")
    args = parser.parse_args()

    model = resolve_model_path(args.model) if args.model else None
    engine = LLMEngine(EngineArgs(model=model, dtype="auto", kv_cache_memory_gib=0.5))
    budget = 2 * args.rounds * args.steps + 8
    for i in range(args.batch):
        prompt = [100 + (7 * i + j) % 500 for j in range(64)]
        engine.add_request(prompt, SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True))
    for _ in range(-(-64 * args.batch // 2048) + 2):  # the prompts' prefill and a first decode step
        engine.step()

    rule = (packed_linear.MIN_ROWS, packed_linear.FLOAT32_ROW_MULTIPLE)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for arm in ("on", "off") if r % 2 == 0 else ("off", "on"):
            packed_linear.MIN_ROWS, packed_linear.FLOAT32_ROW_MULTIPLE = rule if arm == "on" else (1, 1)
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            times[arm].append((time.perf_counter() - start) / args.steps * 1e3)
    packed_linear.MIN_ROWS, packed_linear.FLOAT32_ROW_MULTIPLE = rule
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"model {args.model or 'default'}, dtype {engine.config.dtype}, batch {args.batch}")
    print(f"rule on (MIN_ROWS {rule[0]}, float32 rows by {rule[1]}): {on:.2f} ms per decode step "
          f"(median of {args.rounds} rounds)")
    print(f"rule off (1, 1):  {off:.2f} ms")
    ratios = [a / b for a, b in zip(times["on"], times["off"])]
    print(f"on / off, median of the rounds' ratios: {statistics.median(ratios):.3f}x step time "
          f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
