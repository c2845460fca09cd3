"""The engine's command-line options, shared by ``generate``, ``serve``, ``worker`` and
``profile``: the argument group, the ``EngineArgs`` it builds, and the flags ``serve`` passes
on to the workers it starts (the same options, back as argv)."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file, Hugging Face directory, 'default' (SmolLM2-135M-Instruct) or 'gemma3'")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA and on CPUs with native bf16 matmuls, else float32), bfloat16, float32, float16")
    g.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens of one request")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens computed per step")
    g.add_argument("--no-chunked-prefill", action="store_true", help="run each prompt in one step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", type=float, default=2.0, help="KV cache size in GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per group (overrides --kv-cache-memory)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's shared sampler")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="rank processes per engine, each with its shard of the weights and KV heads, pinned to "
                        "its share of the cores (gloo on CPU, NCCL on CUDA); serve's --prefill-tp / --decode-tp set it per role")
    g.add_argument("--kv-host-tier-gib", type=float, default=0.0,
                   help="KV store below the pool: host-memory tier size, shared by the workers of a host (0: none)")
    g.add_argument("--kv-disk-tier-gib", type=float, default=0.0, help="KV store below the pool: local-disk tier size (0: none)")
    g.add_argument("--kv-host-tier-dir", default=None, help="the host tier's directory (default /dev/shm/epdserve-kv-UID)")
    g.add_argument("--kv-disk-tier-dir", default=None, help="the disk tier's directory (default ~/.cache/epdserve/kv)")
    g.add_argument("--kv-host-tier-read-gbps", type=float, default=None,
                   help="reload rule: the host tier's read bandwidth in GB/s instead of the one measured at start")
    g.add_argument("--kv-disk-tier-read-gbps", type=float, default=None,
                   help="reload rule: the disk tier's read bandwidth in GB/s instead of the one measured at start")
    # Fault injection for tests: KIND:SEED[:OPTION ...], repeatable (epdserve/faults.py).
    g.add_argument("--debug-fault", action="append", default=[], help=argparse.SUPPRESS)


def engine_args_from(ns: argparse.Namespace):  # -> EngineArgs
    from epdserve.config import EngineArgs, TierOptions
    from epdserve.faults import parse_fault

    return EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        device=ns.device,
        seed=ns.seed,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enable_chunked_prefill=not ns.no_chunked_prefill,
        block_size=ns.block_size,
        kv_cache_memory_gib=ns.kv_cache_memory,
        num_kv_blocks=ns.num_kv_blocks,
        enable_prefix_caching=not ns.no_prefix_caching,
        tensor_parallel_size=ns.tensor_parallel_size,
        kv_tiers=TierOptions(ns.kv_host_tier_gib, ns.kv_disk_tier_gib, ns.kv_host_tier_dir, ns.kv_disk_tier_dir,
                             ns.kv_host_tier_read_gbps, ns.kv_disk_tier_read_gbps),
        faults=tuple(parse_fault(text) for text in ns.debug_fault),
    )


def engine_argv(ns: argparse.Namespace) -> list[str]:
    """The engine options in ``ns`` as flags again (what ``serve`` passes on to its workers)."""
    args = ["--dtype", ns.dtype, "--device", ns.device, "--block-size", str(ns.block_size),
            "--max-num-seqs", str(ns.max_num_seqs), "--kv-cache-memory", str(ns.kv_cache_memory),
            "--seed", str(ns.seed), "--tensor-parallel-size", str(ns.tensor_parallel_size)]
    if ns.model is not None:
        args += ["--model", ns.model]
    for flag, value in (("--max-model-len", ns.max_model_len), ("--max-num-batched-tokens", ns.max_num_batched_tokens),
                        ("--num-kv-blocks", ns.num_kv_blocks), ("--kv-host-tier-dir", ns.kv_host_tier_dir),
                        ("--kv-disk-tier-dir", ns.kv_disk_tier_dir),
                        ("--kv-host-tier-read-gbps", ns.kv_host_tier_read_gbps),
                        ("--kv-disk-tier-read-gbps", ns.kv_disk_tier_read_gbps)):
        if value is not None:
            args += [flag, str(value)]
    for flag, gib in (("--kv-host-tier-gib", ns.kv_host_tier_gib), ("--kv-disk-tier-gib", ns.kv_disk_tier_gib)):
        if gib:
            args += [flag, str(gib)]
    if ns.no_prefix_caching:
        args.append("--no-prefix-caching")
    if ns.no_chunked_prefill:
        args.append("--no-chunked-prefill")
    for fault in ns.debug_fault:
        args += ["--debug-fault", fault]
    return args


def engine_argv_of(argv: list[str]) -> list[str]:
    """The engine flags ``serve ARGV`` would pass its own workers (other flags are ignored)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    ns, _ = parser.parse_known_args(argv)
    return engine_argv(ns)
