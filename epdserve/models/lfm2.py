"""LFM2 (Liquid AI): short-convolution layers beside grouped-query attention layers.

As in Hugging Face's Lfm2ForCausalLM. ``layer_types`` (or ``full_attn_idxs``) says which
layers attend ("full_attention") and which convolve ("conv"). Per layer::

    h = x + op(operator_norm(x))         op: attention or short convolution
    y = h + w2(silu(w1(.)) * w3(.))      over ffn_norm(h)

Attention: fused q/k/v, a per-head RMSNorm of q and k (``q_layernorm``, ``k_layernorm``),
rotary embedding, paged KV. Short convolution::

    B, C, x = in_proj(h)                 three chunks of hidden_size channels
    y = out_proj(C * conv(B * x))        conv: causal, depthwise, conv_L_cache taps

The convolution keeps the last ``conv_L_cache - 1`` inputs of each request per channel, its
recurrent state (``layers/short_conv.py``); ``ModelSpec.state_shapes`` tells the engine its
shape. The final norm is named ``embedding_norm`` in the checkpoint.

Tensor parallelism: the convolution's channels split like attention heads (in_proj column-
parallel per chunk, the conv and its state by channel, out_proj row-parallel).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epdserve.models.layers.attention import Attention
from epdserve.models.layers.embedding import VocabParallelEmbedding
from epdserve.models.layers.linear import (
    MergedColumnParallelLinear,
    Placement,
    QKVParallelLinear,
    RowParallelLinear,
)
from epdserve.models.layers.norm import QKNorm, RMSNorm
from epdserve.models.layers.rotary import RopeConfig, RotaryEmbedding
from epdserve.models.layers.short_conv import ShortConv
from epdserve.models.llama import CausalLM, GatedMLP, StackedMapping, load_stacked_weights, qkv_attention
from epdserve.models.spec import ModelSpec

LFM2_ROPE_THETA = 1000000.0
CONV_LAYER = "conv"

LFM2_STACKED_PARAMS: StackedMapping = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("qk_norm", "q_layernorm", "q"),
    ("qk_norm", "k_layernorm", "k"),
    ("gate_up_proj", "w1", 0),
    ("gate_up_proj", "w3", 1),
)


def lfm2_layer_types(hf: Mapping[str, Any], num_layers: int) -> list[str]:
    """"full_attention" or "conv" per layer: ``layer_types``, else from ``full_attn_idxs``
    (every layer attends when neither is given, as in Hugging Face's config)."""
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        return list(layer_types)
    attention = hf.get("full_attn_idxs")
    attention = set(range(num_layers)) if attention is None else {int(i) for i in attention}
    return ["full_attention" if i in attention else CONV_LAYER for i in range(num_layers)]


def lfm2_state_shapes(hf: Mapping[str, Any], num_layers: int) -> tuple[tuple[int, int] | None, ...]:
    """Per layer, one request's convolution state (hidden_size channels, conv_L_cache - 1
    inputs), None for an attention layer."""
    width = int(hf.get("conv_L_cache", 3)) - 1
    if width < 0:
        raise ValueError(f"conv_L_cache must be at least 1, got {width + 1}")
    channels = int(hf["hidden_size"])
    return tuple((channels, width) if kind == CONV_LAYER else None
                 for kind in lfm2_layer_types(hf, num_layers))


@dataclass(frozen=True)
class Lfm2Config:
    """Architecture details beyond ``ModelSpec`` for LFM2."""

    intermediate_size: int  # the MLP's, after Hugging Face's auto-adjustment
    norm_eps: float
    rope: RopeConfig
    is_conv_layer: tuple[bool, ...]
    conv_kernel_size: int
    conv_bias: bool = False
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.intermediate_size <= 0 or self.norm_eps <= 0 or self.conv_kernel_size < 1:
            raise ValueError(f"invalid intermediate_size={self.intermediate_size} norm_eps={self.norm_eps} "
                             f"conv_L_cache={self.conv_kernel_size}")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], architecture: str = "lfm2") -> Lfm2Config:
        """From a Hugging Face lfm2 ``config.json`` dict (the original checkpoints' names
        ``block_ff_dim`` and ``tie_embedding`` win, as in Hugging Face's config)."""
        num_layers = int(hf["num_hidden_layers"])
        kinds = lfm2_layer_types(hf, num_layers)
        unknown = sorted(set(kinds) - {"full_attention", CONV_LAYER})
        if unknown:
            raise ValueError(f"unsupported LFM2 layer types {unknown}")
        if "full_attention" not in kinds:  # the engine's KV blocks need one attention layer
            raise ValueError("an LFM2 model without attention layers is not supported")
        rope_params = hf.get("rope_parameters") or hf.get("rope_scaling")
        return cls(
            intermediate_size=_mlp_size(hf),
            norm_eps=float(hf.get("norm_eps", 1e-5)),
            rope=RopeConfig.from_hf(rope_params, float(hf.get("rope_theta", LFM2_ROPE_THETA))),
            is_conv_layer=tuple(kind == CONV_LAYER for kind in kinds),
            conv_kernel_size=int(hf.get("conv_L_cache", 3)),
            conv_bias=bool(hf.get("conv_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_embedding", hf.get("tie_word_embeddings", True))),
        )


