"""Tensor parallelism on this machine's cores: TP 1 (one process, every core) beside TP 2 (two
rank processes, half the cores each, gloo all-reduces), in alternating rounds.

    .venv/bin/python benchmarks/tp.py [--model gemma3] [--rounds 3] [--num-prompts 16]
        [--input-len 256] [--output-len 64] [--decode-batch 1,8] [--dtype auto] [--json out.json]
    .venv/bin/python benchmarks/tp.py --transfer [--pairs 1:1,1:2,2:1,2:2] [--transfer-tokens 2048]
        [--kv-heads N --head-dim D --layers L] [--transports shm,tcp]

Each round runs every TP size in a fresh process (a TP engine pins its ranks, which would
change the affinity of anything else in the process): offline throughput (N prompts of random
token ids, fixed output length, EOS ignored; total tokens/s) and the median decode step time
at each ``--decode-batch`` (sequences of ``--input-len`` tokens, 32 steps after 4 warm-up
steps). The ratio TP 2 / TP 1 is reported per round and as the median over rounds.

``--transfer``: the P/D hand-off alone, prefill at TP a into decode at TP b, beside equal TP.
Each rank's pages are a shared-memory pool as in a P/D worker (the model's layer shapes, or
``--kv-heads``/``--head-dim``/``--layers``); the pusher of the prefill worker's rank 0 moves one
prompt of ``--transfer-tokens`` positions layer by layer in chunks of 256 (``transfer/tp_plan.py``:
straight from a rank's pages where layouts agree, through the staging buffer otherwise) into the
decode ranks' pools (shm) or through the decode worker's TCP listener, until the transfer
reports done. Median over repetitions and rounds; each pair's time over the equal-TP pair of
the same prefill TP (a -> a) and over 1 -> 1.
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


def measure_transfer(ns: argparse.Namespace, src_tp: int, dst_tp: int, transport: str) -> dict:
    """Seconds to push one prompt's KV from prefill TP ``src_tp`` to decode TP ``dst_tp``."""
    import torch

    from epdserve.auth import new_key
    from epdserve.transfer.connector import KVPusher, PushItem
    from epdserve.transfer.descriptors import KVEndpoint
    from epdserve.transfer.fence import ReservationFence
    from epdserve.transfer.shm_pool import SharedKVPool
    from epdserve.transfer.tcp import TcpKVReceiver
    from epdserve.transfer.tp_plan import kv_heads_of_rank, plan_transfer

    heads, dim, layers, dtype = ns.kv_shape
    block_size, chunk = 16, 256
    num_blocks = ns.transfer_tokens // block_size + 2
    key = new_key()

    def pools(tp: int) -> list[SharedKVPool]:
        local = kv_heads_of_rank(heads, 0, tp)[1]
        made = [SharedKVPool.create(num_blocks, block_size, [(local, dim)] * layers, dtype) for _ in range(tp)]
        for pool in made:
            for layer in pool.layers:
                layer.normal_()
        return made

    src, dst = pools(src_tp), pools(dst_tp)
    fence = ReservationFence(1, num_blocks, shm=transport == "shm")
    landed: list[str] = []
    base = dst[0].endpoint()
    fields = {f: getattr(base, f) for f in base.__struct_fields__}
    fields.update(tp_size=dst_tp, total_kv_heads=heads, rank_shm_names=[p.name for p in dst[1:]], transport=transport)
    receiver = None
    if transport == "shm":
        fields.update(fence_shm_name=fence.shm_name)
    else:
        receiver = TcpKVReceiver(dst[0].layers, landed.append, fence, [0] * layers, key,
                                 rank_caches=[p.layers for p in dst])
        fields.update(shm_name="", rank_shm_names=[], host=receiver.host, port=receiver.port)
    pusher = KVPusher(src[0].layers, [0] * layers, block_size, True, rank_caches=[p.layers for p in src],
                      total_kv_heads=heads, staging_tokens=chunk)
    pusher.add_peer("decode", KVEndpoint(**fields), key)
    table = list(range(1, ns.transfer_tokens // block_size + 1))
    times = []
    for rep in range(ns.transfer_reps + 1):  # the first is a warm-up
        generation = fence.open([table], f"r{rep}")
        start = time.perf_counter()
        for first in range(0, ns.transfer_tokens, chunk):
            end = min(first + chunk, ns.transfer_tokens)
            pusher.begin_step([PushItem(f"r{rep}", "decode", first, end, [table], [table], end == ns.transfer_tokens,
                                        generation)])
            for layer in range(layers):
                pusher.save_layer(layer)
            pusher.end_step()
        while not pusher.poll():
            time.sleep(0.0005)
        while transport == "tcp" and f"r{rep}" not in landed:
            time.sleep(0.0005)
        if rep:
            times.append(time.perf_counter() - start)
        fence.close(generation)
    plan = plan_transfer(heads, src_tp, dst_tp)
    pusher.close()
    if receiver is not None:
        receiver.close()
    fence.close_all()
    for pool in src + dst:
        pool.close()
    item = torch.tensor([], dtype=dtype).element_size()
    num_bytes = ns.transfer_tokens * layers * 2 * plan.sent_heads() * dim * item
    return {"seconds": statistics.median(times), "bytes": num_bytes,
            "staged": not all(plan.is_whole(r) for r in range(dst_tp))}


def run_transfer(ns: argparse.Namespace) -> None:
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in ns.pairs.split(",")]
    transports = ns.transports.split(",")
    rounds = []
    for r in range(ns.rounds):
        row = {}
        for transport in transports:
            for src_tp, dst_tp in pairs if r % 2 == 0 else reversed(pairs):  # alternate the order
                row[f"{transport} {src_tp}->{dst_tp}"] = measure_transfer(ns, src_tp, dst_tp, transport)
        rounds.append(row)
        print(f"round {r + 1}: " + " | ".join(f"{k} {v['seconds'] * 1000:.1f} ms" for k, v in row.items()), flush=True)
    summary = {}
    for transport in transports:
        for src_tp, dst_tp in pairs:
            name = f"{transport} {src_tp}->{dst_tp}"
            cell = {"ms": 1000 * statistics.median(row[name]["seconds"] for row in rounds),
                    "MB": rounds[0][name]["bytes"] / 1e6, "staged": rounds[0][name]["staged"]}
            cell["GB_s"] = cell["MB"] / cell["ms"]
            for ref in (f"{transport} {src_tp}->{src_tp}", f"{transport} 1->1"):
                if ref in rounds[0] and ref != name:
                    cell[f"over {ref.split()[1]}"] = statistics.median(
                        row[name]["seconds"] / row[ref]["seconds"] for row in rounds)
            summary[name] = cell
            print(f"{name}: {cell['ms']:.1f} ms, {cell['MB']:.1f} MB, {cell['GB_s']:.2f} GB/s"
                  + ("" if not cell["staged"] else " (staged)")
                  + "".join(f", {k} {v:.2f}x" for k, v in cell.items() if k.startswith("over")))
    if ns.json:
        ns.json.write_text(json.dumps({"args": {k: v for k, v in vars(ns).items() if k != "json"}, "rounds": rounds,
                                       "summary": summary}, indent=1, default=str))


def kv_shape(ns: argparse.Namespace) -> tuple:
    """(KV heads, head dim, layers, dtype) of the model, or as the flags override them."""
    import torch

    from epdserve.config import resolve_dtype_name
    from epdserve.models.loader import load_model_info

    spec = load_model_info(ns.model).spec
    dtype = getattr(torch, resolve_dtype_name(ns.dtype, "cpu"))
    return (ns.kv_heads or spec.num_kv_heads, ns.head_dim or spec.head_dim, ns.layers or spec.num_layers, dtype)


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
    parser.add_argument("--transfer", action="store_true", help="time the P/D hand-off a -> b instead")
    parser.add_argument("--pairs", default="1:1,1:2,2:1,2:2", help="prefill TP:decode TP pairs (--transfer)")
    parser.add_argument("--transports", default="shm,tcp")
    parser.add_argument("--transfer-tokens", type=int, default=2048)
    parser.add_argument("--transfer-reps", type=int, default=5)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    ns.decode_batch = [int(b) for b in ns.decode_batch.split(",")]
    if ns.transfer:
        ns.kv_shape = kv_shape(ns)
        run_transfer(ns)
        return
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
