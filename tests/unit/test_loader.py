"""Loading Hugging Face directories and GGUF files, the weight cache, and load errors."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from epdserve.models import ModelLoadError, gguf_loader, load_model, resolve_model_path, weight_cache
from epdserve.models.loader import converted_gguf_dir, served_name

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 49152  # the SmolLM2 tokenizer's, saved next to the tiny models


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.getbasetemp() / "epdserve-cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EPDSERVE_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return resolve_model_path(None)


@pytest.fixture(scope="module")
def tokenizer_files(cache_dir: Path, default_gguf: Path) -> Path:
    """Directory holding the converted SmolLM2 tokenizer.json / tokenizer_config.json."""
    return converted_gguf_dir(default_gguf)


def _tiny_hf_config(model_type: str) -> transformers.PretrainedConfig:
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if model_type == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=5000.0)
    if model_type == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=False)
    if model_type == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    return transformers.Gemma3TextConfig(
        **common,
        head_dim=32,
        sliding_window=5,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )


def _save_tiny_model(model_type: str, model_dir: Path, tokenizer_files: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    config = _tiny_hf_config(model_type)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # Gemma norms start at zero; make them matter
        for name, param in reference.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)
    reference.save_pretrained(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_files / name, model_dir / name)
    return reference


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_tiny_hf_directory_matches_transformers(
    model_type: str, tmp_path: Path, tokenizer_files: Path
) -> None:
    reference = _save_tiny_model(model_type, tmp_path / "tiny", tokenizer_files)
    loaded = load_model(str(tmp_path / "tiny"), torch.float32)
    assert loaded.spec.name == "tiny"
    assert loaded.spec.eos_token_ids == (2,)
    assert loaded.tokenizer.encode("hello") == [28120]
    ids = torch.randint(0, VOCAB_SIZE, (12,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))
        theirs = reference(ids[None]).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    if model_type == "gemma3_text":
        assert loaded.spec.sliding_windows == (5, None, 5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_decode_steps_in_one_kernel_call_decode_as_the_layers_do(
    model_type: str, dtype: str, tmp_path: Path, tokenizer_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Llama-family decode step run by the CPU extension's decode_layers (plain, with a qkv
    bias, with per-head q/k norms; bf16 weights packed for oneDNN, float32 plain) gives the same
    tokens and log-probabilities as the layers' Python, including a batch above the exact-row
    limit of the packed matmuls (70 sequences)."""
    from epdserve.config import EngineArgs
    from epdserve.engine.engine import LLMEngine
    from epdserve.models.layers import paged_attention_cpu
    from epdserve.models.llama import LlamaModel
    from epdserve.sampling import SamplingParams

    if not paged_attention_cpu.is_available():
        pytest.skip("the CPU extension could not be built here")
    _save_tiny_model(model_type, tmp_path / "tiny", tokenizer_files)
    engine = LLMEngine(EngineArgs(model=str(tmp_path / "tiny"), dtype=dtype, kv_cache_memory_gib=0.05,
                                  enable_prefix_caching=False))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB_SIZE, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 40, (70,), generator=gen)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    fused_calls = []
    kernel = paged_attention_cpu.decode_layers
    monkeypatch.setattr(paged_attention_cpu, "decode_layers", lambda *a: fused_calls.append(a[0].shape[0]) or kernel(*a))

    def run() -> list[tuple[list[int], list]]:
        return [(c.token_ids, c.logprobs) for (c,) in engine.generate(prompts, params)]

    fused = run()
    assert 70 in fused_calls, f"decode steps of the whole batch did not run fused: {fused_calls}"
    monkeypatch.setattr(LlamaModel, "fuse_decode", False)
    fused_calls.clear()
    layer_by_layer = run()
    assert not fused_calls
    assert fused == layer_by_layer