def _mlp_size(hf: Mapping[str, Any]) -> int:
    """The MLP width Hugging Face's Lfm2MLP builds: with ``block_auto_adjust_ff_dim``, 2/3 of
    the configured size, scaled by ``block_ffn_dim_multiplier`` and rounded up to a multiple of
    ``block_multiple_of``."""
    size = int(hf.get("block_ff_dim", hf.get("intermediate_size", 12288)))
    if not hf.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        size = int(multiplier * size)
        multiple = int(hf.get("block_multiple_of", 256))
        size = multiple * ((size + multiple - 1) // multiple)
    return size


class Lfm2Attention(nn.Module):
    def __init__(self, spec: ModelSpec, config: Lfm2Config, layer_idx: int, placement: Placement) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, False, **placement.parallel_args
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.out_proj = RowParallelLinear(
            spec.num_heads * spec.head_dim, spec.hidden_size, False, **placement.parallel_args
        )
        self.qk_norm = QKNorm(
            self.num_heads, self.num_kv_heads, spec.head_dim, config.norm_eps, **placement.tensor_args
        )
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, spec.head_dim, scale=spec.head_dim**-0.5, layer_idx=layer_idx
        )

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        return self.out_proj(qkv_attention(self, self.qkv_proj(hidden), cos_sin))


class ChunkedColumnParallelLinear(MergedColumnParallelLinear):
    """A column-parallel projection whose checkpoint tensor stacks several outputs in one
    ([B | C | x] of ``in_proj``): each rank loads its slice of every chunk."""

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is not None:
            super().weight_loader(param, loaded_weight, shard_id)
            return
        for i, chunk in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
            super().weight_loader(param, chunk, i)


class Lfm2ShortConv(nn.Module):
    """The gated short convolution: out_proj(C * conv(B * x))."""

    def __init__(self, spec: ModelSpec, config: Lfm2Config, layer_idx: int, placement: Placement) -> None:
        super().__init__()
        hidden, bias = spec.hidden_size, config.conv_bias
        self.in_proj = ChunkedColumnParallelLinear(hidden, [hidden] * 3, bias, **placement.parallel_args)
        self.conv = ShortConv(hidden, config.conv_kernel_size, bias, layer_idx, **placement.parallel_args)
        self.out_proj = RowParallelLinear(hidden, hidden, bias, **placement.parallel_args)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        return self.out_proj(c * self.conv(b * x))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, config: Lfm2Config, layer_idx: int, placement: Placement) -> None:
        super().__init__()
        self.is_conv = config.is_conv_layer[layer_idx]
        if self.is_conv:
            self.conv = Lfm2ShortConv(spec, config, layer_idx, placement)
        else:
            self.self_attn = Lfm2Attention(spec, config, layer_idx, placement)
        self.feed_forward = GatedMLP(spec.hidden_size, config.intermediate_size, "silu", False, placement)
        eps, tensor_args = config.norm_eps, placement.tensor_args
        self.operator_norm = RMSNorm(spec.hidden_size, eps, **tensor_args)
        self.ffn_norm = RMSNorm(spec.hidden_size, eps, **tensor_args)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous layer's MLP output, the residual stream before it) -> this layer's;
        each residual add is fused into the norm after it (as in Llama)."""
        if residual is None:
            hidden, residual = self.operator_norm(hidden), hidden
        else:
            hidden, residual = self.operator_norm.add_forward(hidden, residual)
        hidden = self.conv(hidden) if self.is_conv else self.self_attn(hidden, cos_sin)
        hidden, residual = self.ffn_norm.add_forward(hidden, residual)
        return self.feed_forward(hidden), residual


class Lfm2Model(nn.Module):
    def __init__(self, spec: ModelSpec, config: Lfm2Config, placement: Placement) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, **placement.parallel_args)
        self.layers = nn.ModuleList(Lfm2DecoderLayer(spec, config, i, placement) for i in range(spec.num_layers))
        self.embedding_norm = RMSNorm(spec.hidden_size, config.norm_eps, **placement.tensor_args)
        self.rotary_emb = RotaryEmbedding(
            spec.head_dim, spec.max_position_embeddings, config.rope, **placement.tensor_args
        )

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos_sin = self.rotary_emb.cos_sin(positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin)
        if residual is None:
            return self.embedding_norm(hidden)
        return self.embedding_norm.add_forward(hidden, residual)[0]


class Lfm2ForCausalLM(CausalLM):
    """LFM2 causal LM over a flat batch of T tokens."""

    decoder_cls = Lfm2Model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full (unsharded) Hugging Face tensors into this rank's parameters."""
        skipped = ("lm_head.",) if self.config.tie_word_embeddings else ()
        load_stacked_weights(self, _our_names(weights), LFM2_STACKED_PARAMS, skipped)


def _our_names(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The MLP's down projection under ``GatedMLP``'s name."""
    for name, tensor in weights:
        yield name.replace(".feed_forward.w2.", ".feed_forward.down_proj."), tensor
