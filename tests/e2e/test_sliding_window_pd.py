"""Gemma-3 served P/D: its sliding-window layers send only the window's blocks.

Gemma-3-270M has 18 layers: 3 with full attention and 15 with a sliding window of 512 tokens
(one KV head of 256 each). A decode worker's first query is at the prompt's end, so it
reserves, and the prefill worker sends, a sliding layer's KV only from the block holding
position P - 511 on; full layers get all P positions. Real router and worker processes, over
shared memory and TCP; greedy output identical to transformers (float32).
"""

from __future__ import annotations

import httpx
import pytest
from conftest import hf_greedy
from serving import Server, start_server, stop_server

from epdserve.models.loader import load_model_info

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # the default --block-size
WINDOW = 512
PROMPT = [(37 * i) % 20000 + 300 for i in range(700)]


def complete(server: Server) -> dict:
    body = {"model": "gemma-3-270m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_timing": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()


def group_metric(server: Server, group: str) -> float:
    name = f'epdserve_kv_transfer_group_bytes_total{{group="{group}"}}'
    lines = httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith(name))


def expected_bytes(spec, num_prompt: int, num_decode_cached: int) -> dict[str, int]:
    """What moves: full layers every position past what decode holds; sliding layers only
    the positions from the first block a query at the prompt's end can see."""
    per_layer_token = 2 * spec.num_kv_heads * spec.head_dim * 4  # K and V, float32
    num_sliding = spec.sliding_windows.count(WINDOW)
    num_full = spec.sliding_windows.count(None)
    first_kept = max(0, num_prompt - WINDOW + 1) // BLOCK_SIZE * BLOCK_SIZE
    full = (num_prompt - num_decode_cached) * num_full * per_layer_token
    sliding = (num_prompt - max(first_kept, num_decode_cached)) * num_sliding * per_layer_token
    return {"full": full, f"sliding{WINDOW}": sliding}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sliding_layers_send_only_the_window(tmp_path, gemma3_gguf, hf_gemma3, transport):
    info = load_model_info(str(gemma3_gguf))
    spec = info.spec
    assert spec.sliding_windows.count(WINDOW) == 15 and spec.sliding_windows.count(None) == 3
    expected_text = info.tokenizer.decode(hf_greedy(hf_gemma3, PROMPT, 8))
    server = start_server(["--model", str(gemma3_gguf), "--dtype", "float32", "--max-model-len", "1024",
                           "--kv-cache-memory", "0.1", "--prefill-workers", "1", "--decode-workers", "1",
                           "--kv-transport", transport], str(tmp_path))
    try:
        first = complete(server)
        timing = first["timing"]
        assert first["choices"][0]["text"] == expected_text
        assert timing["num_decode_cached_tokens"] == 0
        assert timing["kv_bytes_by_group"] == expected_bytes(spec, len(PROMPT), 0)
        assert timing["kv_bytes"] == sum(expected_bytes(spec, len(PROMPT), 0).values())
        per_token = 2 * spec.num_kv_heads * spec.head_dim * 4 * spec.num_layers
        assert timing["kv_bytes"] < len(PROMPT) * per_token  # the whole prompt's KV, as before

        # Again: the decode worker's prefix cache holds the prompt (every group can rebuild
        # it), so only the positions past its last whole block move.
        second = complete(server)
        cached = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert second["timing"]["num_decode_cached_tokens"] == cached
        assert second["timing"]["kv_bytes_by_group"] == expected_bytes(spec, len(PROMPT), cached)
        assert second["choices"][0]["text"] == expected_text

        moved = [expected_bytes(spec, len(PROMPT), 0), expected_bytes(spec, len(PROMPT), cached)]
        for group in ("full", f"sliding{WINDOW}"):
            assert group_metric(server, group) == sum(m[group] for m in moved)
        server.wait_all_blocks_free()
    finally:
        stop_server(server)
