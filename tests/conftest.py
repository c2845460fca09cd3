"""Shared fixtures: engines on the real default models, Hugging Face references, leak checks."""

from __future__ import annotations

import pytest
import torch


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
