"""The engine of the working tree against the engine at a git revision, on the offline workload,
side by side in alternating rounds, with the time of each kind of step.

    python benchmarks/offline_revisions.py --against REV [--rounds 3] [--num-prompts 64]
        [--input-len 256] [--output-len 128]

The revision is checked out into a temporary git worktree; each round runs the workload of
``offline_throughput.py`` (N random prompts, fixed output length, EOS ignored, greedy, the
default dtype) once in a fresh process per tree (``PYTHONPATH`` pointing at the tree, so the
extension is built from that tree's source), revision first in odd rounds and working tree
first in even ones. Each run reports total tokens/s and its model time by kind of step:
prefill (prompt tokens only), mixed (prompt tokens beside decoding sequences) and decode (one
token per sequence). Prints every round and the medians, and working tree / revision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_workload(args: argparse.Namespace) -> dict:
    """In the child: the workload on this process's epdserve, with per-kind step times."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from offline_throughput import random_prompts

    from epdserve.config import EngineArgs
    from epdserve.engine.engine import LLMEngine
    from epdserve.sampling import SamplingParams

    engine = LLMEngine(EngineArgs(dtype="auto"))
    engine.generate(random_prompts(engine.loaded.spec.vocab_size, 2, 32, 1), SamplingParams(max_tokens=4))
    execute = engine.runner.execute
    kinds = {kind: {"steps": 0, "seconds": 0.0} for kind in ("prefill", "mixed", "decode")}

    def timed(plan):
        start = time.perf_counter()
        out = execute(plan)
        elapsed = time.perf_counter() - start
        decoding = sum(1 for e in plan.scheduled if e.start_pos >= e.request.num_prompt_tokens)
        kind = "decode" if decoding == len(plan.scheduled) else "prefill" if decoding == 0 else "mixed"
        kinds[kind]["steps"] += 1
        kinds[kind]["seconds"] += elapsed
        return out

    engine.runner.execute = timed
    prompts = random_prompts(engine.loaded.spec.vocab_size, args.num_prompts, args.input_len, 100)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    total = args.num_prompts * (args.input_len + args.output_len)
    return {"total_tokens_per_s": total / elapsed, "elapsed_s": elapsed, "steps": kinds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="git revision to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_workload(args)))
        return 0
    if not args.against:
        parser.error("--against REV is required")
    with tempfile.TemporaryDirectory(prefix="epdserve-rev-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.against],
                       check=True, capture_output=True)
        try:
            trees = {args.against: tree, "working tree": ROOT}
            results: dict[str, list[dict]] = {name: [] for name in trees}
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))
                for name in order:
                    env = dict(os.environ, PYTHONPATH=str(trees[name]))
                    cmd = [sys.executable, str(trees[name] / "benchmarks" / "offline_revisions.py"), "--child",
                           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                           "--output-len", str(args.output_len)]
                    if not (trees[name] / "benchmarks" / "offline_revisions.py").exists():
                        cmd[1] = str(Path(__file__).resolve())  # an older revision without this script
                    out = subprocess.run(cmd, env=env, cwd=trees[name], check=True, capture_output=True, text=True)
                    result = json.loads(out.stdout.strip().splitlines()[-1])
                    results[name].append(result)
                    steps = ", ".join(f"{kind} {s['steps']} x {1e3 * s['seconds'] / max(1, s['steps']):.1f} ms"
                                      for kind, s in result["steps"].items())
                    print(f"round {r + 1} {name:<14} {result['total_tokens_per_s']:7.1f} total tok/s; {steps}",
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    medians = {name: statistics.median(r["total_tokens_per_s"] for r in rs) for name, rs in results.items()}
    for name, rs in results.items():
        per_kind = {kind: statistics.median(1e3 * r["steps"][kind]["seconds"] / max(1, r["steps"][kind]["steps"])
                                            for r in rs) for kind in ("prefill", "mixed", "decode")}
        print(f"{name:<14} {medians[name]:7.1f} total tok/s (median); median ms per step: "
              + ", ".join(f"{k} {v:.1f}" for k, v in per_kind.items()))
    ratios = [w["total_tokens_per_s"] / a["total_tokens_per_s"]
              for w, a in zip(results["working tree"], results[args.against])]
    print(f"working tree / {args.against}: {medians['working tree'] / medians[args.against]:.2f}x "
          f"(rounds {', '.join(f'{x:.2f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
