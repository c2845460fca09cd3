"""Prefix caching across a P/D pair: real router and worker processes, shared memory and TCP.

The decode worker keeps the blocks of prompts it has decoded in its prefix cache; a later
prompt with the same prefix reserves them from the cache and the prefill worker sends only
the blocks after them.
"""

from __future__ import annotations

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
