"""Prefill attention on the CPU: the blocked kernel vs torch's scaled_dot_product_attention.

    python benchmarks/prefill_attention.py [--threads 1] [--repeats 5] [--rounds 3] [--dtype auto]

In the dtype serving takes here (``--dtype auto``: bf16 where the CPU has a bf16 matmul path,
else float32) unless ``--dtype`` says otherwise.

Two parts, each timing both paths side by side in the same run (alternating rounds, median):

1. One layer's attention (SmolLM2's 9 query heads over 3 KV heads of 64) for the chunk shapes
   of an 8-image request prefilled one image at a time, and for the whole prompt at once; with
   each path's mean absolute error against a float32 reference.
2. The real ``ModelRunner.execute`` of SmolLM2-135M on the same chunks, each step over
   its cached prefix (pages shuffled, as in a served worker), and the whole 2104-token prompt
   in 2048 + 56 tokens as an unpipelined prefill runs it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from epdserve.config import EngineArgs, resolve_dtype_name
from epdserve.engine.engine import LLMEngine
from epdserve.models.layers import attention
from epdserve.planner.profile_grid import StepPoint
from epdserve.planner.step_probe import StepProbe

# (start_pos, new tokens): text before the first image, then one chunk per 256-token image
# as embeddings arrive, then the rest in larger chunks (the pipelined prefill's step trace).
PIPELINED_CHUNKS = [(0, 56), (56, 256), (312, 256), (568, 256), (824, 256), (1080, 512), (1592, 518)]
WHOLE_PROMPT = [(0, 2048), (2048, 62)]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def layer_part(repeats: int, rounds: int, dtype: torch.dtype) -> None:
    heads, kv_heads, dim = 9, 3, 64
    layer = attention.Attention(heads, kv_heads, dim, dim**-0.5, layer_idx=0)
    torch.manual_seed(0)
    print("one layer's attention, ms (mean abs error vs float32)")
    print(f"{'chunk':>14} {'sdpa':>16} {'blocked':>16} {'ratio':>6}")
    for start, n in PIPELINED_CHUNKS + [(0, 2048)]:
        q = torch.randn(n, heads, dim, dtype=dtype)
        k = torch.randn(start + n, kv_heads, dim, dtype=dtype)
        v = torch.randn_like(k)
        ref = reference(q.float(), k.float(), v.float(), start)
        result = {}
        for blocked in (False, True):
            attention.BLOCKED_CPU_PREFILL = blocked
            err = (layer._attend(q, k, v, start).float() - ref).abs().mean().item()
            result[blocked] = ([], err)
        for _ in range(rounds):
            for blocked in (False, True):
                attention.BLOCKED_CPU_PREFILL = blocked
                result[blocked][0].append(
                    median_ms(lambda q=q, k=k, v=v, s=start: layer._attend(q, k, v, s), repeats)
                )
        sd, bl = (statistics.median(result[b][0]) for b in (False, True))
        print(
            f"{f'{n}@{start}':>14} {sd:8.2f} ({result[False][1]:.4f}) {bl:8.2f} ({result[True][1]:.4f}) "
            f"{sd / bl:6.2f}"
        )
    attention.BLOCKED_CPU_PREFILL = None


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    n, total = q.shape[0], k.shape[0]
    mask = torch.arange(total)[None, :] <= torch.arange(start, start + n)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=q.shape[-1] ** -0.5,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def model_part(repeats: int, rounds: int, dtype: str) -> None:
    engine = LLMEngine(
        EngineArgs(
            dtype=dtype, num_kv_blocks=1024, enable_prefix_caching=False, max_model_len=4096,
            max_num_batched_tokens=2048,
        )
    )
    probe = StepProbe(engine)

    def run(chunks: list[tuple[int, int]]) -> list[float]:
        out = []
        for start, n in chunks:
            plan = probe.build(StepPoint(((start, n),)))
            try:
                out.append(median_ms(lambda plan=plan: engine.runner.execute(plan), repeats))
            finally:
                probe.release(plan)
        return out

    print("\nSmolLM2-135M ModelRunner.execute, ms per step")
    arms = {}
    for _ in range(rounds):
        for blocked in (False, True):
            attention.BLOCKED_CPU_PREFILL = blocked
            for name, chunks in (("pipelined chunks", PIPELINED_CHUNKS), ("whole prompt", WHOLE_PROMPT)):
                arms.setdefault((name, blocked), []).append(run(chunks))
    attention.BLOCKED_CPU_PREFILL = None
    for name, chunks in (("pipelined chunks", PIPELINED_CHUNKS), ("whole prompt", WHOLE_PROMPT)):
        per = {b: [statistics.median(col) for col in zip(*arms[(name, b)])] for b in (False, True)}
        print(f"{name}: " + ", ".join(f"{n}@{s}" for s, n in chunks))
        print(f"  sdpa    {' '.join(f'{t:7.1f}' for t in per[False])}  total {sum(per[False]):7.1f}")
        print(
            f"  blocked {' '.join(f'{t:7.1f}' for t in per[True])}  total {sum(per[True]):7.1f}"
            f"  ratio {sum(per[False]) / sum(per[True]):.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--dtype", default="auto", help="auto: what serving takes on this machine")
    ns = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, set(cores[: ns.threads]))
    torch.set_num_threads(ns.threads)
    dtype = resolve_dtype_name(ns.dtype)
    print(f"{ns.threads} thread(s) on cores {cores[: ns.threads]}, {dtype}")
    layer_part(ns.repeats, ns.rounds, getattr(torch, dtype))
    if not ns.skip_model:
        model_part(max(1, ns.repeats // 2), ns.rounds, dtype)


if __name__ == "__main__":
    main()
