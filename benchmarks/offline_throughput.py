"""Offline throughput: epdserve's engine beside vLLM's offline engine, in one run.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 64] [--input-len 256]
        [--output-len 128] [--dtype auto] [--rounds 3] [--skip-vllm] [--against-dtype D] [--json out.json]

Workload (as `vllm bench throughput --dataset-name random`): N prompts of random token ids,
fixed output length, EOS ignored, all cores, both engines in one dtype (``--dtype auto``: what
epdserve serves with here, bfloat16 where the CPU has a bf16 matmul path, else float32). Also
reports the decode step time at batch 1 against the memory-bandwidth bound (weight bytes /
measured copy bandwidth) and prefill tokens/s against the matmul bound in that dtype (2 *
params FLOPs per token / measured GEMM rate).

The two engines alternate in ``--rounds`` rounds (epdserve, vLLM, epdserve, vLLM, ...): on a
shared host the speed of the same code moves by tens of percent within minutes, so one pair
can land on a fast and a slow stretch. Each round's ratio is of its own pair; the summary is
the median ratio and the rounds' spread. epdserve's engine is built once; each round sends
prompts of its own seed, so no round finds another's prompts in the prefix cache.

``--against-dtype D``: a second epdserve engine in dtype D runs each round's prompts right after
the first (both built once, side by side in one process), with the ratio of the two per round:
what ``--dtype auto`` gains or loses on this CPU against the other choice.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from epdserve.config import EngineArgs, resolve_dtype_name
from epdserve.engine.engine import LLMEngine
from epdserve.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT.parent / "shared" / "peers" / "vllm-cpu.sh"


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab_size - 1000) for _ in range(length)] for _ in range(num)]


def build_engine(args: argparse.Namespace, dtype: str | None = None) -> LLMEngine:
    engine = LLMEngine(EngineArgs(dtype=dtype or args.dtype, max_num_batched_tokens=args.max_num_batched_tokens))
    engine.generate(random_prompts(engine.loaded.spec.vocab_size, 2, 32, 1), SamplingParams(max_tokens=4))
    return engine


def run_epdserve(args: argparse.Namespace, engine: LLMEngine, seed: int) -> dict:
    # Seeds from 100 up (the warm-up has 1, the roofline's prompts 1000 up).
    prompts = random_prompts(engine.loaded.spec.vocab_size, args.num_prompts, args.input_len, 100 + seed)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(r[0].token_ids) for r in results)
    num_in = sum(len(p) for p in prompts)
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(prompts) / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
    }


def run_vllm(args: argparse.Namespace) -> dict | None:
    if not PEER.exists():
        return None
    model_dir = subprocess.run([str(PEER), "model-dir"], capture_output=True, text=True).stdout.strip()
    cmd = [
        str(PEER), "bench", "throughput", "--model", model_dir, "--dtype", args.dtype,
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts), "--max-model-len", "4096",
        # vLLM reserves this share of the NUMA node's free memory at start and refuses to start
        # when the page cache has taken some of it; its KV cache size is set separately.
        "--gpu-memory-utilization", "0.5",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    match = re.search(r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s", out)
    if not match:
        errors = [line for line in out.splitlines() if "Error" in line]
        print("vLLM failed: " + (errors[-1] if errors else out[-2000:]), file=sys.stderr)
        return None
    return {
        "requests_per_s": float(match.group(1)),
        "total_tokens_per_s": float(match.group(2)),
        "output_tokens_per_s": float(match.group(3)),
    }


def copy_bandwidth_gbps(num_bytes: int = 512 * 2**20) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best / 1e9  # read + write


def gemm_tflops(dtype: torch.dtype, m: int = 2048, k: int = 576, n: int = 1536) -> float:
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - t) / 1e12


def roofline(engine: LLMEngine, seed: int) -> dict:
    """Decode at batch 1 and one full prefill step, on prompts of the round's own seeds (none
    found in the prefix cache), against the bandwidth and matmul bounds."""
    model = engine.loaded.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    num_params = sum(p.numel() for p in model.parameters())
    vocab = engine.loaded.spec.vocab_size
    prompt = random_prompts(vocab, 1, 64, 1000 + 2 * seed)[0]
    params = SamplingParams(max_tokens=65, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params)
    step_times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - t)
    decode_ms = sorted(step_times[1:])[len(step_times[1:]) // 2] * 1e3
    bandwidth = copy_bandwidth_gbps()
    bound_ms = weight_bytes / (bandwidth / 2 * 1e9) * 1e3  # weights are read once per step

    # One step of 8 prompts x 256 tokens (the benchmark's prompt shape, a full token budget).
    prompts = random_prompts(vocab, 8, 256, 1001 + 2 * seed)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=1))
    t = time.perf_counter()
    engine.step()
    prefill_tps = 8 * 256 / (time.perf_counter() - t)
    tflops = gemm_tflops(next(model.parameters()).dtype)
    # Non-embedding parameters do the matmuls of a prompt token; the LM head runs once.
    flops_per_token = 2 * (num_params - vocab * engine.loaded.spec.hidden_size)
    return {
        "weight_bytes": weight_bytes,
        "copy_bandwidth_gbps": bandwidth,
        "decode_step_ms_batch1": decode_ms,
        "decode_bound_ms": bound_ms,
        "prefill_tokens_per_s": prefill_tps,
        "gemm_tflops": tflops,
        "prefill_bound_tokens_per_s": tflops * 1e12 / flops_per_token,
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} (rounds {', '.join(f'{v:.2f}' for v in values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--dtype", default="auto", help="auto: epdserve's default on this machine")
    parser.add_argument("--rounds", type=int, default=3, help="alternating epdserve / vLLM pairs")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--against-dtype", default=None,
                        help="a second epdserve engine in this dtype, each round, with the ratio")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    args.dtype = resolve_dtype_name(args.dtype)
    print(f"dtype {args.dtype}")
    torch.set_num_threads(os.cpu_count() or 1)

    engine = build_engine(args)
    other = None
    if args.against_dtype is not None:
        args.against_dtype = resolve_dtype_name(args.against_dtype)
        other = build_engine(args, args.against_dtype)
    rounds = []
    for k in range(args.rounds):
        ours = run_epdserve(args, engine, k)
        print(f"round {k + 1} epdserve: {ours['requests_per_s']:.2f} req/s, {ours['total_tokens_per_s']:.1f} total "
              f"tok/s, {ours['output_tokens_per_s']:.1f} output tok/s ({ours['elapsed_s']:.1f} s)")
        if other is not None:
            theirs = run_epdserve(args, other, k)
            dtype_ratio = ours["total_tokens_per_s"] / theirs["total_tokens_per_s"]
            print(f"round {k + 1} epdserve in {args.against_dtype}: {theirs['total_tokens_per_s']:.1f} total tok/s "
                  f"({theirs['elapsed_s']:.1f} s); {args.dtype} / {args.against_dtype} {dtype_ratio:.2f}x")
        roof = roofline(engine, k)
        print(f"round {k + 1} decode step at batch 1: {roof['decode_step_ms_batch1']:.2f} ms; bandwidth bound "
              f"{roof['decode_bound_ms']:.2f} ms ({roof['weight_bytes'] / 1e6:.0f} MB weights, "
              f"{roof['copy_bandwidth_gbps']:.1f} GB/s copy)")
        print(f"round {k + 1} prefill: {roof['prefill_tokens_per_s']:.0f} tok/s; {args.dtype} matmul bound "
              f"{roof['prefill_bound_tokens_per_s']:.0f} tok/s ({roof['gemm_tflops']:.2f} TFLOP/s)")
        vllm = None if args.skip_vllm else run_vllm(args)
        ratio = ours["total_tokens_per_s"] / vllm["total_tokens_per_s"] if vllm else None
        if vllm:
            print(f"round {k + 1} vLLM:     {vllm['requests_per_s']:.2f} req/s, {vllm['total_tokens_per_s']:.1f} "
                  f"total tok/s, {vllm['output_tokens_per_s']:.1f} output tok/s; epdserve / vLLM {ratio:.2f}x")
        rounds.append({"epdserve": ours, "vllm": vllm, "roofline": roof, "ratio": ratio,
                       **({"against": theirs, "dtype_ratio": dtype_ratio} if other is not None else {})})
    print(f"epdserve total tok/s: {spread([r['epdserve']['total_tokens_per_s'] for r in rounds])}")
    if other is not None:
        print(f"epdserve {args.dtype} / {args.against_dtype} total tokens/s: "
              f"{spread([r['dtype_ratio'] for r in rounds])}")
    print(f"decode at batch 1 / bandwidth bound: "
          f"{spread([r['roofline']['decode_step_ms_batch1'] / r['roofline']['decode_bound_ms'] for r in rounds])}")
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    if ratios:
        print(f"vLLM total tok/s: {spread([r['vllm']['total_tokens_per_s'] for r in rounds if r['vllm']])}")
        print(f"epdserve / vLLM total tokens/s: {spread(ratios)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"dtype": args.dtype, "against_dtype": args.against_dtype, "rounds": rounds,
                                               "median_ratio": statistics.median(ratios) if ratios else None},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
