"""Vision tower + connector of an Idefics3 / SmolVLM model: tiles in, text-space rows out.

    pixels [T, 3, S, S] -> Conv2d patch embedding (P x P, stride P, bias) + learned positions
      -> L x pre-LN encoder layer:  h += out_proj(MHA(LN1(h)))     bidirectional attention
                                    h += fc2(gelu_tanh(fc1(LN2(h))))
      -> post_layernorm -> pixel shuffle (s) -> modality_projection.proj (no bias)
      -> [T * (S/P)^2 / s^2, text_hidden] rows, tile-major (all rows of tile 0, then tile 1 ...)

Pixel shuffle regroups each tile's N = (S/P)^2 patch vectors of width D into N / s^2
vectors of width D * s^2 exactly as HF's ``Idefics3Connector.pixel_shuffle``.

Default tower (``VisionConfig()`` / ``named("default")``, the "cost-balanced" tower):
image 512, patch 16, hidden 384, 8 layers, 6 heads, MLP 1536, scale 2 -> 256 tokens per
tile, for SmolLM2-135M (text hidden 576). By ``encoder_flops_per_tile`` and
``decoder_prefill_flops`` (2 FLOPs per multiply-add, causal attention counted over the
visible keys only):

    default tower (15.8M parameters), one 512x512 tile  42.9 GFLOP (30.0 matmul, 12.9 attention)
    SmolLM2-135M prefill of its 256 tokens              56.6 GFLOP (54.4 matmul)
    -> encode ~ 0.55x the prefill in matmul FLOPs, 0.76x with attention

On a CPU the time ratio is higher than the FLOP ratio: bidirectional attention over 1024
patches runs through the CPU flash-attention kernel at about a fifth of the matmul rate.
One bf16 thread: encode 225 ms per tile, SmolLM2-135M forward over 256 tokens 190 ms.

That is the proportion of production VLMs, where the tower is a fraction of the LM's cost
for the image's tokens (Qwen2-VL-7B: a 0.6B ViT in front of a 7B LM). The real
SmolVLM-256M tower (93.5M parameters: hidden 768, 12 layers, 12 heads, MLP 3072, scale 4
-> 64 tokens per tile) is the opposite case:

    smolvlm-256m tower, one tile                       214.7 GFLOP (176.1 matmul)
    SmolLM2-135M prefill of its 64 tokens               13.7 GFLOP
    -> encode ~ 16x the prefill (13x in matmul FLOPs)

``named("smolvlm-256m")`` builds that shape (randomly initialised) for cost comparisons.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.errors import ConfigError
from epdserve.models.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear
from epdserve.models.layers.packed_linear import prepack_model
from epdserve.models.spec import ModelLoadError, ModelSpec

_GELU_APPROXIMATION = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}
INIT_STD = 0.02  # std of the normal init of every weight matrix, embedding and position table


@dataclass(frozen=True)
class VisionConfig:
    """Shape of the vision tower and connector. Sizes in pixels (image, patch) or features."""

    image_size: int = 512  # tile side
    patch_size: int = 16
    hidden_size: int = 384
    num_layers: int = 8
    num_heads: int = 6
    intermediate_size: int = 1536
    layer_norm_eps: float = 1e-6
    scale_factor: int = 2  # pixel-shuffle factor s: s^2 patches -> one token
    text_hidden_size: int = 576
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        sizes = ("image_size", "patch_size", "hidden_size", "num_layers", "num_heads",
                 "intermediate_size", "scale_factor", "text_hidden_size")  # fmt: skip
        for name in sizes:
            if getattr(self, name) <= 0:
                raise ConfigError(f"vision config has {name}={getattr(self, name)}")
        if self.image_size % self.patch_size:
            raise ConfigError(
                f"image_size={self.image_size} is not a multiple of patch_size={self.patch_size}"
            )
        if self.patches_per_side % self.scale_factor:
            raise ConfigError(
                f"{self.patches_per_side} patches per side is not a multiple of scale_factor={self.scale_factor}"
            )
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        if self.hidden_act not in _GELU_APPROXIMATION:
            raise ConfigError(f"unsupported vision hidden_act {self.hidden_act!r}")
        if self.layer_norm_eps <= 0:
            raise ConfigError(f"vision config has layer_norm_eps={self.layer_norm_eps}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    @property
    def tokens_per_tile(self) -> int:
        return self.num_patches // self.scale_factor**2

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> VisionConfig:
        """From an idefics3 ``config.json`` (vision_config, scale_factor, text_config)."""
        try:
            vision = hf_config["vision_config"]
            return cls(
                image_size=int(vision["image_size"]),
                patch_size=int(vision["patch_size"]),
                hidden_size=int(vision["hidden_size"]),
                num_layers=int(vision["num_hidden_layers"]),
                num_heads=int(vision["num_attention_heads"]),
                intermediate_size=int(vision["intermediate_size"]),
                layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)),
                scale_factor=int(hf_config.get("scale_factor", 2)),
                text_hidden_size=int(hf_config["text_config"]["hidden_size"]),
                hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            )
        except (KeyError, TypeError) as exc:
            raise ModelLoadError(f"idefics3 config lacks {exc}") from None
        except ConfigError as exc:
            raise ModelLoadError(f"invalid vision config: {exc}") from None

    @classmethod
    def named(cls, name: str, text_hidden_size: int) -> VisionConfig:
        """The tower called ``name``: "default" (cost-balanced) or "smolvlm-256m" (SmolVLM-256M shape)."""
        if name == "default":
            return cls(text_hidden_size=text_hidden_size)
        if name == "smolvlm-256m":
            return cls(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
                       scale_factor=4, text_hidden_size=text_hidden_size)  # fmt: skip
        raise ConfigError(f"unknown vision tower {name!r} (known: default, smolvlm-256m)")


def encoder_flops_per_tile(config: VisionConfig) -> int:
    """FLOPs (2 per multiply-add) of one tile through tower and connector."""
    n, d = config.num_patches, config.hidden_size
    patch_embed = 2 * n * 3 * config.patch_size**2 * d
    per_layer = 2 * n * d * (4 * d + 2 * config.intermediate_size) + 4 * n * n * d  # matmuls + QK^T, AV
    connector = 2 * n * d * config.text_hidden_size  # N/s^2 rows of D*s^2 features
    return patch_embed + config.num_layers * per_layer + connector


def decoder_prefill_flops(spec: ModelSpec, intermediate_size: int, num_tokens: int) -> int:
    """FLOPs of a Llama-family prefill of ``num_tokens`` from an empty cache (no LM head)."""
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    matmul = 2 * spec.hidden_size * (2 * q_size + 2 * kv_size + 3 * intermediate_size)
    visible_keys = num_tokens * (num_tokens + 1) // 2  # causal: token i sees i + 1 keys
    attention = 4 * q_size * visible_keys
    return spec.num_layers * (num_tokens * matmul + attention)


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """[T, N, D] -> [T, N / s^2, D * s^2], HF ``Idefics3Connector.pixel_shuffle`` exactly."""
    num_tiles, seq, dim = x.shape
    side = int(seq**0.5)
    s = scale_factor
    x = x.reshape(num_tiles, side, side // s, dim * s).permute(0, 2, 1, 3)
    x = x.reshape(num_tiles, side // s, side // s, dim * s * s).permute(0, 2, 1, 3)
    return x.reshape(num_tiles, seq // (s * s), dim * s * s)


class VisionEmbeddings(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        p, d = config.patch_size, config.hidden_size
        self.patch_embedding = nn.Conv2d(3, d, p, stride=p, dtype=dtype, device=device)
        # Positions are 0..N-1 row-major for a full tile (what HF's bucketing yields then).
        self.position_embedding = nn.Embedding(config.num_patches, d, dtype=dtype, device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[T, 3, S, S] -> [T, N, D]."""
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = d // config.num_heads
        self.qkv_proj = MergedColumnParallelLinear(d, [d, d, d], True, dtype=dtype, device=device)
        self.out_proj = ColumnParallelLinear(d, d, True, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor, num_tiles: int) -> torch.Tensor:
        """hidden [T * N, D] -> [T * N, D], each tile attending within itself only."""
        qkv = self.qkv_proj(hidden).view(num_tiles, -1, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [T, heads, N, head_dim]
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(hidden.shape))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(
            config.hidden_size, config.intermediate_size, True, dtype=dtype, device=device
        )
        self.fc2 = ColumnParallelLinear(
            config.intermediate_size, config.hidden_size, True, dtype=dtype, device=device
        )
        self.approximate = _GELU_APPROXIMATION[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(hidden), approximate=self.approximate))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(d, eps=eps, dtype=dtype, device=device)
        self.self_attn = VisionAttention(config, dtype, device)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps, dtype=dtype, device=device)
        self.mlp = VisionMLP(config, dtype, device)

    def forward(self, hidden: torch.Tensor, num_tiles: int) -> torch.Tensor:
        hidden = self.self_attn(self.layer_norm1(hidden), num_tiles) + hidden
        return self.mlp(self.layer_norm2(hidden)) + hidden


