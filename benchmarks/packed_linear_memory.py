"""A process's memory under oneDNN packed matmuls at every row count, with and without padding.

    python benchmarks/packed_linear_memory.py [--calls 1500] [--max-rows 2048] [--dtype auto]

Three arms, each in a fresh process (resident memory is per process), the same random row
counts (1..``--max-rows``, uniform, seed 0) through SmolLM2-135M's four layer weight shapes:

- ``F.linear``: torch's default path, every row count as it comes;
- packed, exact rows: oneDNN's packed matmul (``_linear_pointwise``), every row count as it
  comes (what ``packed_linear.linear`` did before padding);
- packed, padded rows: ``packed_linear.linear``, which rounds row counts above 64 up
  (``padded_rows``: about 100 shapes up to 2048).

Prints each arm's resident memory before and after, the row counts seen, and the mean time per
call. Packing needs a oneDNN path for the dtype: bf16 where the CPU has one, else float32 (the
same primitive cache either way; serving packs bf16 weights only).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

import torch

from epdserve.config import resolve_dtype_name
from epdserve.models.layers import packed_linear

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: [out, in]
ARMS = ("F.linear", "packed, exact rows", "packed, padded rows")


def rss_mb() -> float:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def run_arm(arm: str, calls: int, max_rows: int, dtype: torch.dtype) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, packed_linear.DEFAULT_BATCH_HINT) for w in weights]
    rng = random.Random(0)
    before = rss_mb()
    seen: set[int] = set()
    elapsed = 0.0
    for _ in range(calls):
        rows = rng.randint(1, max_rows)
        seen.add(rows)
        for w, pw in zip(weights, packed):
            x = torch.randn(rows, w.shape[1], generator=gen).to(dtype)
            start = time.perf_counter()
            if arm == "F.linear":
                torch.nn.functional.linear(x, w)
            elif arm == "packed, exact rows":
                torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
            else:
                packed_linear.linear(x, w, None, pw)
            elapsed += time.perf_counter() - start
    return {"arm": arm, "rss_before_mb": before, "rss_after_mb": rss_mb(), "num_row_counts": len(seen),
            "num_shapes_run": len({packed_linear.padded_rows(r) for r in seen}) if "padded" in arm else len(seen),
            "ms_per_call": 1e3 * elapsed / (calls * len(SHAPES))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1500)
    parser.add_argument("--max-rows", type=int, default=2048)
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 where oneDNN has a bf16 path, else float32")
    parser.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)  # one arm, in a child
    ns = parser.parse_args()
    dtype = resolve_dtype_name(ns.dtype)
    if ns.arm is not None:
        print(json.dumps(run_arm(ns.arm, ns.calls, ns.max_rows, getattr(torch, dtype))))
        return 0
    print(f"{dtype}, {ns.calls} calls x {len(SHAPES)} weights, rows 1..{ns.max_rows}, one thread")
    print("| arm | RSS before | RSS after | row counts seen | shapes run | ms per call |")
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        proc = subprocess.run([sys.executable, __file__, "--arm", arm, "--calls", str(ns.calls),
                               "--max-rows", str(ns.max_rows), "--dtype", dtype],
                              capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"| {arm} | {r['rss_before_mb']:.0f} MB | {r['rss_after_mb']:.0f} MB | {r['num_row_counts']} | "
              f"{r['num_shapes_run']} | {r['ms_per_call']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
