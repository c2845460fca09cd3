"""Prefix caching across a P/D pair: real router and worker processes, shared memory and TCP.

The decode worker keeps the blocks of prompts it has decoded in its prefix cache; a later
prompt with the same prefix reserves them from the cache and the prefill worker sends only
the blocks after them.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import httpx
import pytest
from serving import SMALL, Server, start_server, stop_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16  # the default --block-size
PROMPT = [(7 * i) % 4000 + 100 for i in range(203)]  # 12 full blocks and 11 tokens


def complete(server: Server, prompt: list[int], **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "return_timing": True, **kw}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def metric(server: Server, name: str) -> float:
    lines = httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name) and not line.startswith("#"))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_repeated_prefix_sends_only_the_uncached_blocks(tmp_path, transport):
    server = start_server(SMALL + ["--kv-transport", transport], str(tmp_path))
    try:
        first = complete(server, PROMPT)
        t1 = first["timing"]
        assert t1["num_decode_cached_tokens"] == 0 and t1["kv_bytes_skipped"] == 0
        bytes_per_token = t1["kv_bytes"] // len(PROMPT)
        assert bytes_per_token * len(PROMPT) == t1["kv_bytes"] > 0

        second = complete(server, PROMPT)
        t2 = second["timing"]
        # Every whole block but the last token's: the engine always computes the last token.
        cached = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert t2["num_decode_cached_tokens"] == cached
        assert t2["num_cached_tokens"] == cached  # the prefill worker's own cache
        assert t2["kv_bytes"] == (len(PROMPT) - cached) * bytes_per_token
        assert t2["kv_bytes_skipped"] == cached * bytes_per_token
        assert second["choices"][0]["text"] == first["choices"][0]["text"]

        # A prompt sharing the first 5 blocks, then differing: only those 5 are reused.
        branch = PROMPT[: 5 * BLOCK_SIZE] + [t + 1 for t in PROMPT[5 * BLOCK_SIZE :]]
        t3 = complete(server, branch)["timing"]
        assert t3["num_decode_cached_tokens"] == 5 * BLOCK_SIZE
        assert t3["kv_bytes"] == (len(branch) - 5 * BLOCK_SIZE) * bytes_per_token

        assert metric(server, "epdserve_kv_transfer_skipped_bytes_total") == (cached + 5 * BLOCK_SIZE) * bytes_per_token
        assert metric(server, 'epdserve_prefix_cache_hit_tokens_total{role="decode"}') == cached + 5 * BLOCK_SIZE
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def test_decode_without_a_prefix_cache_is_sent_the_whole_prompt_again(tmp_path):
    """--decode-no-prefix-caching: the decode worker reuses nothing, so a repeated prompt's whole
    KV is reserved and sent again, while the prefill worker still computes only the delta."""
    server = start_server(SMALL + ["--decode-no-prefix-caching"], str(tmp_path))
    try:
        first = complete(server, PROMPT)
        second = complete(server, PROMPT)
        t1, t2 = first["timing"], second["timing"]
        assert t2["num_cached_tokens"] == (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert t2["num_decode_cached_tokens"] == 0 and t2["kv_bytes_skipped"] == 0
        assert t2["kv_bytes"] == t1["kv_bytes"] > 0
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert metric(server, 'epdserve_prefix_cache_hit_tokens_total{role="decode"}') == 0
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def test_decode_cache_survives_while_prefill_recomputes(tmp_path):
    """Two paths of one request (n=2) share the decode worker's cached prefix, and a streamed
    request still hands the decode worker only the delta."""
    server = start_server(SMALL, str(tmp_path))
    try:
        base = complete(server, PROMPT)
        both = complete(server, PROMPT, n=2)
        texts = [c["text"] for c in both["choices"]]
        assert texts == [base["choices"][0]["text"]] * 2
        cached = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert both["timing"]["num_decode_cached_tokens"] == cached
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            streamed = "".join(r.iter_lines())
        assert base["choices"][0]["text"].split()[0] in streamed
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_prefix_held_by_decode_alone_is_copied_from_its_pages(tmp_path, transport):
    """A prefill worker that restarted (empty pool) gets a prompt whose prefix the decode worker
    still caches: over shared memory it copies those blocks from the decode worker's pages (the
    reload rule: a memcpy beats computing them), over TCP it recomputes them; the output is the
    same either way, and the blocks decode holds are not sent back to it."""
    server = start_server(SMALL + ["--kv-transport", transport], str(tmp_path))
    try:
        first = complete(server, PROMPT)
        assert not first["timing"].get("kv_load")
        prefill = next(w for w in server.workers() if w["role"] == "prefill")
        os.kill(prefill["pid"], signal.SIGKILL)
        server.wait_until(lambda: any(w["role"] == "prefill" and w["state"] == "ready" and w["pid"] != prefill["pid"]
                                      for w in server.workers()), 120, "the prefill worker to restart")
        second = complete(server, PROMPT)
        t2 = second["timing"]
        cached = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert t2["num_decode_cached_tokens"] == cached
        assert t2["kv_bytes"] == (len(PROMPT) - cached) * (first["timing"]["kv_bytes"] // len(PROMPT))
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        if transport == "shm":
            assert t2["kv_load"]["num_peer_tokens"] == cached and t2["kv_load"]["predicted_peer_s"] > 0
            assert t2["num_cached_tokens"] == cached  # copied, not computed
            assert metric(server, 'epdserve_kv_tier_tokens_total{kind="peer"}') == cached
            # The copied blocks joined the prefill worker's own cache.
            third = complete(server, PROMPT)
            assert third["timing"]["num_cached_tokens"] == cached and not third["timing"].get("kv_load")
        else:
            assert not t2.get("kv_load") and t2["num_cached_tokens"] == 0
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def _cached_pool_blocks(server: Server) -> dict[str, int]:
    return {w["id"]: w["cached_blocks"]["pool"] for w in server.workers() if w["state"] == "ready"}


def test_prefix_aware_routing_sends_a_repeated_prefix_to_its_holder(tmp_path):
    """Two colocated workers: a repeated prefix goes to the worker that cached it even while
    that one is busier; a fresh prompt goes to the least loaded one."""
    server = start_server(SMALL + ["--colocated-workers", "2", "--routing", "prefix-aware"], str(tmp_path))
    try:
        assert complete(server, PROMPT, max_tokens=1)["timing"]["num_cached_tokens"] == 0
        # The first answer's Outputs carried the KV events of its prompt's blocks.
        holder = max(blocks := _cached_pool_blocks(server), key=blocks.get)
        assert blocks[holder] >= len(PROMPT) // BLOCK_SIZE
        other = next(w for w in blocks if w != holder)
        assert blocks[other] == 0
        with httpx.Client(base_url=server.url, timeout=120) as client:
            body = {"model": MODEL, "prompt": PROMPT + [11, 12, 13], "max_tokens": 400, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_timing": True}
            with client.stream("POST", "/v1/completions", json=body) as long_stream:
                assert long_stream.status_code == 200
                lines = long_stream.iter_lines()
                next(line for line in lines if line.startswith("data: "))  # its first token: prefilled
                assert server.worker(holder)["load"]["num_requests"] == 1  # the prefix's holder took it
                # The holder is now the busier worker: a repeat of the prefix still goes there,
                again = complete(server, PROMPT, max_tokens=1)
                assert again["timing"]["num_cached_tokens"] == (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
                # and a fresh prompt to the other (least-loaded) worker.
                fresh = [(11 * i) % 3000 + 500 for i in range(203)]
                assert complete(server, fresh, max_tokens=1)["timing"]["num_cached_tokens"] == 0
                assert _cached_pool_blocks(server)[other] >= len(fresh) // BLOCK_SIZE
                for _ in lines:
                    pass
        server.wait_all_blocks_free()
    finally:
        stop_server(server)


def _prompt(seed: int, n: int = 203) -> list[int]:
    return [(seed * 131 + 7 * i) % 4000 + 100 for i in range(n)]


@pytest.mark.parametrize("layout", ["colocated", "pd"])
def test_evicted_prefix_is_reloaded_from_host_then_disk_and_a_corrupt_block_is_a_miss(tmp_path, layout):
    """One colocated worker with a small pool (39 usable blocks), a host tier of 71 blocks
    (float32 KV: 720 KiB a block) and a disk tier below it. Prompts of 13 full blocks: four
    others push a prefix out of the pool (it is then on the host tier), eight more push it down
    to disk. Greedy output is the same each time, and
    a disk block corrupted on purpose is a miss (computed), never wrong output.

    The rule's inputs are pinned (read bandwidths given, not measured) so that it loads; the
    timing shows the rule's inputs either way. P/D: the prefill worker loads, and pushes the
    loaded blocks to the decode worker like computed ones."""
    host_dir = tmp_path_factory_shm()
    disk_dir = tmp_path / "disk"
    try:
        # P/D over TCP: over shared memory the prefill worker would copy a prefix the decode worker
        # still holds from its pages (test_prefix_held_by_decode_alone_is_copied_from_its_pages)
        # instead of loading it from the tiers this test is about.
        workers = (["--colocated-workers", "1"] if layout == "colocated"
                   else ["--prefill-workers", "1", "--kv-transport", "tcp"])
        server = start_server(SMALL + workers + ["--num-kv-blocks", "40", "--dtype", "float32",
                                       "--kv-host-tier-gib", "0.05", "--kv-host-tier-dir", host_dir,
                                       "--kv-disk-tier-gib", "0.2", "--kv-disk-tier-dir", str(disk_dir),
                                       "--kv-host-tier-read-gbps", "100", "--kv-disk-tier-read-gbps", "50"],
                              str(tmp_path))
        try:
            target = _prompt(0)
            first = complete(server, target)
            assert first["timing"]["num_cached_tokens"] == 0 and first["timing"]["kv_load"] is None
            for seed in (1, 2, 3, 4):
                complete(server, _prompt(seed))
            from_host = complete(server, target)
            assert from_host["choices"][0]["text"] == first["choices"][0]["text"]
            load = from_host["timing"]["kv_load"]
            assert load is not None and load["num_host_tokens"] > 0, from_host["timing"]
            assert load["predicted_load_s"] < load["predicted_compute_s"]
            assert from_host["timing"]["num_cached_tokens"] == (len(target) - 1) // BLOCK_SIZE * BLOCK_SIZE

            def push_to_disk() -> None:
                for seed in range(10, 18):
                    complete(server, _prompt(seed))

            push_to_disk()
            from_disk = complete(server, target)
            assert from_disk["choices"][0]["text"] == first["choices"][0]["text"]
            load = from_disk["timing"]["kv_load"]
            assert load is not None and load["num_disk_tokens"] > 0, from_disk["timing"]

            push_to_disk()
            files = sorted(p for p in (disk_dir).rglob("*") if p.is_file() and not p.name.startswith("."))
            assert files
            for path in files:  # every block on disk: the target's are among them
                data = bytearray(path.read_bytes())
                data[-1] ^= 0xFF
                path.write_bytes(bytes(data))
            corrupt = complete(server, target)
            assert corrupt["choices"][0]["text"] == first["choices"][0]["text"]
            load = corrupt["timing"]["kv_load"]
            # The rule chose to load blocks from disk; the first failed its check: none loaded.
            assert load["num_chosen_tokens"] > load["num_host_tokens"] and load["num_disk_tokens"] == 0, load
            assert metric(server, "epdserve_prefix_cache_hit_tokens_total") > 0
            assert metric(server, 'epdserve_kv_tier_tokens_total{kind="host"}') > 0
            assert metric(server, 'epdserve_kv_tier_tokens_total{kind="disk"}') > 0
            server.wait_all_blocks_free()
        finally:
            stop_server(server)
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


def tmp_path_factory_shm() -> str:
    return tempfile.mkdtemp(prefix="epdserve-test-kv-", dir="/dev/shm")