def test_bfloat16_load_runs(tmp_path: Path, tokenizer_files: Path) -> None:
    _save_tiny_model("qwen3", tmp_path / "tiny", tokenizer_files)
    loaded = load_model(str(tmp_path / "tiny"), torch.bfloat16, torch.device("cpu"))
    assert all(param.dtype == torch.bfloat16 for param in loaded.model.parameters())
    with torch.inference_mode():
        logits = loaded.model.compute_logits(loaded.model(torch.arange(5), torch.arange(5)))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_gguf_conversion_is_cached(
    default_gguf: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = load_model(str(default_gguf), torch.float32)
    entry = weight_cache.lookup(default_gguf)
    assert entry is not None and entry.parent.parent == cache_dir
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(entry))
    config_file = entry / "tokenizer_config.json"
    original = config_file.read_bytes()
    config_file.write_bytes(original[:-1])  # a torn write: the entry no longer counts
    assert weight_cache.lookup(default_gguf) is None
    config_file.write_bytes(original)
    assert weight_cache.lookup(default_gguf) == entry

    def forbidden(*args: object) -> None:
        raise AssertionError("a cached model must not be converted again")

    monkeypatch.setattr(gguf_loader, "dequantize", forbidden)
    monkeypatch.setattr(gguf_loader, "convert_tokenizer", forbidden)
    second = load_model(str(default_gguf), torch.float32)
    ids = torch.tensor(first.tokenizer.encode("The capital of France is"))
    with torch.inference_mode():
        hidden_first = first.model(ids, torch.arange(len(ids)))
        hidden_second = second.model(ids, torch.arange(len(ids)))
    assert torch.equal(hidden_first, hidden_second)


def test_failed_conversion_leaves_no_cache_entry(
    default_gguf: Path, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "copy.Q4_1.gguf"
    shutil.copy(default_gguf, copy)

    class Crash(Exception):
        pass

    def crash(*args: object) -> None:
        raise Crash

    monkeypatch.setattr(gguf_loader, "dequantize", crash)
    with pytest.raises(Crash):
        load_model(str(copy), torch.float32)
    assert weight_cache.lookup(copy) is None
    assert not weight_cache.entry_dir(copy).exists()
    assert not [name for name in os.listdir(cache_dir / "models") if name.startswith(".tmp-")]


def _assert_one_line_load_error(model: str, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match) as excinfo:
        load_model(model, torch.float32)
    assert "\n" not in str(excinfo.value)


def test_unknown_path(tmp_path: Path) -> None:
    _assert_one_line_load_error(str(tmp_path / "nope"), "does not exist")


def test_directory_without_config(tmp_path: Path) -> None:
    _assert_one_line_load_error(str(tmp_path), "no config.json")


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _assert_one_line_load_error(str(tmp_path), "unsupported model_type 'gpt2'")


def test_directory_without_weights(tmp_path: Path, tokenizer_files: Path) -> None:
    _tiny_hf_config("llama").save_pretrained(tmp_path)
    shutil.copy(tokenizer_files / "tokenizer.json", tmp_path / "tokenizer.json")
    _assert_one_line_load_error(str(tmp_path), "no \\*.safetensors")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    _assert_one_line_load_error(str(tmp_path / "weights.bin"), "neither a .gguf file")


@pytest.mark.parametrize("num_bytes", [0, 100, 3_000_000, 98_000_000])
def test_truncated_gguf(num_bytes: int, default_gguf: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with default_gguf.open("rb") as source:
        truncated.write_bytes(source.read(num_bytes))
    _assert_one_line_load_error(str(truncated), "not a valid GGUF file")


def test_random_bytes_gguf(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(os.urandom(200_000))
    _assert_one_line_load_error(str(garbage), "not a valid GGUF file")
    garbage.write_bytes(b"GGUF" + os.urandom(200_000))
    _assert_one_line_load_error(str(garbage), "not a valid GGUF file")


def test_served_name_strips_quantization() -> None:
    assert served_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert served_name(Path("gemma-3-270m-q4_k_m.gguf")) == "gemma-3-270m"
    assert served_name(Path("model.gguf")) == "model"


def test_unwritable_cache_dir(default_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("EPDSERVE_CACHE_DIR", str(blocker))
    _assert_one_line_load_error(str(default_gguf), "cannot convert .* into the weight cache")
