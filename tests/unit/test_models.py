"""Our models and tokenizers against transformers on the two shipped GGUF checkpoints.

Both sides load the same GGUF file: transformers dequantizes it with its own GGUF
integration (the session-scoped ``hf_smollm2`` / ``hf_gemma3`` fixtures of conftest.py), we
through our converter and weight cache. Conversions go to a per-session cache directory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from epdserve.models import LoadedModel, load_model, resolve_model_path
from epdserve.models.tokenizer import GEMMA_CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")

SMOLLM_PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little robot who loved to paint. Every day",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Translate to German: The weather is nice today.",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcödé — 東京タワー 🚀 and numbers 1234567890.",
]
TOKENIZER_TEXTS = [
    "Hello world",
    " leading space and  double  spaces\n\nnew lines\ttab",
    "Ünïcödé — 東京タワー 🚀 naïve café",
    "code: `x = {'a': [1, 2]}`",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there! ¿Qué tal? 😀"},
    {"role": "assistant", "content": "Fine."},
    {"role": "user", "content": "Tell me a joke."},
]


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.getbasetemp() / "epdserve-cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EPDSERVE_CACHE_DIR", str(path))
        yield path


def _reference_tokenizer(name: str):
    path = resolve_model_path(name)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)))
        return loaded.model.compute_logits(hidden)


def _reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def _assert_logits_match(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Elementwise |ours - theirs| <= 2e-3 + 1e-4 |theirs|, and the same argmax everywhere.

    (torch.testing.assert_close does the same in several times the time on [600, 262k].)
    """
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    diff = (ours - theirs).abs_()
    tolerance = theirs.abs().mul_(1e-4).add_(2e-3)
    assert bool((diff <= tolerance).all()), f"max |logit diff| {diff.max().item():.2e}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.fixture(scope="module")
def smollm(cache_dir: Path) -> LoadedModel:
    return load_model(None, torch.float32)


@pytest.fixture(scope="module")
def gemma(cache_dir: Path) -> LoadedModel:
    return load_model("gemma3", torch.float32)


def test_smollm_spec(smollm: LoadedModel) -> None:
    spec = smollm.spec
    assert spec.architecture == "llama"
    assert spec.name == "SmolLM2-135M-Instruct"
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (30, 576, 49152)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert spec.sliding_windows == (None,) * 30
    assert spec.bos_token_id == 1 and spec.eos_token_ids == (2,)
    assert smollm.tokenizer.eos_token_ids == spec.eos_token_ids


def test_smollm_logits_match_transformers(smollm: LoadedModel, hf_smollm2: torch.nn.Module) -> None:
    for prompt in SMOLLM_PROMPTS:
        ids = smollm.tokenizer.encode(prompt)
        _assert_logits_match(_logits(smollm, ids), _reference_logits(hf_smollm2, ids))


def test_input_embeds_replace_embedding(smollm: LoadedModel) -> None:
    ids = torch.tensor(smollm.tokenizer.encode("The capital of France is"))
    positions = torch.arange(len(ids))
    with torch.inference_mode():
        direct = smollm.model(ids, positions)
        via_embeds = smollm.model(torch.zeros_like(ids), positions, smollm.model.embed(ids))
    torch.testing.assert_close(direct, via_embeds)


def test_gemma_spec(gemma: LoadedModel) -> None:
    spec = gemma.spec
    assert spec.architecture == "gemma3"
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (18, 4, 1, 256)
    full_layers = [i for i, window in enumerate(spec.sliding_windows) if window is None]
    assert full_layers == [5, 11, 17]
    assert {window for window in spec.sliding_windows if window is not None} == {512}
    assert spec.bos_token_id == 2
    end_of_turn = gemma.tokenizer.backend.token_to_id("<end_of_turn>")
    assert spec.eos_token_ids == (1, end_of_turn)


def test_gemma_long_prompt_logits_match_transformers(gemma: LoadedModel, hf_gemma3: torch.nn.Module) -> None:
    text = " ".join(
        f"Paragraph {i}: the river bends near the old mill, where {i * 7} ducks rest." for i in range(31)
    )
    ids = gemma.tokenizer.encode(text)
    assert len(ids) > 600  # beyond the 512-token window of the sliding layers
    _assert_logits_match(_logits(gemma, ids), _reference_logits(hf_gemma3, ids))


@pytest.mark.parametrize("name", ["default", "gemma3"])
def test_tokenizer_matches_transformers(name: str, smollm: LoadedModel, gemma: LoadedModel) -> None:
    ours = smollm.tokenizer if name == "default" else gemma.tokenizer
    reference = _reference_tokenizer(name)
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text)
        assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)
    template = reference.chat_template or GEMMA_CHAT_TEMPLATE
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            CHAT,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        assert ours.apply_chat_template(CHAT, add_generation_prompt) == expected


def test_bos_handling(smollm: LoadedModel, gemma: LoadedModel) -> None:
    assert smollm.tokenizer.encode("hi")[0] != smollm.spec.bos_token_id
    gemma_ids = gemma.tokenizer.encode("hi")
    assert gemma_ids[0] == gemma.spec.bos_token_id
    # A rendered Gemma prompt starts with <bos>; encoding it must not double it.
    prompt = gemma.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    prompt_ids = gemma.tokenizer.encode(prompt)
    assert prompt_ids[0] == gemma.spec.bos_token_id != prompt_ids[1]


def test_chat_template_errors_are_value_errors(gemma: LoadedModel) -> None:
    with pytest.raises(ValueError, match="alternate"):
        gemma.tokenizer.apply_chat_template([{"role": "assistant", "content": "hi"}])
