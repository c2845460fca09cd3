"""Supported architectures: from a Hugging Face config dict to a constructed model.

Both checkpoint formats end here: a GGUF file is first converted to the same HF-style
``config.json`` (see ``gguf_loader``), so one parser serves both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epdserve.models.gemma3 import GEMMA3_SLIDING_WINDOW_PATTERN, Gemma3Config, Gemma3ForCausalLM
from epdserve.models.lfm2 import Lfm2Config, Lfm2ForCausalLM, lfm2_layer_types, lfm2_state_shapes
from epdserve.models.llama import LlamaConfig, LlamaForCausalLM
from epdserve.models.spec import ModelLoadError, ModelSpec

# HF config.json model_type -> our architecture name.
_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "lfm2": "lfm2",
}

_MODEL_CLASSES: dict[str, tuple[type[nn.Module], Any]] = {
    "llama": (LlamaForCausalLM, LlamaConfig),
    "qwen2": (LlamaForCausalLM, LlamaConfig),
    "qwen3": (LlamaForCausalLM, LlamaConfig),
    "gemma3": (Gemma3ForCausalLM, Gemma3Config),
    "lfm2": (Lfm2ForCausalLM, Lfm2Config),
}


@dataclass(frozen=True)
class ModelBlueprint:
    """Everything needed to construct a model; ``config`` is the architecture's own dataclass."""

    spec: ModelSpec
    config: LlamaConfig | Gemma3Config | Lfm2Config
    model_cls: type[nn.Module]

    def create(
        self,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> nn.Module:
        """An uninitialised model (parameters allocated, not filled) on ``device``."""
        return self.model_cls(self.spec, self.config, tp_rank, tp_size, dtype=dtype, device=device)


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's config: ``text_config`` of a multimodal Gemma 3 or Idefics3 (SmolVLM)
    config, else ``hf``."""
    if hf.get("model_type") == "gemma3" and isinstance(hf.get("text_config"), Mapping):
        merged = dict(hf["text_config"])
        merged.setdefault("model_type", "gemma3_text")
        return merged
    if hf.get("model_type") == "idefics3" and isinstance(hf.get("text_config"), Mapping):
        merged = dict(hf["text_config"])
        merged.setdefault("model_type", "llama")
        # Idefics3ForConditionalGeneration ties lm_head by the top-level flag.
        merged["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
        return merged
    return dict(hf)


# Checkpoint name prefix of the decoder in a multimodal model_type, and prefixes of the
# tensors the decoder does not hold (vision tower, connector).
_TEXT_PREFIXES = {"idefics3": ("model.text_model.", ("model.vision_model.", "model.connector."))}


def text_weights(
    hf: Mapping[str, Any], weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The decoder's tensors under its own names: for idefics3 ``model.text_model.X`` ->
    ``model.X``, vision and connector tensors skipped; other model types unchanged."""
    if hf.get("model_type") not in _TEXT_PREFIXES:
        yield from weights
        return
    text_prefix, skipped = _TEXT_PREFIXES[hf["model_type"]]
    for name, tensor in weights:
        if name.startswith(skipped):
            continue
        if name.startswith(text_prefix):
            name = "model." + name[len(text_prefix) :]
        yield name, tensor


def architecture_of(hf: Mapping[str, Any]) -> str:
    model_type = hf.get("model_type")
    if model_type not in _MODEL_TYPES:
        supported = ", ".join(sorted(_MODEL_TYPES))
        raise ModelLoadError(f"unsupported model_type {model_type!r} (supported: {supported})")
    return _MODEL_TYPES[model_type]


def sliding_windows(hf: Mapping[str, Any], architecture: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer window in tokens, None for full attention (and for a layer that does not
    attend), following HF's ``layer_types``."""
    layer_types = lfm2_layer_types(hf, num_layers) if architecture == "lfm2" else hf.get("layer_types")
    if layer_types is None:
        if architecture == "gemma3":
            pattern = int(hf.get("sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN))
            layer_types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
            ]
        elif hf.get("use_sliding_window"):
            first_sliding = int(hf.get("max_window_layers", num_layers))
            layer_types = [
                "sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)
            ]
        else:
            layer_types = ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ModelLoadError(f"config has {len(layer_types)} layer_types for {num_layers} layers")
    window = hf.get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise ModelLoadError("config has sliding-window layers but no sliding_window")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)


def state_shapes(hf: Mapping[str, Any], architecture: str, num_layers: int) -> tuple[tuple[int, ...] | None, ...]:
    """Per layer, the recurrent state one request keeps (``ModelSpec.state_shapes``); empty
    for architectures whose layers all attend."""
    return lfm2_state_shapes(hf, num_layers) if architecture == "lfm2" else ()


def build_blueprint(
    hf_config: Mapping[str, Any],
    name: str,
    bos_token_id: int | None,
    eos_token_ids: tuple[int, ...],
) -> ModelBlueprint:
    """Parse an HF ``config.json`` dict; raises ModelLoadError for what we cannot run."""
    hf = text_config(hf_config)
    architecture = architecture_of(hf)
    model_cls, config_cls = _MODEL_CLASSES[architecture]
    try:
        num_layers = int(hf["num_hidden_layers"])
        hidden_size = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        spec = ModelSpec(
            architecture=architecture,
            name=name,
            num_layers=num_layers,
            hidden_size=hidden_size,
            vocab_size=int(hf["vocab_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            sliding_windows=sliding_windows(hf, architecture, num_layers),
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            state_shapes=state_shapes(hf, architecture, num_layers),
        )
        config = config_cls.from_hf(hf, architecture)
    except KeyError as exc:
        raise ModelLoadError(f"model config lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"invalid model config: {exc}") from None
    return ModelBlueprint(spec=spec, config=config, model_cls=model_cls)
