"""Gemma 3 text decoder (hybrid sliding-window / full attention).

Differences from Llama, all as in Hugging Face's Gemma3ForCausalLM:
- token embeddings are scaled by sqrt(hidden_size), the factor rounded to the model dtype;
- RMSNorm computes norm(x) * (1 + w); four norms per layer (input, post-attention,
  pre-feedforward, post-feedforward) plus per-head q/k norms;
- attention scale is query_pre_attn_scalar ** -0.5;
- sliding layers use RoPE ``rope_local`` (base 10000), full layers ``rope_global``;
- MLP activation is gelu with the tanh approximation; logits may be tanh-softcapped.

Per layer::

    h = x + post_attn_norm(attn(input_norm(x)))
    y = h + post_ffw_norm(mlp(pre_ffw_norm(h)))
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epdserve.models.layers.attention import Attention
from epdserve.models.layers.embedding import VocabParallelEmbedding
from epdserve.models.layers.linear import Placement, QKVParallelLinear, RowParallelLinear
from epdserve.models.layers.norm import GemmaQKNorm, GemmaRMSNorm
from epdserve.models.layers.rotary import RopeConfig, RotaryEmbedding
from epdserve.models.llama import LLAMA_STACKED_PARAMS, CausalLM, GatedMLP, load_stacked_weights, qkv_attention
from epdserve.models.spec import ModelSpec

GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_GLOBAL_ROPE_THETA = 1000000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # default layer_types: every 6th layer is full attention

# Prefixes of the text decoder inside multimodal Gemma3ForConditionalGeneration checkpoints.
_MULTIMODAL_TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
_MULTIMODAL_SKIPPED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


@dataclass(frozen=True)
class Gemma3Config:
    """Architecture details beyond ``ModelSpec`` for Gemma 3."""

    intermediate_size: int
    rms_norm_eps: float
    rope_global: RopeConfig
    rope_local: RopeConfig
    query_pre_attn_scalar: float
    hidden_act: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.query_pre_attn_scalar <= 0:
            raise ValueError(f"invalid query_pre_attn_scalar={self.query_pre_attn_scalar}")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], architecture: str = "gemma3") -> Gemma3Config:
        """From a Hugging Face gemma3_text ``config.json`` dict (old or rope_parameters style)."""
        if hf.get("attn_logit_softcapping") is not None:
            raise ValueError("attention logit softcapping is not supported")
        rope_params = hf.get("rope_parameters") or {}
        if "full_attention" in rope_params or "sliding_attention" in rope_params:
            global_params = rope_params.get("full_attention")
            local_params = rope_params.get("sliding_attention")
        else:
            global_params = hf.get("rope_scaling")
            local_params = None
        return cls(
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_global=RopeConfig.from_hf(
                global_params, float(hf.get("rope_theta", GEMMA3_GLOBAL_ROPE_THETA))
            ),
            rope_local=RopeConfig.from_hf(
                local_params, float(hf.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA))
            ),
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
            attention_bias=bool(hf.get("attention_bias", False)),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        )


class Gemma3Attention(nn.Module):
    def __init__(self, spec: ModelSpec, config: Gemma3Config, layer_idx: int, placement: Placement) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size,
            spec.head_dim,
            spec.num_heads,
            spec.num_kv_heads,
            config.attention_bias,
            **placement.parallel_args,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            spec.num_heads * spec.head_dim, spec.hidden_size, config.attention_bias, **placement.parallel_args
        )
        self.qk_norm = GemmaQKNorm(
            self.num_heads, self.num_kv_heads, spec.head_dim, config.rms_norm_eps, **placement.tensor_args
        )
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            spec.head_dim,
            scale=config.query_pre_attn_scalar**-0.5,
            layer_idx=layer_idx,
            sliding_window=spec.sliding_windows[layer_idx],
        )

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        return self.o_proj(qkv_attention(self, self.qkv_proj(hidden), cos_sin))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, config: Gemma3Config, layer_idx: int, placement: Placement) -> None:
        super().__init__()
        self.is_sliding = spec.sliding_windows[layer_idx] is not None
        self.self_attn = Gemma3Attention(spec, config, layer_idx, placement)
        self.mlp = GatedMLP(spec.hidden_size, config.intermediate_size, config.hidden_act, False, placement)
        norm_args = (spec.hidden_size, config.rms_norm_eps)
        self.input_layernorm = GemmaRMSNorm(*norm_args, **placement.tensor_args)
        self.post_attention_layernorm = GemmaRMSNorm(*norm_args, **placement.tensor_args)
        self.pre_feedforward_layernorm = GemmaRMSNorm(*norm_args, **placement.tensor_args)
        self.post_feedforward_layernorm = GemmaRMSNorm(*norm_args, **placement.tensor_args)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous layer's normed MLP output, the residual stream before it) -> this
        layer's; each residual add is fused into the norm that follows it (as in Llama)."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attn_out = self.post_attention_layernorm(self.self_attn(normed, cos_sin))
        normed, residual = self.pre_feedforward_layernorm.add_forward(attn_out, residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


class Gemma3Model(nn.Module):
    def __init__(self, spec: ModelSpec, config: Gemma3Config, placement: Placement) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, **placement.parallel_args
        )
        # HF multiplies by a 0-dim tensor of the weight's dtype: round the factor the same way.
        self.embed_scale = float(torch.tensor(math.sqrt(spec.hidden_size), dtype=placement.dtype))
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(spec, config, i, placement) for i in range(spec.num_layers)
        )
        self.norm = GemmaRMSNorm(spec.hidden_size, config.rms_norm_eps, **placement.tensor_args)
        rope_args = (spec.head_dim, spec.max_position_embeddings)
        self.rotary_emb_global = RotaryEmbedding(*rope_args, config.rope_global, **placement.tensor_args)
        self.rotary_emb_local = RotaryEmbedding(*rope_args, config.rope_local, **placement.tensor_args)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos_sin_global = self.rotary_emb_global.cos_sin(positions)
        cos_sin_local = self.rotary_emb_local.cos_sin(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin_local if layer.is_sliding else cos_sin_global)
        return self.norm(hidden) if residual is None else self.norm.add_forward(hidden, residual)[0]


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 causal LM (text) over a flat batch of T tokens."""

    decoder_cls = Gemma3Model

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> scaled token embeddings [T, hidden] (``forward``'s
        ``input_embeds`` are taken as already scaled for text tokens)."""
        return self.model.embed_tokens(input_ids).mul_(self.model.embed_scale)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (softcapped where configured; with
        ``float32=False`` and no softcap, in the model's dtype, as in Llama)."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if float32 or cap is not None:
            logits = logits.float()
        if cap is not None:
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full Hugging Face tensors (text-only or multimodal names) into this rank."""
        skipped = _MULTIMODAL_SKIPPED_PREFIXES
        if self.config.tie_word_embeddings:
            skipped = skipped + ("lm_head.",)
        load_stacked_weights(self, _text_decoder_names(weights), LLAMA_STACKED_PARAMS, skipped)


def _text_decoder_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename a multimodal checkpoint's text-decoder tensors to text-only names."""
    for name, tensor in weights:
        for prefix in _MULTIMODAL_TEXT_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix) :]
                break
        yield name, tensor
