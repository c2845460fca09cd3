"""Shared fixtures: engines on the real default models, Hugging Face references, leak checks."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2_gguf) -> Path:
    """A random Llama with 8 query and 4 KV heads (they split over TP 2 and 4), saved as a Hugging
    Face directory with the default model's tokenizer."""
    transformers = pytest.importorskip("transformers")
    from epdserve.models.loader import converted_gguf_dir

    model_dir = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
    tokenizer_dir = converted_gguf_dir(smollm2_gguf)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, model_dir / name)
    return model_dir


LFM2_VOCAB_SIZE = 512
LFM2_LAYER_TYPES = ["conv", "full_attention", "conv", "conv", "full_attention", "conv"]


@pytest.fixture(scope="session")
def tiny_lfm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny random LFM2 (4 short-convolution and 2 attention layers, float32) saved as a Hugging
    Face directory with a word-level tokenizer: (directory, the transformers model)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_dir = tmp_path_factory.mktemp("lfm2") / "tiny-lfm2"
    torch.manual_seed(0)
    config = transformers.Lfm2Config(
        vocab_size=LFM2_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LFM2_LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, layer_types=LFM2_LAYER_TYPES,
        conv_L_cache=3, block_multiple_of=16, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.1,  # wide enough that greedy tokens follow the context, not one token forever
    )
    reference = transformers.Lfm2ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():  # norms start at one; make them matter
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    reference.save_pretrained(model_dir)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, **{f"w{i}": i + 4 for i in range(LFM2_VOCAB_SIZE - 4)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<pad>", "<s>", "</s>", "[UNK]"])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir, reference
