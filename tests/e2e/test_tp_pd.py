"""Prefill and decode at different tensor-parallel sizes, served over HTTP: real router, worker
and rank processes, KV re-sharded on the way (``transfer/tp_plan.py``) over shared memory and
TCP. Greedy output identical (float32) to one engine at TP 1; the bytes moved are the plan's
(every head each decode rank takes); every block free and every rank's pool unlinked at the end.

The tiny Llama has four KV heads: TP 1 -> 2 splits them, 2 -> 1 gathers them, 2 -> 4 splits each
prefill rank's two heads over two decode ranks. Gemma-3 has one KV head, replicated on every rank.
"""

from __future__ import annotations

import glob

import httpx
import pytest
from serving import Server, start_server, stop_server

from epdserve.config import EngineArgs
from epdserve.engine.engine import LLMEngine
from epdserve.models.loader import load_model_info
from epdserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[5 + (7 * i) % 900 for i in range(n)] for n in (3, 40, 300)]  # 300: chunks of 256
MAX_TOKENS = 12


def tp1_greedy(model: str, prompts: list[list[int]]) -> list[str]:
    """One engine at TP 1: the texts served P/D at any TP must equal."""
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", kv_cache_memory_gib=0.05, max_model_len=1024,
                                  max_num_batched_tokens=256))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    tokenizer = load_model_info(model).tokenizer
    return [tokenizer.decode(c[0].token_ids) for c in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[str]:
    return tp1_greedy(str(tiny_llama), PROMPTS)


def serve(model: str, prefill_tp: int, decode_tp: int, transport: str, log_dir: str) -> Server:
    return start_server(["--model", model, "--dtype", "float32", "--max-model-len", "1024",
                         "--max-num-batched-tokens", "256", "--kv-cache-memory", "0.05",
                         "--prefill-workers", "1", "--decode-workers", "1",
                         "--cores-per-worker", str(max(prefill_tp, decode_tp)), "--prefill-tp", str(prefill_tp),
                         "--decode-tp", str(decode_tp), "--kv-transport", transport], log_dir)


def rank_pools(pids: list[int]) -> list[str]:
    return [p for pid in pids for p in glob.glob(f"/dev/shm/epdserve-kv-rank-{pid}-*")]


def complete(server: Server, prompt: list[int]) -> dict:
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_timing": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def kv_bytes(num_tokens: int, num_layers: int, sent_heads: int, head_dim: int) -> int:
    """K and V of every layer for every head the decode ranks take, float32."""
    return num_tokens * num_layers * 2 * sent_heads * head_dim * 4


@pytest.mark.parametrize("prefill_tp,decode_tp,transport", [
    (1, 2, "shm"), (2, 1, "shm"), (2, 4, "shm"), (1, 2, "tcp"), (2, 1, "tcp"),
])
def test_prefill_and_decode_at_different_tp_serve_greedy_identical(tmp_path, tiny_llama, expected, prefill_tp,
                                                                   decode_tp, transport):
    server = serve(str(tiny_llama), prefill_tp, decode_tp, transport, str(tmp_path))
    try:
        pids = [w["pid"] for w in server.workers()]
        assert len(rank_pools(pids)) == (prefill_tp - 1) + (decode_tp - 1)
        for prompt, want in zip(PROMPTS, expected):
            response = complete(server, prompt)
            assert response["choices"][0]["text"] == want
            timing = response["timing"]
            # Four KV heads of 8 dims, three layers: every decode rank takes its share once, of the
            # positions the decode worker does not hold (the 300-token prompt shares two blocks
            # with the 40-token one).
            moved = len(prompt) - timing["num_decode_cached_tokens"]
            assert timing["kv_bytes"] == kv_bytes(moved, 3, 4, 8)
            assert timing["kv_bytes_skipped"] == kv_bytes(timing["num_decode_cached_tokens"], 3, 4, 8)
        server.wait_all_blocks_free()
    finally:
        stop_server(server)
    assert rank_pools(pids) == [], "a rank's shared KV pool outlived its worker"


def test_gemma3_replicated_head_prefill_tp2_to_decode_tp1(tmp_path, gemma3_gguf):
    prompt = [2, *[100 + (13 * i) % 5000 for i in range(600)]]  # past the 512-token window
    (want,) = tp1_greedy(str(gemma3_gguf), [prompt])
    server = serve(str(gemma3_gguf), 2, 1, "shm", str(tmp_path))
    try:
        response = complete(server, prompt)
        assert response["choices"][0]["text"] == want
        server.wait_all_blocks_free()
    finally:
        stop_server(server)