class VisionTransformer(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config, dtype, device)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            VisionEncoderLayer(config, dtype, device) for _ in range(config.num_layers)
        )
        self.post_layernorm = nn.LayerNorm(
            config.hidden_size, eps=config.layer_norm_eps, dtype=dtype, device=device
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[T, 3, S, S] -> [T, N, D]."""
        hidden = self.embeddings(pixel_values)
        num_tiles, num_patches, dim = hidden.shape
        hidden = hidden.reshape(num_tiles * num_patches, dim)
        for layer in self.encoder.layers:
            hidden = layer(hidden, num_tiles)
        return self.post_layernorm(hidden).view(num_tiles, num_patches, dim)


class VisionEncoder(nn.Module):
    """Tower + connector; parameter names are HF's without the leading ``model.``
    (``vision_model.*``, ``connector.modality_projection.proj.weight``), q/k/v fused."""

    def __init__(self, config: VisionConfig, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        self.vision_model = VisionTransformer(config, dtype, device)
        self.connector = nn.Module()
        self.connector.modality_projection = nn.Module()
        self.connector.modality_projection.proj = ColumnParallelLinear(
            config.hidden_size * config.scale_factor**2,
            config.text_hidden_size,
            False,
            dtype=dtype,
            device=device,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.connector.modality_projection.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_tiles, 3, S, S] -> [num_tiles * tokens_per_tile, text_hidden], tile-major."""
        expected = (3, self.config.image_size, self.config.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values must be [num_tiles, {expected}], got {list(pixel_values.shape)}")
        hidden = self.vision_model(pixel_values.to(self.dtype))
        shuffled = pixel_shuffle(hidden, self.config.scale_factor)
        return self.connector.modality_projection.proj(shuffled.reshape(-1, shuffled.shape[-1]))

    def _targets(self) -> dict[str, torch.Tensor]:
        """HF tensor name -> the parameter, or the rows of the fused q/k/v parameter, it fills."""
        targets = {}
        d = self.config.hidden_size
        for name, param in self.named_parameters():
            if ".qkv_proj." in name:
                for index, piece in enumerate(("q_proj", "k_proj", "v_proj")):
                    targets["model." + name.replace(".qkv_proj.", f".{piece}.")] = param.narrow(
                        0, index * d, d
                    )
            else:
                targets["model." + name] = param
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF tensors ``model.vision_model.*`` / ``model.connector.*``; every tensor must
        match a parameter (piece) in shape and every one must be loaded, else ValueError."""
        targets = self._targets()
        loaded: set[str] = set()
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching vision parameter")
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {name!r} has shape {list(tensor.shape)}, expected {list(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(targets) - loaded)
        if missing:
            shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
            raise ValueError(f"checkpoint lacks {len(missing)} vision tensors: {shown}")
        prepack_model(self)

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Deterministic weights: normal(0, INIT_STD) for matrices, embeddings and positions,
        ones/zeros for LayerNorm weight/bias, zeros for other biases. Drawn on the CPU in
        float32 from one ``torch.Generator`` in parameter order, then cast: the same seed
        gives bit-identical weights on every process, device and machine."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            if "layer_norm" in name or "post_layernorm" in name:
                param.fill_(1.0 if name.endswith(".weight") else 0.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = torch.empty(param.shape, dtype=torch.float32).normal_(
                    0.0, INIT_STD, generator=generator
                )
                param.copy_(values)
        prepack_model(self)
