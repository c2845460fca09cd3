"""The simulator's speed: this checkout against a git revision, alternating, same results.

    python benchmarks/sim_speed.py --base REV [--num-requests 20000] [--rounds 3] [--out DIR]

Runs ``epdserve simulate`` on the documented 100-instance workloads (docs/simulator.md,
"Measured scale": ``prefill=50,decode=50`` at 120 req/s and ``colocated=100`` at 60 req/s,
random 512 / 128 tokens) on a profile with the documented step costs, once per round for each
arm, the two arms alternating (the revision is checked out in a temporary git worktree, and
each arm's process imports only its own tree). Prints, per topology and arm, the median event
loop time and whole command time over the rounds and the ratio base / this checkout, and
whether both arms wrote the same result (everything but wall times and event counts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# docs/simulator.md, "Measured scale": SmolLM2-135M-Instruct, a quick profile of the 2-core host
STEPS = {
    "colocated": (2, {"base_s": 0.02985, "per_prefill_token_s": 3.504e-4, "per_prefill_attn_pair_s": 4.597e-6,
                      "per_decode_seq_s": 6.26e-4, "per_decode_context_token_s": 0.0}),
    "prefill": (1, {"base_s": 0.03346, "per_prefill_token_s": 7.011e-4, "per_prefill_attn_pair_s": 0.0,
                    "per_decode_seq_s": 0.0, "per_decode_context_token_s": 0.0}),
    "decode": (1, {"base_s": 0.01829, "per_prefill_token_s": 0.0, "per_prefill_attn_pair_s": 0.0,
                   "per_decode_seq_s": 1.859e-3, "per_decode_context_token_s": 0.0}),
}
PROFILE = {
    "version": 1, "model": "SmolLM2-135M-Instruct", "dtype": "float32", "block_size": 16,
    "kv_bytes_per_token": 23040, "embed_bytes_per_token": 2304, "num_layers": 30,
    "roles": {role: {"num_threads": threads, "num_kv_blocks": 2912, "max_num_seqs": 256,
                     "max_num_batched_tokens": 2048, "step": step}
              for role, (threads, step) in STEPS.items()},
}
RUNS = {"prefill=50,decode=50": 120.0, "colocated=100": 60.0}

# Imports epdserve from the tree given first, never from an installed copy.
RUNNER = """\
import sys
root = sys.argv.pop(1)
sys.path.insert(0, root)
import epdserve
assert epdserve.__file__.startswith(root), epdserve.__file__
from epdserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def simulate(tree: Path, runner: Path, profile: Path, topology: str, rate: float, num_requests: int,
             out: Path) -> tuple[float, float]:
    """One run; returns (event loop seconds, whole command seconds)."""
    out, profile = out.resolve(), profile.resolve()  # the command runs elsewhere (cwd below)
    cmd = [sys.executable, str(runner), str(tree), "simulate", "--profile", str(profile), "--topology", topology,
           "--workload", "random", "--random-input-len", "512", "--random-output-len", "128", "--rate", str(rate),
           "--num-requests", str(num_requests), "--max-pending", "1000000", "--max-waiting-per-worker", "1000000",
           "--quiet", "--out", str(out)]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=out.parent)  # cwd: not a tree, so '' on sys.path finds neither
    whole = time.perf_counter() - start
    return json.loads(out.read_text())["simulator"]["wall_time_s"], whole


def comparable(path: Path) -> dict:
    def strip(d):
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if k not in ("wall_time_s", "num_events", "date")}
        if isinstance(d, list):
            return [strip(x) for x in d]
        return d
    return strip(json.loads(path.read_text()))


def same_result(base: dict, this: dict, where: str = "") -> tuple[bool, list[str]]:
    """Whether the values both results have are equal, and the keys only one of them has (an
    output field added or removed between the revisions is not a change of result)."""
    if isinstance(base, dict) and isinstance(this, dict):
        is_same, only = True, sorted(f"{where}/{k}" for k in set(base) ^ set(this))
        for k in set(base) & set(this):
            s, o = same_result(base[k], this[k], f"{where}/{k}")
            is_same, only = is_same and s, only + o
        return is_same, only
    if isinstance(base, list) and isinstance(this, list) and len(base) == len(this):
        parts = [same_result(b, t, f"{where}[{i}]") for i, (b, t) in enumerate(zip(base, this))]
        return all(s for s, _ in parts), [k for _, o in parts for k in o]
    return base == this, []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--num-requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="keep the result files here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sim_speed_") as tmp:
        tmp = Path(tmp)
        out = Path(args.out) if args.out else tmp / "out"
        out.mkdir(parents=True, exist_ok=True)
        base_tree = tmp / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base_tree), args.base], check=True)
        try:
            runner = tmp / "runner.py"
            runner.write_text(RUNNER)
            profile = tmp / "profile.json"
            profile.write_text(json.dumps(PROFILE))
            times: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for r in range(args.rounds):
                arms = [("base", base_tree), ("this", ROOT)]
                for arm, tree in arms if r % 2 == 0 else arms[::-1]:
                    for topology, rate in RUNS.items():
                        path = out / f"{arm}_{topology.replace(',', '_').replace('=', '')}.json"
                        loop_s, whole_s = simulate(tree, runner, profile, topology, rate, args.num_requests, path)
                        times.setdefault((topology, arm), []).append((loop_s, whole_s))
                        print(f"round {r + 1} {arm:4s} {topology:22s} loop {loop_s:6.1f} s, command {whole_s:6.1f} s",
                              flush=True)
            print(f"\n{args.num_requests} requests, {args.rounds} rounds, base {args.base}; medians\n")
            print("| topology | base loop | this loop | base / this | base command | this command | same result |")
            print("|---|---|---|---|---|---|---|")
            for topology in RUNS:
                name = topology.replace(",", "_").replace("=", "")
                b = [statistics.median(x) for x in zip(*times[(topology, "base")])]
                t = [statistics.median(x) for x in zip(*times[(topology, "this")])]
                same, only = same_result(comparable(out / f"base_{name}.json"),
                                         comparable(out / f"this_{name}.json"))
                verdict = "yes" if same else "NO"
                if only:
                    verdict += f" (fields on one side only: {', '.join(only)})"
                print(f"| {topology} | {b[0]:.1f} s | {t[0]:.1f} s | {b[0] / t[0]:.2f}x | {b[1]:.1f} s | {t[1]:.1f} s | "
                      f"{verdict} |")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_tree)], check=False)


if __name__ == "__main__":
    main()
