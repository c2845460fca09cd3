"""What loading a prefix from a KV tier costs a worker: reading and checking the blocks, then
writing them into the pool's pages, against the path before the blocks were read into one
buffer and copied with one indexed copy per layer; and what copying a prefix from the decode
worker's pages costs a prefill worker (``engine/kv_pull.py``), against its path before.

    python benchmarks/kv_tier_load.py [--blocks 96] [--rounds 7] [--threads 1] [--json FILE]

The engine's own ``KVOffload`` over a real tier (host: a fresh directory under /dev/shm; disk:
a temporary directory, read from the page cache as a recently written block is), with the
page shape of the default model's KV (SmolLM2-135M: 30 layers, 3 KV heads of 64, blocks of 16
tokens, bfloat16: 368,640 bytes a block). ``--blocks`` blocks are written down once, then each
round times, side by side on the same blocks and pages (the order alternating by round):

- now: ``KVOffload.plan_load`` (each block read into a row of one buffer, header checked and
  the payload's XXH3-128 compared) and ``KVOffload.apply`` (per layer, one ``index_copy_`` of
  every block's K and V);
- before: the engine's path before (block format 1): each block read into a bytearray of its
  own past its checked header, the payload's blake2b-128 computed (the files hold XXH3
  digests now, so it is computed for its cost, not compared), then ``torch.stack`` of them
  and, per layer, an advanced-index assignment from the transposed view.

The pull: ``--blocks`` pages scattered over a decode pool copied into a prefill pool's pages;
now ``kv_pull.copy_pages`` (per layer, ``index_select`` then ``index_copy_``), before an
advanced-index assignment per layer (``ours[:, dst] = theirs[:, src]``).

Medians per tier and the ratio before / now; the pages each path wrote are compared byte for
byte. One core's thread by default (a worker's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from epdserve.config import TierOptions
from epdserve.engine.block_pool import HASH_BYTES, BlockPool
from epdserve.engine.kv_offload import KVOffload
from epdserve.engine.kv_pull import copy_pages
from epdserve.engine.reload_rule import PrefillRate

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16  # SmolLM2-135M-Instruct
WAIT_S = 60.0


def key_of(i: int) -> bytes:
    return (i + 1).to_bytes(HASH_BYTES, "little")


def before_load(offload: KVOffload, keys: list[bytes], tier: str, block_ids: list[int]) -> None:
    """The load path before: a bytearray per block and its blake2b, stacked, assigned by
    advanced indexing."""
    store_tier = offload.store.host if tier == "host" else offload.store.disk
    blobs = []
    for key in keys:
        buf = bytearray(offload.block_bytes)
        with store_tier._open_checked(key, store_tier._path(key)) as opened:
            if opened is None or opened[0].readinto(buf) != len(buf):
                raise RuntimeError(f"block {key.hex()} missing from the {tier} tier")
        hashlib.blake2b(buf, digest_size=16).digest()
        blobs.append(buf)
    src = (torch.stack([torch.frombuffer(b, dtype=torch.uint8) for b in blobs])
           .view(offload.dtype).view(len(blobs), *offload.block_shape))
    index = torch.tensor(block_ids, dtype=torch.long)
    for layer, kv in enumerate(offload.kv_caches):
        kv[:, index] = src[:, layer].transpose(0, 1)


def now_load(offload: KVOffload, keys: list[bytes], block_ids: list[int]) -> None:
    load = offload.plan_load(keys, num_cached_tokens=0)
    if load is None or load.num_blocks != len(keys):
        raise RuntimeError("the engine's load did not read every block")
    load.block_ids = block_ids
    offload.apply([load])


def measure(tier: str, root: Path, num_blocks: int, rounds: int) -> dict:
    num_pages = 3 * num_blocks + 1
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randn(2, num_pages, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
          for _ in range(NUM_LAYERS)]
    gib = 2 * num_blocks * 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2 / 2**30
    # A read bandwidth so high that the reload rule always loads (the rule is not measured here).
    options = (TierOptions(host_gib=gib, host_dir=str(root), host_read_gbps=1000.0) if tier == "host" else
               TierOptions(disk_gib=gib, disk_dir=str(root), disk_read_gbps=1000.0))
    offload = KVOffload.open(options, "bench", kv, BlockPool(num_pages, True), BLOCK_SIZE, PrefillRate())
    try:
        keys = [key_of(i) for i in range(num_blocks)]
        for key, page in zip(keys, range(1, num_blocks + 1)):
            offload.store.submit_write(key, lambda p=page: offload._gather(p))
        if not offload.store.flush(WAIT_S):
            raise RuntimeError("the store's writer did not finish")
        before_ids = list(range(num_blocks + 1, 2 * num_blocks + 1))
        now_ids = list(range(2 * num_blocks + 1, 3 * num_blocks + 1))
        times: dict[str, list[float]] = {"before": [], "now": []}
        for r in range(rounds):
            arms = [("before", lambda: before_load(offload, keys, tier, before_ids)),
                    ("now", lambda: now_load(offload, keys, now_ids))]
            for name, fn in (arms if r % 2 == 0 else arms[::-1]):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        index = {"source": torch.arange(1, num_blocks + 1), "before": torch.tensor(before_ids),
                 "now": torch.tensor(now_ids)}
        same = all(layer[:, index["before"]].equal(layer[:, index["source"]])
                   and layer[:, index["now"]].equal(layer[:, index["source"]]) for layer in kv)
        if not same:
            raise RuntimeError("a path wrote pages that differ from the blocks written down")
        before, now = statistics.median(times["before"]), statistics.median(times["now"])
        return {"tier": tier, "num_blocks": num_blocks, "block_bytes": offload.block_bytes,
                "before_ms": before * 1e3, "now_ms": now * 1e3, "ratio": before / now,
                "before_rounds_ms": [t * 1e3 for t in times["before"]], "now_rounds_ms": [t * 1e3 for t in times["now"]]}
    finally:
        offload.close()


def measure_pull(num_blocks: int, rounds: int) -> dict:
    num_pages = 4 * num_blocks
    gen = torch.Generator().manual_seed(1)
    theirs = [torch.randn(2, num_pages, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
              for _ in range(NUM_LAYERS)]
    ours = {name: [torch.zeros_like(t) for t in theirs] for name in ("before", "now")}
    src = torch.randperm(num_pages, generator=gen)[:num_blocks]  # a decode pool's pages are anywhere
    dst = torch.randperm(num_pages, generator=gen)[:num_blocks]

    def before() -> None:
        for their_layer, our_layer in zip(theirs, ours["before"]):
            our_layer[:, dst] = their_layer[:, src]

    times: dict[str, list[float]] = {"before": [], "now": []}
    for r in range(rounds):
        arms = [("before", before), ("now", lambda: copy_pages(theirs, ours["now"], src, dst))]
        for name, fn in (arms if r % 2 == 0 else arms[::-1]):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    if not all(b[:, dst].equal(t[:, src]) and n.equal(b) for t, b, n in zip(theirs, ours["before"], ours["now"])):
        raise RuntimeError("the two copies wrote different pages")
    before_s, now_s = statistics.median(times["before"]), statistics.median(times["now"])
    return {"tier": "decode pages (pull)", "num_blocks": num_blocks,
            "block_bytes": 2 * NUM_LAYERS * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2,
            "before_ms": before_s * 1e3, "now_ms": now_s * 1e3, "ratio": before_s / now_s,
            "before_rounds_ms": [t * 1e3 for t in times["before"]], "now_rounds_ms": [t * 1e3 for t in times["now"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=96, help="blocks per load (96: a 1,536-token prefix)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a worker's cores)")
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    results = []
    host_root = Path("/dev/shm") / f"epdserve-bench-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    disk_root = Path(tempfile.mkdtemp(prefix="epdserve-bench-kv-"))
    try:
        for tier, root in (("host", host_root), ("disk", disk_root)):
            row = measure(tier, root, ns.blocks, ns.rounds)
            results.append(row)
            print(f"{tier} tier: {row['num_blocks']} blocks of {row['block_bytes']:,} B: before {row['before_ms']:.1f} ms, "
                  f"now {row['now_ms']:.1f} ms (median of {ns.rounds}): {row['ratio']:.2f}x", flush=True)
    finally:
        shutil.rmtree(host_root, ignore_errors=True)
        shutil.rmtree(disk_root, ignore_errors=True)
    row = measure_pull(ns.blocks, ns.rounds)
    results.append(row)
    print(f"pull from decode's pages: {row['num_blocks']} blocks: before {row['before_ms']:.1f} ms, "
          f"now {row['now_ms']:.1f} ms (median of {ns.rounds}): {row['ratio']:.2f}x", flush=True)
    if ns.json is not None:
        ns.json.write_text(json.dumps({"threads": ns.threads, "results": results}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
