"""The paged decode-attention kernel of the working tree against the same kernel at a git
revision, side by side over a pool-sized KV cache.

    python benchmarks/decode_attention_revisions.py --against REV [--batch 64] [--context 330]
        [--rounds 9] [--dtype bfloat16] [--threads N]

Both versions of ``paged_attention_cpu.cpp`` are built with the package's flags
(``paged_attention_cpu.BUILD_CFLAGS``) under names of their own. SmolLM2-135M's shape (9 query heads, 3 KV heads,
head_dim 64, 30 layers), each layer its own cache of 4,096 blocks with the batch's pages drawn
at random from it (as a served pool scatters them; 1.5 GB in all, far beyond the L3), contexts
of ``--context`` - 40 .. ``--context`` tokens. A round runs the 30 layers through each version
in turn; prints each version's median over the rounds, every round, their ratio, and the
largest difference between the two versions' outputs (0 where they round alike; at most 1 % of
the output's magnitude, else the run fails).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from epdserve.models.layers import paged_attention_cpu

ROOT = Path(__file__).resolve().parent.parent
SOURCE = "epdserve/models/layers/paged_attention_cpu.cpp"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS, BLOCK_SIZE, POOL_BLOCKS = 9, 3, 64, 30, 16, 4096


def build(source: str, label: str):
    tag = hashlib.blake2b(source.encode(), digest_size=4).hexdigest()
    return load_inline(name=f"epdserve_attention_{label}_{tag}", cpp_sources=[source],
                       functions=["paged_decode_attention"], extra_cflags=paged_attention_cpu.BUILD_CFLAGS,
                       extra_ldflags=paged_attention_cpu.BUILD_LDFLAGS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="git revision whose kernel is the baseline")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=330)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)

    before = subprocess.run(["git", "show", f"{ns.against}:{SOURCE}"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    versions = {ns.against: build(before, "before"), "working tree": build((ROOT / SOURCE).read_text(), "after")}
    dtype = getattr(torch, ns.dtype)
    gen = torch.Generator().manual_seed(0)
    blocks = -(-ns.context // BLOCK_SIZE)
    caches = [torch.randn(2, POOL_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
              for _ in range(NUM_LAYERS)]
    tables = [(torch.randperm(POOL_BLOCKS - 1, generator=gen)[: ns.batch * blocks] + 1).view(ns.batch, blocks)
              for _ in range(NUM_LAYERS)]
    lens = torch.randint(max(1, ns.context - 40), ns.context + 1, (ns.batch,), generator=gen)
    q = torch.randn(ns.batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5

    times: dict[str, list[float]] = {name: [] for name in versions}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(ns.rounds):
        for name, module in versions.items():
            start = time.perf_counter()
            for layer in range(NUM_LAYERS):
                out = module.paged_decode_attention(q, caches[layer], tables[layer], lens, scale, 0)
            times[name].append((time.perf_counter() - start) * 1e3)
            outputs[name] = out
    first, second = outputs.values()
    # A revision that rounds otherwise (bf16 probabilities in the value product) may differ by
    # rounding, never by more: both stay within 1 % of the output's magnitude of each other.
    difference = (first.float() - second.float()).abs().max().item()
    if difference > 0.01 * first.float().abs().max().item():
        raise SystemExit(f"the two kernels' outputs differ by {difference:.3g}")
    kv_bytes = int(lens.sum()) * NUM_KV_HEADS * HEAD_DIM * 2 * q.element_size() * NUM_LAYERS
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"batch {ns.batch}, contexts {int(lens.min())}-{int(lens.max())}, {ns.dtype}, "
          f"{torch.get_num_threads()} threads, {kv_bytes / 2**20:.0f} MiB of K/V per step of {NUM_LAYERS} layers")
    for name, t in times.items():
        print(f"  {name:<14} {medians[name]:6.1f} ms per step ({kv_bytes / medians[name] / 1e6:.1f} GB/s); "
              f"rounds {', '.join(f'{x:.1f}' for x in t)}")
    old, new = medians.values()
    print(f"  {ns.against} / working tree: {old / new:.2f}x; outputs differ by at most {difference:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
