"""Tensor parallelism on this machine's cores: TP 1 (one process, every core) beside TP 2 (two
rank processes, half the cores each, gloo all-reduces), in alternating rounds.

    .venv/bin/python benchmarks/tp.py [--model gemma3] [--rounds 3] [--num-prompts 16]
        [--input-len 256] [--output-len 64] [--decode-batch 1,8] [--dtype auto] [--json out.json]

Each round runs every TP size in a fresh process (a TP engine pins its ranks, which would
change the affinity of anything else in the process): offline throughput (N prompts of random
token ids, fixed output length, EOS ignored; total tokens/s) and the median decode step time
at each ``--decode-batch`` (sequences of ``--input-len`` tokens, 32 steps after 4 warm-up
steps). The ratio TP 2 / TP 1 is reported per round and as the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(ns: argparse.Namespace, tp: int) -> dict:
    """One TP size in this process (run as a child of ``main``)."""
    from epdserve.config import EngineArgs
    from epdserve.engine.engine import LLMEngine
    from epdserve.sampling import SamplingParams

    engine = LLMEngine(EngineArgs(model=ns.model, dtype=ns.dtype, tensor_parallel_size=tp, kv_cache_memory_gib=1.0,
                                  max_model_len=ns.input_len + ns.output_len + 64))
    rng = random.Random(0)
    vocab = engine.loaded.spec.vocab_size

    def prompts(num: int) -> list[list[int]]:
        return [[rng.randrange(1000, vocab - 1000) for _ in range(ns.input_len)] for _ in range(num)]

    params = SamplingParams(max_tokens=ns.output_len, temperature=0, ignore_eos=True)
    engine.generate(prompts(2), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    batch = prompts(ns.num_prompts)
    start = time.perf_counter()
    engine.generate(batch, params)
    elapsed = time.perf_counter() - start
    result = {"tp": tp, "offline_tok_s": ns.num_prompts * (ns.input_len + ns.output_len) / elapsed,
              "offline_output_tok_s": ns.num_prompts * ns.output_len / elapsed, "decode_step_ms": {}}
    for size in ns.decode_batch:
        ids = [engine.add_request(p, SamplingParams(max_tokens=1 << 16, temperature=0, ignore_eos=True))
               for p in prompts(size)]
        def decoding_all() -> bool:
            plan = engine.last_plan
            return plan is not None and len(plan.scheduled) == size and all(
                e.num_new_tokens == 1 for e in plan.scheduled)

        while not decoding_all():
            engine.step()
        for _ in range(4):
            engine.step()
        times = []
        for _ in range(32):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        for i in ids:
            engine.abort(i)
        while engine.has_unfinished():
            engine.step()
        result["decode_step_ms"][str(size)] = 1000 * statistics.median(times)
    if engine.loaded.tp is not None:
        engine.loaded.tp.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--decode-batch", default="1,8")
    parser.add_argument("--tp-sizes", default="1,2")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    ns.decode_batch = [int(b) for b in ns.decode_batch.split(",")]
    if ns.child is not None:
        print(json.dumps(measure(ns, ns.child)), flush=True)
        return
    sizes = [int(t) for t in ns.tp_sizes.split(",")]
    rounds = []
    for r in range(ns.rounds):
        row = {}
        for tp in sizes if r % 2 == 0 else reversed(sizes):  # alternate the order
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", str(tp)], capture_output=True,
                                 text=True, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
            row[tp] = json.loads(out.stdout.strip().splitlines()[-1])
        rounds.append(row)
        cells = [f"TP {tp}: {row[tp]['offline_tok_s']:.0f} tok/s, decode step " +
                 ", ".join(f"b{b} {row[tp]['decode_step_ms'][str(b)]:.1f} ms" for b in ns.decode_batch)
                 for tp in sizes]
        print(f"round {r + 1}: " + " | ".join(cells), flush=True)
    base = sizes[0]
    summary = {}
    for tp in sizes[1:]:
        summary[f"tp{tp}_over_tp{base}_offline"] = statistics.median(
            row[tp]["offline_tok_s"] / row[base]["offline_tok_s"] for row in rounds)
        for b in ns.decode_batch:
            summary[f"tp{tp}_over_tp{base}_decode_step_b{b}"] = statistics.median(
                row[tp]["decode_step_ms"][str(b)] / row[base]["decode_step_ms"][str(b)] for row in rounds)
    for key, value in summary.items():
        print(f"{key}: {value:.2f}")
    if ns.json:
        ns.json.write_text(json.dumps({"args": {k: v for k, v in vars(ns).items() if k != "json"}, "rounds": rounds,
                                       "summary": summary}, indent=1, default=str))


if __name__ == "__main__":
    main()
