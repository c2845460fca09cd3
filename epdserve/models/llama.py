"""Llama-family decoder (Llama, SmolLM2, Qwen2, Qwen3).

The three differ only in small switches carried by ``LlamaConfig``: Qwen2 adds a bias to
the q/k/v projections, Qwen3 normalises each q and k head (RMSNorm over head_dim) before
the rotary embedding. Per layer::

    h = x + o_proj(attn(rope(qk_norm?(q, k)), v))      q, k, v from one fused qkv matmul
    y = h + down(silu(gate) * up)                      gate, up from one fused matmul

with an RMSNorm before each of the two blocks and one after the last layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epdserve.models.layers import paged_attention_cpu
from epdserve.models.layers.activation import SiluAndMul, get_gated_activation
from epdserve.models.layers.attention import Attention, AttentionMetadata, get_forward_context
from epdserve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from epdserve.models.layers.linear import (
    MergedColumnParallelLinear,
    Placement,
    QKVParallelLinear,
    RowParallelLinear,
)
from epdserve.models.layers.packed_linear import linear_rows
from epdserve.models.layers.norm import QKNorm, RMSNorm
from epdserve.models.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary
from epdserve.models.spec import ModelSpec

# (fused parameter name, checkpoint name, shard id) for the fused projections and norms.
StackedMapping = tuple[tuple[str, str, int | str], ...]

LLAMA_STACKED_PARAMS: StackedMapping = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
    ("qk_norm", "q_norm", "q"),
    ("qk_norm", "k_norm", "k"),
)


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture details beyond ``ModelSpec`` for the Llama family."""

    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.intermediate_size <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(
                f"invalid intermediate_size={self.intermediate_size} rms_norm_eps={self.rms_norm_eps}"
            )

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], architecture: str) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict of model_type llama, qwen2 or qwen3."""
        attention_bias = bool(hf.get("attention_bias", False))
        rope_params = hf.get("rope_parameters") or hf.get("rope_scaling")
        return cls(
            intermediate_size=int(hf["intermediate_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(rope_params, float(hf.get("rope_theta", 10000.0))),
            hidden_act=hf.get("hidden_act", "silu"),
            qkv_bias=True if architecture == "qwen2" else attention_bias,
            o_proj_bias=False if architecture == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=architecture == "qwen3",
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


class LlamaAttention(nn.Module):
    def __init__(self, spec: ModelSpec, config: LlamaConfig, layer_idx: int, placement: Placement) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size,
            spec.head_dim,
            spec.num_heads,
            spec.num_kv_heads,
            config.qkv_bias,
            **placement.parallel_args,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            spec.num_heads * spec.head_dim, spec.hidden_size, config.o_proj_bias, **placement.parallel_args
        )
        self.qk_norm = None
        if config.qk_norm:
            self.qk_norm = QKNorm(
                self.num_heads,
                self.num_kv_heads,
                spec.head_dim,
                config.rms_norm_eps,
                **placement.tensor_args,
            )
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            spec.head_dim,
            scale=spec.head_dim**-0.5,
            layer_idx=layer_idx,
            sliding_window=spec.sliding_windows[layer_idx],
        )

    def forward(self, hidden: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        return self.o_proj(qkv_attention(self, self.qkv_proj(hidden), cos_sin))


def qkv_attention(layer: nn.Module, qkv: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Fused qkv [T, (H + 2 KVH) * D] -> attention output [T, H * D].

    q and k heads are adjacent in ``qkv``, so the optional per-head norm and the rotary
    embedding run once over the [T, H + KVH, D] block (in place in ``qkv`` where the rotary
    kernel runs: q, k and v are then views of it). ``layer`` provides num_heads,
    num_kv_heads, head_dim, qk_norm (module or None) and attn.
    """
    num_tokens = qkv.shape[0]
    num_qk_heads = layer.num_heads + layer.num_kv_heads
    qk = qkv[:, : num_qk_heads * layer.head_dim].view(num_tokens, num_qk_heads, layer.head_dim)
    v = qkv[:, num_qk_heads * layer.head_dim :]
    if layer.qk_norm is not None:
        qk = layer.qk_norm(qk)
    qk = apply_rotary(qk, cos_sin)
    q = qk[:, : layer.num_heads].flatten(1)
    k = qk[:, layer.num_heads :].flatten(1)
    return layer.attn(q, k, v)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one column-parallel matmul."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, placement: Placement
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias, **placement.parallel_args
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, **placement.parallel_args)
        self.act_fn = get_gated_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, config: LlamaConfig, layer_idx: int, placement: Placement) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, config, layer_idx, placement)
        self.mlp = GatedMLP(
            spec.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias, placement
        )
        eps, tensor_args = config.rms_norm_eps, placement.tensor_args
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, **tensor_args)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, **tensor_args)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the previous layer's MLP output, the residual stream before it) -> this layer's.

        The residual add of each block is fused into the norm after it (the first layer's
        input norm has none before it; the model's final norm takes the last layer's).
        """
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder layers between the embeddings and the LM head.

    A step of single-token sequences (a decode step) on the CPU runs all layers in one call of
    the CPU extension (``paged_attention_cpu.decode_layers``: the same operations on the same
    kernels, so the same output, without the per-layer Python that cost a batch-1 step more
    than its attention) where it can: one tensor-parallel rank, the extension built, SwiGLU,
    K/V pages in the model's dtype and no per-layer KV hook. ``fuse_decode = False`` keeps every
    step on the layers' Python.
    """

    fuse_decode = True

    def __init__(self, spec: ModelSpec, config: LlamaConfig, placement: Placement) -> None:
        super().__init__()
        self.tp_size = placement.tp_size
        self.eps = config.rms_norm_eps
        self._fused: _FusedDecoder | None = None
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, **placement.parallel_args
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, config, i, placement) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, config.rms_norm_eps, **placement.tensor_args)
        self.rotary_emb = RotaryEmbedding(
            spec.head_dim, spec.max_position_embeddings, config.rope, **placement.tensor_args
        )

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos_sin = self.rotary_emb.cos_sin(positions)
        meta = get_forward_context()
        if meta is not None and self.fuse_decode:
            fused = self._fused_decode(hidden, cos_sin, meta)
            if fused is not None:
                return fused
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos_sin)
        return self.norm(hidden) if residual is None else self.norm.add_forward(hidden, residual)[0]

    def _fused_params(self) -> _FusedDecoder | None:
        """What ``decode_layers`` takes besides the step's inputs, gathered at the first decode
        step (loading packs the weights before any step; the plain weights keep their values
        either way); None where the layers cannot run fused (an activation other than SwiGLU,
        packed and plain weights mixed, norms of several dtypes)."""
        if self._fused is None:
            self._fused = _FusedDecoder.of(self)
        return self._fused if self._fused.usable else None

    def _fused_decode(
        self, hidden: torch.Tensor, cos_sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The decoder's output for a decode step run in one extension call, or None where the
        step must take the layers' Python (see the class)."""
        batch = meta.num_decode_seqs
        if not (batch and batch == len(meta.query_lens) and meta.on_layer_written is None and self.tp_size == 1
                and hidden.dim() == 2 and hidden.shape[0] == batch and hidden.is_contiguous()
                and hidden.device.type == "cpu" and hidden.dtype in paged_attention_cpu.SUPPORTED_DTYPES
                and cos_sin.dtype == hidden.dtype and paged_attention_cpu.is_available()):
            return None
        fused = self._fused_params()
        if fused is None or fused.dtype != hidden.dtype:
            return None
        caches = [meta.kv_caches[i] for i in fused.layer_idxs]
        if not all(c.dtype == hidden.dtype and c.is_contiguous() for c in caches):
            return None
        return paged_attention_cpu.decode_layers(
            hidden, cos_sin, fused.params, caches, [g.slot_mapping for g in meta.groups],
            [g.block_tables for g in meta.groups], [meta.layer_to_group[i] for i in fused.layer_idxs],
            fused.windows, meta.decode_context_lens, self.norm.weight, fused.num_heads, fused.num_kv_heads,
            fused.head_dim, fused.scale, self.eps, fused.packed, linear_rows(batch, hidden.dtype, fused.packed),
        )


@dataclass
class _FusedDecoder:
    """A ``LlamaModel``'s layers as ``paged_attention_cpu.decode_layers`` takes them."""

    usable: bool
    packed: bool
    dtype: torch.dtype  # of the norms' weights (the kernels take one dtype)
    params: list[torch.Tensor]
    layer_idxs: list[int]
    windows: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float

    @classmethod
    def of(cls, model: LlamaModel) -> _FusedDecoder:
        layers = list(model.layers)
        linears = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        packed = {m.packed_weight is not None for m in linears}
        norms = [model.norm.weight] + [w for layer in layers for w in (
            layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
            *((layer.self_attn.qk_norm.weight,) if layer.self_attn.qk_norm is not None else ()))]
        dtype = model.norm.weight.dtype
        usable = (len(packed) == 1 and all(isinstance(layer.mlp.act_fn, SiluAndMul) for layer in layers)
                  and all(w.dtype == dtype for w in norms))
        none = torch.empty(0)

        def weights(m: nn.Module) -> list[torch.Tensor]:
            w = m.packed_weight if m.packed_weight is not None else m.weight
            return [w, m.bias if m.bias is not None else none]

        params: list[torch.Tensor] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            params += [layer.input_layernorm.weight, *weights(attn.qkv_proj),
                       attn.qk_norm.weight if attn.qk_norm is not None else none, *weights(attn.o_proj),
                       layer.post_attention_layernorm.weight, *weights(mlp.gate_up_proj), *weights(mlp.down_proj)]
        assert len(params) == paged_attention_cpu.DECODE_LAYER_PARAMS * len(layers)
        attns = [layer.self_attn.attn for layer in layers]
        return cls(usable, packed == {True}, dtype, params,
                   [a.layer_idx for a in attns], [a.sliding_window or 0 for a in attns], attns[0].num_heads,
                   attns[0].num_kv_heads, attns[0].head_dim, attns[0].scale)


class CausalLM(nn.Module):
    """A decoder and its LM head over a flat batch of T tokens. Subclasses name the decoder
    (``decoder_cls``, built from the spec, config and placement) and load their checkpoint."""

    decoder_cls: type[nn.Module]

    def __init__(
        self,
        spec: ModelSpec,
        config: Any,
        tp_rank: int = 0,
        tp_size: int = 1,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.config = config
        placement = Placement(tp_rank, tp_size, dtype, device)
        self.model = self.decoder_cls(spec, config, placement)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, **placement.parallel_args)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 -> token embeddings [T, hidden]."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, hidden].

        ``input_embeds`` [T, hidden], where given, is used instead of embedding input_ids
        (as ``embed`` returns them).
        """
        hidden = self.embed(input_ids) if input_embeds is None else input_embeds
        return self.model(hidden, positions)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab]: float32, or with ``float32=False`` in the
        model's dtype (enough for an argmax: the cast is exact)."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits


class LlamaForCausalLM(CausalLM):
    """Llama / Qwen2 / Qwen3 causal LM over a flat batch of T tokens."""

    decoder_cls = LlamaModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full (unsharded) Hugging Face tensors into this rank's parameters."""
        skipped = ("lm_head.",) if self.config.tie_word_embeddings else ()
        load_stacked_weights(self, weights, LLAMA_STACKED_PARAMS, skipped)


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: StackedMapping,
    skipped_prefixes: tuple[str, ...] = (),
) -> None:
    """Load HF-named tensors, routing q/k/v and gate/up pieces into their fused parameters.

    Every parameter must receive all its pieces; a missing or unknown tensor raises
    ValueError (a silently uninitialised weight would produce garbage text).
    """
    params = dict(model.named_parameters())
    num_pieces = {name: 1 for name in params}
    for fused_name, _, _ in stacked_params:
        pieces = sum(1 for fused, _, _ in stacked_params if fused == fused_name)
        for name in params:
            if f".{fused_name}." in name:
                num_pieces[name] = pieces
    loaded: dict[str, int] = {}
    for name, tensor in weights:
        if name.startswith(skipped_prefixes) or name.endswith("rotary_emb.inv_freq"):
            continue
        target, shard_id = name, None
        for fused_name, piece_name, piece_id in stacked_params:
            if f".{piece_name}." in name:
                target, shard_id = name.replace(f".{piece_name}.", f".{fused_name}."), piece_id
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
        param.weight_loader(param, tensor, shard_id)
        loaded[target] = loaded.get(target, 0) + 1
    missing = sorted(name for name, count in num_pieces.items() if loaded.get(name, 0) < count)
    if missing:
        shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise ValueError(f"checkpoint lacks {len(missing)} tensors: {shown}")
