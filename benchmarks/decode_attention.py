"""Paged decode attention on the CPU: the compiled kernel against torch's path, side by side.

    python benchmarks/decode_attention.py [--dtype auto] [--threads 1] [--repeats 20] [--rounds 3]

``Attention._decode`` of SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64) over
KV pages in random order, for batches of 1-32 sequences of 256-400 tokens, once through the
compiled kernel (``paged_attention_cpu``) and once through torch's path (gather the pages,
``scaled_dot_product_attention`` with a length mask; ``EPDSERVE_DISABLE_CPU_KERNELS=1``).
Rounds alternate the order of the two; prints the median per case, scaled to the model's 30
layers, and torch / kernel. Also prints the CPU's vector ISA as torch reports it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from epdserve import envs
from epdserve.config import resolve_dtype_name
from epdserve.models.layers import paged_attention_cpu
from epdserve.models.layers.attention import Attention, AttentionMetadata, GroupAttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS, BLOCK_SIZE = 9, 3, 64, 30, 16
CASES = ((1, 256), (4, 400), (8, 400), (16, 400), (32, 300))  # batch, context tokens


def make_case(batch: int, context: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 AttentionMetadata]:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1  # block 0: the null block
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    tables = order.view(batch, blocks_per_seq).contiguous()
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    meta = AttentionMetadata(
        num_decode_seqs=batch, query_lens=[1] * batch, context_lens=[context] * batch,
        decode_context_lens=torch.full((batch,), context, dtype=torch.long), block_size=BLOCK_SIZE,
        groups=[GroupAttentionMetadata(torch.zeros(batch, dtype=torch.long), tables)],
        layer_to_group=[0], kv_caches=[cache],
    )
    return q, cache, meta


def time_path(attn: Attention, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, kernel: bool,
              repeats: int) -> float:
    """Median seconds of one call of ``Attention._decode`` on the kernel or torch's path."""
    os.environ[envs.EPDSERVE_DISABLE_CPU_KERNELS] = "0" if kernel else "1"
    attn._decode(q, cache, meta.groups[0], meta)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        attn._decode(q, cache, meta.groups[0], meta)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, resolve_dtype_name(args.dtype))
    if not paged_attention_cpu.is_available():
        raise SystemExit("the CPU kernel did not build here; nothing to compare")
    attn = Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, layer_idx=0)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {dtype}, {args.threads} thread(s)")
    times: dict[tuple[int, int, bool], list[float]] = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            for i, (batch, context) in enumerate(CASES):
                q, cache, meta = make_case(batch, context, dtype, seed=i)
                for kernel in ((True, False) if r % 2 == 0 else (False, True)):
                    times.setdefault((batch, context, kernel), []).append(
                        time_path(attn, q, cache, meta, kernel, args.repeats))
    os.environ.pop(envs.EPDSERVE_DISABLE_CPU_KERNELS)
    print(f"| batch x context | kernel ({NUM_LAYERS} layers) | torch's path | torch / kernel |")
    print("|---|---|---|---|")
    for batch, context in CASES:
        kernel_s = statistics.median(times[(batch, context, True)]) * NUM_LAYERS
        torch_s = statistics.median(times[(batch, context, False)]) * NUM_LAYERS
        print(f"| {batch} x {context} | {kernel_s * 1e3:.2f} ms | {torch_s * 1e3:.2f} ms | {torch_s / kernel_s:.2f}x |")


if __name__ == "__main__":
    main()
