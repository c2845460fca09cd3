"""Shared fixtures: engines on the real default models, Hugging Face references, leak checks."""

from __future__ import annotations

import socket
import time

import pytest
import torch

# Short English and code prompts shared by the engine-level tests.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
    "List three primary colors:",
    "The quick brown fox",
    "In 1969, astronauts",
    "import numpy as np\n",
    "My favourite food is",
    "Translate to French: good morning",
    "The meaning of life is",
    "Photosynthesis converts",
    "A haiku about the sea:",
    "SELECT * FROM users WHERE",
    "The largest planet in our solar system",
    "To be or not to be,",
]


def assert_all_blocks_free(engine) -> None:
    """The one leak check: nothing queued or running, every KV block back in its pool."""
    assert not engine.scheduler.has_unfinished(), "requests still queued or running"
    assert engine.kv_cache.is_all_free(), "KV blocks still referenced"


def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy decoding with a Hugging Face model, EOS ignored (the reference)."""
    out = []
    with torch.inference_mode():
        res = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(num_tokens):
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            res = model(torch.tensor([[token]]), past_key_values=res.past_key_values, use_cache=True)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf():
    from epdserve.models.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def gemma3_gguf():
    from epdserve.models.loader import resolve_model_path

    return resolve_model_path("gemma3")


def _hf_model(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    return _hf_model(smollm2_gguf)


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_gguf):
    return _hf_model(gemma3_gguf)


def closed_by_peer(sock: socket.socket, timeout_s: float = 10.0) -> bool:
    """Whether the peer closed ``sock`` within ``timeout_s`` (reads drain what it sent)."""
    deadline = time.monotonic() + timeout_s
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            sock.settimeout(remaining)
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False
