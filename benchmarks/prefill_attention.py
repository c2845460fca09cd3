"""Prefill attention on the CPU: the extension's kernel against torch's, side by side.

    python benchmarks/prefill_attention.py [--rounds 3] [--repeats 0] [--threads 0]

``Attention._attend`` of SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64) in
bfloat16 for one prompt of 64-2048 tokens, fresh (causal from position 0) and after a cached
prefix (keys from position 0, queries from the middle), once through the extension's prefill
kernel (``paged_attention_cpu.prefill_attention``) and once through torch's
``scaled_dot_product_attention`` (``EPDSERVE_DISABLE_CPU_KERNELS=1``). q, k and v are views of
one fused qkv activation, as in the model. Rounds alternate the order of the two; prints the
median per case scaled to the model's 30 layers, the rate in causal GFLOP/s, and torch /
kernel. Needs a CPU with AVX512-BF16 (the kernel's requirement); on a CPU with AMX, where the
engine keeps torch's kernel, both are timed all the same (the measurement that rule awaits).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from epdserve import envs
from epdserve.models.layers import paged_attention_cpu
from epdserve.models.layers.attention import Attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 9, 3, 64, 30
CASES = ((64, 0), (256, 0), (512, 0), (2048, 0), (256, 768))  # query tokens, cached prefix tokens


def make_case(n: int, start: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    total = start + n
    qkv = torch.randn(total, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen).bfloat16()
    q = qkv[start:, : NUM_HEADS * HEAD_DIM].view(n, NUM_HEADS, HEAD_DIM)
    k = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(total, NUM_KV_HEADS, HEAD_DIM)
    v = qkv[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM :].view(total, NUM_KV_HEADS, HEAD_DIM)
    return q, k, v


def time_layers(attn: Attention, q, k, v, start: int, repeats: int, kernel: bool) -> float:
    """Seconds for NUM_LAYERS calls of ``_attend`` (mean over ``repeats``)."""
    if kernel:
        os.environ.pop(envs.EPDSERVE_DISABLE_CPU_KERNELS, None)
    else:
        os.environ[envs.EPDSERVE_DISABLE_CPU_KERNELS] = "1"
    # On an AMX CPU the engine keeps torch's kernel; here both are timed wherever both run.
    paged_attention_cpu._PREFILL_KERNEL_PREFERRED = kernel
    assert paged_attention_cpu.can_prefill(q, k, v) == kernel
    attn._attend(q, k, v, start)  # warm-up
    begin = time.perf_counter()
    for _ in range(repeats):
        for _ in range(NUM_LAYERS):
            attn._attend(q, k, v, start)
    return (time.perf_counter() - begin) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=0, help="0: about 0.3 s of kernel time per case")
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    q, k, v = make_case(16, 0, 0)
    paged_attention_cpu._PREFILL_KERNEL_PREFERRED = True
    if not paged_attention_cpu.can_prefill(q, k, v):
        raise SystemExit("the prefill kernel is not available here (needs AVX512-BF16 and the extension)")
    attn = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, layer_idx=0)
    print(f"threads {torch.get_num_threads()}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'tokens':>7} {'prefix':>7} {'kernel ms':>10} {'torch ms':>10} {'kernel GF/s':>12} {'torch GF/s':>11} {'ratio':>6}")
    for n, start in CASES:
        q, k, v = make_case(n, start, seed=n + start)
        # causal FLOPs: 2 products of 2 * D per (head, query, seen key)
        flops = NUM_LAYERS * NUM_HEADS * 4 * HEAD_DIM * (n * start + n * (n + 1) / 2)
        repeats = args.repeats or max(1, int(0.3 * 2.5e11 / flops))
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for kernel in ((True, False) if r % 2 == 0 else (False, True)):
                times[kernel].append(time_layers(attn, q, k, v, start, repeats, kernel))
        kern, ref = statistics.median(times[True]), statistics.median(times[False])
        print(f"{n:>7} {start:>7} {kern * 1e3:>10.2f} {ref * 1e3:>10.2f} {flops / kern / 1e9:>12.0f} "
              f"{flops / ref / 1e9:>11.0f} {ref / kern:>5.2f}x")
    os.environ.pop(envs.EPDSERVE_DISABLE_CPU_KERNELS, None)


if __name__ == "__main__":
    main()
