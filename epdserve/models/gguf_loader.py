"""Convert a GGUF file into a Hugging Face-style directory (config, float32 safetensors,
tokenizer) that the rest of the loader reads like any HF checkpoint.

llama.cpp conventions undone here, as transformers' GGUF integration does:
- llama q/k projection rows are permuted for llama.cpp's interleaved rope; un-permute them
  back to the rotate-half layout (other architectures are stored unpermuted);
- Gemma norm weights are stored with the +1 of norm(x) * (1 + w) folded in; subtract it;
- a missing ``output.weight`` means the LM head is tied to ``token_embd.weight``.

The tokenizer is converted with transformers (imported only here, on a cache miss).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from epdserve.models.spec import SUPPORTED_ARCHITECTURES, ModelLoadError

SUPPORTED_QUANT_TYPES = frozenset(
    {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    | {
        GGMLQuantizationType[name]
        for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
    }
)

# Per-layer GGUF tensor name -> HF name under model.layers.N.; "ffn_norm" differs by family.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_gguf(path: Path) -> tuple[GGUFReader, dict[str, Any]]:
    """The reader and its metadata; ModelLoadError for anything but a well-formed file."""
    try:
        reader = GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items()}
        file_size = path.stat().st_size
        for tensor in reader.tensors:
            if tensor.data_offset + tensor.n_bytes > file_size:
                raise ValueError("tensor data past end of file")
    except Exception as exc:  # noqa: BLE001 - the reader fails with IndexError, ValueError, ...
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise ModelLoadError(f"{path} is not a valid GGUF file (truncated or corrupt: {reason})") from None
    return reader, metadata


def hf_config_from_gguf(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """An HF ``config.json`` dict equivalent to the GGUF metadata."""
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    try:
        hidden_size = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        num_layers = int(get("block_count"))
        head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden_size // num_heads)
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        config: dict[str, Any] = {
            "model_type": "gemma3_text" if arch == "gemma3" else arch,
            "hidden_size": hidden_size,
            "intermediate_size": int(get("feed_forward_length")),
            "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
            "head_dim": head_dim,
            "vocab_size": int(get("vocab_size") or len(tokens)),
            "max_position_embeddings": int(get("context_length", 2048)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        }
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"GGUF metadata for {arch!r} is incomplete: {exc}") from None
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ModelLoadError(f"GGUF rope scaling {scaling_type!r} is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError("GGUF rope frequency factors (rope_freqs, Llama 3.1+) are not supported")
    if arch == "qwen2":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "gemma3":
        config["hidden_activation"] = "gelu_pytorch_tanh"
        config["sliding_window"] = int(get("attention.sliding_window", 4096))
        config["rope_local_base_freq"] = 10000.0
        # llama.cpp scales by head_dim, except for the 62-layer (27B) model: hidden / heads.
        config["query_pre_attn_scalar"] = hidden_size // num_heads if num_layers == 62 else head_dim
        config["final_logit_softcapping"] = get("final_logit_softcapping")
    return config


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """HF name of a GGUF tensor, or None when the tensor is not part of the HF model."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    match = _LAYER_NAME.match(gguf_name)
    if match is None:
        return None
    layer, kind, suffix = match.groups()
    table = _GEMMA3_LAYER_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    if kind not in table:
        return None
    return f"model.layers.{layer}.{table[kind]}.{suffix}"


def _unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of q/k rows (inverse of its ``permute``)."""
    rows_per_half = weight.shape[0] // num_heads // 2
    split = weight.reshape(num_heads, rows_per_half, 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def dequantized_tensors(reader: GGUFReader, config: dict[str, Any], arch: str) -> dict[str, torch.Tensor]:
    """All model tensors as float32 with HF names and HF conventions."""
    for tensor in reader.tensors:  # check everything before the slow part
        if tensor.tensor_type not in SUPPORTED_QUANT_TYPES:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name} has unsupported quantization {tensor.tensor_type.name}"
            )
        if hf_tensor_name(tensor.name, arch) is None:
            raise ModelLoadError(f"unexpected GGUF tensor {tensor.name!r} for architecture {arch}")
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, arch)
        weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        expected_shape = tuple(int(dim) for dim in reversed(tensor.shape))
        if weight.shape != expected_shape:
            weight = weight.reshape(expected_shape)
        if arch == "llama" and ".self_attn.q_proj." in name:
            weight = _unpermute_rope_rows(weight, config["num_attention_heads"])
        elif arch == "llama" and ".self_attn.k_proj." in name:
            weight = _unpermute_rope_rows(weight, config["num_key_value_heads"])
        elif arch == "gemma3" and name.endswith("norm.weight"):
            weight = weight - 1.0
        tensors[name] = torch.from_numpy(
            np.ascontiguousarray(weight) if weight.flags.writeable else weight.copy()
        )
    return tensors


def eos_token_ids(metadata: dict[str, Any], tokens: list[str]) -> list[int]:
    """End-of-sequence ids: eos, plus end-of-turn tokens (eot, eom, Gemma's <end_of_turn>)."""
    ids = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    if metadata.get("general.architecture") == "gemma3" and "<end_of_turn>" in tokens:
        ids.append(tokens.index("<end_of_turn>"))
    return list(dict.fromkeys(int(token_id) for token_id in ids if token_id is not None))


def convert_tokenizer(path: Path, metadata: dict[str, Any], out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json, converted by transformers."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    # The generic fast tokenizer builds the same backend as AutoTokenizer without first
    # parsing the whole file again for a model config (seconds for a 262k vocabulary).
    try:
        hf_tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(
            str(path.parent), gguf_file=path.name
        )
    except Exception as exc:  # noqa: BLE001 - an unknown tokenizer type fails in many ways
        raise ModelLoadError(f"cannot convert the tokenizer of {path}: {exc}") from None
    hf_tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {
        key: str(token)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        if (token := getattr(hf_tokenizer, key, None)) is not None
    }
    if metadata.get("tokenizer.ggml.add_bos_token") is not None:
        tokenizer_config["add_bos_token"] = bool(metadata["tokenizer.ggml.add_bos_token"])
    if hf_tokenizer.chat_template:
        tokenizer_config["chat_template"] = hf_tokenizer.chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")


def convert_gguf(path: Path, out_dir: Path) -> None:
    """Write the HF-style conversion of the GGUF file at ``path`` into ``out_dir``."""
    reader, metadata = open_gguf(path)
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = hf_config_from_gguf(metadata, tensor_names)
    arch = metadata["general.architecture"]
    tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos_token_ids(metadata, tokens),
    }
    tensors = dequantized_tensors(reader, config, arch)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (out_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2), encoding="utf-8")
    convert_tokenizer(path, metadata, out_dir)
