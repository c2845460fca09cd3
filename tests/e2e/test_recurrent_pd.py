"""A hybrid recurrent model (LFM2: short convolutions beside attention) served P/D: the prefill
worker sends each request's conv state into the decode worker's state slot with the attention
KV, over shared memory and TCP. Real router and worker processes; greedy output identical to
transformers (float32); every block and state slot free at the end, on both workers, after
finished and aborted requests alike."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import LFM2_LAYER_TYPES
from serving import Server, start_server, stop_server

from epdserve.models.loader import load_model_info

pytestmark = pytest.mark.slow

NUM_TOKENS = 12
PROMPTS = [[4 + (37 * i + 11 * n) % 500 for i in range(n)] for n in (1, 9, 70)]


def transformers_greedy(reference, prompt: list[int]) -> list[int]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                                           eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def complete(server: Server, prompt: list[int], **extra) -> httpx.Response:
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_timing": True, **extra}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_lfm2_served_pd_matches_transformers_and_frees_every_slot(tmp_path, tiny_lfm2, transport):
    model_dir, reference = tiny_lfm2
    tokenizer = load_model_info(str(model_dir)).tokenizer
    server = start_server(["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "256",
                           "--max-num-batched-tokens", "32", "--num-kv-blocks", "128", "--max-num-seqs", "8",
                           "--prefill-workers", "1", "--decode-workers", "1", "--kv-transport", transport],
                          str(tmp_path))
    try:
        num_conv = LFM2_LAYER_TYPES.count("conv")
        num_attn = len(LFM2_LAYER_TYPES) - num_conv
        for prompt in PROMPTS:  # 70 tokens: three prefill chunks, the state carried between them
            r = complete(server, prompt)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["text"] == tokenizer.decode(transformers_greedy(reference, prompt))
            timing = body["timing"]
            # The state: 64 channels x (kernel 3 - 1) per conv layer, float32, once per request;
            # the attention KV: 2 KV heads of 16 dims per attention layer per prompt position.
            assert timing["kv_bytes_by_group"] == {"full": len(prompt) * num_attn * 2 * 2 * 16 * 4,
                                                   "state": num_conv * 64 * 2 * 4}
        # Eight at once: one state slot each on both workers, batched decode steps.
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda p: complete(server, p), [PROMPTS[i % 3] for i in range(8)]))
        assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses if r.status_code != 200]
        texts = {tuple(p): tokenizer.decode(transformers_greedy(reference, p)) for p in PROMPTS}
        assert [r.json()["choices"][0]["text"] for r in responses] == [texts[tuple(PROMPTS[i % 3])] for i in range(8)]
        # An aborted stream gives its slots back too.
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
                "model": httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"], "prompt": PROMPTS[2],
                "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}) as stream:
            for _ in stream.iter_lines():
                break
        server.wait_all_blocks_free(timeout_s=30)
    finally:
        stop_server(server)
