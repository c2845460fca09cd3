"""Where a decode step's time goes: the engine's default model decoding one sequence (or a
batch), its steps timed bare and then under torch's profiler, with the operators' share.

    python benchmarks/decode_step_profile.py [--batch 1] [--steps 40] [--rounds 10] [--json OUT]

Prints the median step without the profiler, the median under it (the profiler's own cost
shows as the difference), and per operator its time per step; the extension's kernels are not
torch operators and fall into "outside the listed operators" with the Python of the layers.

Before that, side by side on the same engine and sequences: decode steps with the layers run
in one extension call (``LlamaModel.fuse_decode``, the default) and layer by layer in Python,
alternating in ``--rounds`` rounds of ``--steps`` steps each (the median of each round's
median, and their ratio).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.models.llama import LlamaModel
from epdserve.sampling import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding at once")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="profiled steps (as many timed bare)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds of fused and layer-by-layer steps")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()

    engine = LLMEngine(EngineArgs(dtype=ns.dtype))
    rng = random.Random(0)
    vocab = engine.loaded.spec.vocab_size
    params = SamplingParams(max_tokens=(2 * ns.rounds + 3) * ns.steps + 40, temperature=0.0, ignore_eos=True)
    for _ in range(ns.batch):
        engine.add_request([rng.randrange(1000, vocab - 1000) for _ in range(ns.prompt_len)], params)
    for _ in range(20):  # prefill and warm-up
        engine.step()

    def timed(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - t)
        return out

    rounds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(ns.rounds):
        for fused in (False, True):
            LlamaModel.fuse_decode = fused
            rounds[fused].append(statistics.median(timed(ns.steps)))
    LlamaModel.fuse_decode = True
    fused_ms, python_ms = (statistics.median(rounds[f]) * 1e3 for f in (True, False))
    print(f"batch {ns.batch}: decode step {fused_ms:.2f} ms with the layers in one call, {python_ms:.2f} ms "
          f"layer by layer ({python_ms / fused_ms:.2f}x; medians of {ns.rounds} alternating rounds)")

    bare = timed(ns.steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = timed(ns.steps)
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    step_ms = statistics.median(bare) * 1e3
    profiled_ms = statistics.median(profiled) * 1e3
    rows = [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / ns.steps, "calls_per_step": e.count / ns.steps}
            for e in ops if e.self_cpu_time_total > 0]
    listed = sum(r["ms_per_step"] for r in rows)
    print(f"batch {ns.batch}: step {step_ms:.2f} ms bare, {profiled_ms:.2f} ms under the profiler")
    for r in rows[:15]:
        print(f"  {r['op']:<32} {r['ms_per_step']:7.2f} ms/step  {r['calls_per_step']:6.0f} calls/step")
    print(f"  {'outside the listed operators':<32} {profiled_ms - listed:7.2f} ms/step (extension kernels, Python)")
    if ns.json:
        ns.json.write_text(json.dumps({"batch": ns.batch, "step_ms": step_ms, "profiled_step_ms": profiled_ms,
                                       "fused_step_ms": fused_ms, "layer_by_layer_step_ms": python_ms,
                                       "rounds_ms": {"fused": [t * 1e3 for t in rounds[True]],
                                                     "layer_by_layer": [t * 1e3 for t in rounds[False]]},
                                       "ops": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
