"""Images in prompts: how many embedding rows an image needs, which token ids stand for it,
and loading the vision encoder that produces the rows.

Two kinds of model take images:

- an Idefics3 / SmolVLM directory (``config.json`` model_type "idefics3"): the tower and
  connector weights come from its safetensors; ``image_token_id`` is the config's (``<image>``).
- a Llama-family text model without vision weights, e.g. the default SmolLM2-135M: a tower
  of a named shape (``vision``, default "default") is initialised from a seed. The pipeline
  is real (same shapes, same compute, same bytes moved) but images are not understood, see
  ``RANDOM_VISION_NOTICE``. ``image_token_id`` is the tokenizer's ``<image>`` if it has one,
  else ``FALLBACK_IMAGE_TOKEN`` (``<empty_output>``, id 16 in SmolLM2: a special token that no
  chat template emits and decoding skips).

The embedding row of every position whose id is ``image_token_id`` is replaced; nothing of
its own embedding survives. Prompt ids for one image follow SmolVLM's template when the
tokenizer has its tokens (``s`` = tokens per tile, ``<img>`` = ``<image>``)::

    rows x cols > 1:  <fake><row_1_col_1><img>*s <fake><row_1_col_2><img>*s ... \\n
                      ... <fake><row_R_col_C><img>*s \\n\\n <fake><global-img><img>*s <fake>
    one tile:         <fake><global-img><img>*s <fake>

otherwise an image is just ``num_image_tokens`` copies of ``image_token_id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from epdserve.errors import ConfigError, InvalidRequestError
from epdserve.models.image_processing import ImageGrid, ImagePolicy
from epdserve.models.loader import load_model_info, resolve_model_path
from epdserve.models.safetensors_loader import iter_safetensors, read_hf_config, safetensors_files
from epdserve.models.spec import ModelLoadError
from epdserve.models.tokenizer import Tokenizer
from epdserve.models.vision import VisionConfig, VisionEncoder

RANDOM_VISION_NOTICE = (
    "vision tower is randomly initialised (no checkpoint weights for it): the image pipeline "
    "(decode, tiling, encode, embedding transfer, prefill) is real, but the model does not "
    "understand images"
)
FALLBACK_IMAGE_TOKEN = "<empty_output>"
IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
VISION_WEIGHT_PREFIXES = ("model.vision_model.", "model.connector.")
CHECKPOINT_TOWER = "checkpoint"  # ``vision`` naming the model directory's own tower
TILES_PER_EDGE = 4  # default policy: longest edge = 4 tiles (2048 px for 512-px tiles)


@dataclass(frozen=True)
class ImageTemplate:
    """Token ids of SmolVLM's image prompt template."""

    fake_token_id: int
    global_token_id: int
    row_col_token_ids: tuple[tuple[int, ...], ...]  # [r][c] = id of <row_{r+1}_col_{c+1}>
    row_end_ids: tuple[int, ...]  # "\n" after every row but the last
    grid_end_ids: tuple[int, ...]  # "\n\n" after the last row, before the global tile

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, max_tiles_per_side: int) -> ImageTemplate | None:
        """The template if the tokenizer has its special tokens, else None."""
        backend = tokenizer.backend
        fake_id, global_id = backend.token_to_id(FAKE_TOKEN), backend.token_to_id(GLOBAL_IMAGE_TOKEN)
        if fake_id is None or global_id is None:
            return None
        row_col_ids = []
        for row in range(1, max_tiles_per_side + 1):
            ids = [backend.token_to_id(f"<row_{row}_col_{col}>") for col in range(1, max_tiles_per_side + 1)]
            if None in ids:
                raise ModelLoadError(
                    f"the tokenizer lacks <row_R_col_C> tokens up to {max_tiles_per_side}x{max_tiles_per_side}, "
                    "which the image policy can produce; lower max_longest_edge"
                )
            row_col_ids.append(tuple(ids))
        return cls(
            fake_token_id=fake_id,
            global_token_id=global_id,
            row_col_token_ids=tuple(row_col_ids),
            row_end_ids=tuple(backend.encode("\n", add_special_tokens=False).ids),
            grid_end_ids=tuple(backend.encode("\n\n", add_special_tokens=False).ids),
        )


class ImageSpan(NamedTuple):
    """One image's tokens in an expanded prompt."""

    offset: int  # index of its first token
    length: int  # number of tokens, template tokens included
    num_embeds: int  # embedding rows: positions in the span whose id == image_token_id


@dataclass(frozen=True)
class MultimodalSpec:
    """What a router needs to place images in prompts; no weights."""

    vision: VisionConfig
    policy: ImagePolicy
    image_token_id: int
    is_random_init: bool  # True when no checkpoint weights exist for the tower
    hidden_size: int  # rows of one embedding = text hidden size
    template: ImageTemplate | None = None  # None: an image is just its image tokens

    def __post_init__(self) -> None:
        if self.vision.text_hidden_size != self.hidden_size:
            raise ModelLoadError(
                f"vision connector outputs {self.vision.text_hidden_size} features, the text model "
                f"takes {self.hidden_size}"
            )
        if self.policy.tile_size != self.vision.image_size:
            raise ConfigError(
                f"image tile_size={self.policy.tile_size} differs from the tower's image_size={self.vision.image_size}"
            )
        if (
            self.template is not None
            and len(self.template.row_col_token_ids) < self.policy.max_tiles_per_side
        ):
            raise ConfigError("the image template has fewer <row_R_col_C> tokens than the policy needs")

    def num_image_tokens(self, grid: ImageGrid) -> int:
        """Embedding rows for one image."""
        return grid.num_tiles * self.vision.tokens_per_tile

    def image_prompt_ids(self, grid: ImageGrid) -> list[int]:
        """The token ids that stand for one image; count(image_token_id) == num_image_tokens."""
        tile_ids = [self.image_token_id] * self.vision.tokens_per_tile
        template = self.template
        if template is None:
            return tile_ids * grid.num_tiles
        global_tile = [template.fake_token_id, template.global_token_id, *tile_ids, template.fake_token_id]
        if not grid.has_global_tile:
            return global_tile
        ids: list[int] = []
        for row in range(grid.rows):
            for col in range(grid.cols):
                ids += [template.fake_token_id, template.row_col_token_ids[row][col], *tile_ids]
            ids += template.row_end_ids if row < grid.rows - 1 else template.grid_end_ids
        return ids + global_tile

    def embedding_bytes(self, grid: ImageGrid, dtype_bytes: int = 2) -> int:
        return self.num_image_tokens(grid) * self.hidden_size * dtype_bytes


def expand_image_placeholders(
    token_ids: list[int], placeholder_id: int, spec: MultimodalSpec, grids: list[ImageGrid]
) -> tuple[list[int], list[ImageSpan]]:
    """Replace the k-th ``placeholder_id`` by ``spec.image_prompt_ids(grids[k])``.

    Returns the new ids and each image's span in them. InvalidRequestError when the number
    of placeholders differs from the number of images, or when ``image_token_id`` occurs
    outside the placeholders (its row would be taken from no image).
    """
    num_placeholders = sum(1 for token_id in token_ids if token_id == placeholder_id)
    if num_placeholders != len(grids):
        raise InvalidRequestError(f"prompt has {num_placeholders} image placeholders for {len(grids)} images")
    if placeholder_id != spec.image_token_id and spec.image_token_id in token_ids:
        raise InvalidRequestError("prompt contains the image token outside an image")
    new_ids: list[int] = []
    spans: list[ImageSpan] = []
    for token_id in token_ids:
        if token_id != placeholder_id:
            new_ids.append(token_id)
            continue
        grid = grids[len(spans)]
        image_ids = spec.image_prompt_ids(grid)
        spans.append(ImageSpan(len(new_ids), len(image_ids), spec.num_image_tokens(grid)))
        new_ids += image_ids
    return new_ids, spans


def merge_embeddings(
    text_embeds: torch.Tensor, token_ids: torch.Tensor, image_token_id: int, image_rows: torch.Tensor
) -> torch.Tensor:
    """text_embeds [T, H] with the rows at ``token_ids == image_token_id`` replaced, in order,
    by image_rows [K, H]; K must equal the number of such positions (ValueError otherwise)."""
    is_image = token_ids == image_token_id
    num_positions = int(is_image.sum())
    if num_positions != image_rows.shape[0]:
        raise ValueError(f"{num_positions} image token positions for {image_rows.shape[0]} embedding rows")
    merged = text_embeds.clone()
    merged[is_image] = image_rows.to(merged.dtype)
    return merged


def _idefics3_dir(model: str | None) -> tuple[Path, dict] | None:
    """(directory, config.json) when ``model`` is an Idefics3 directory, else None."""
    path = resolve_model_path(model)
    if not path.is_dir():
        return None
    hf_config = read_hf_config(path)
    return (path, hf_config) if hf_config.get("model_type") == "idefics3" else None


def _resolve(
    model: str | None, vision: str | None, policy: ImagePolicy | None
) -> tuple[MultimodalSpec, Path | None]:
    """The spec and, when the tower's weights exist, the directory holding them."""
    info = load_model_info(model)
    checkpoint = _idefics3_dir(model)
    if vision == CHECKPOINT_TOWER:
        if checkpoint is None:
            raise ModelLoadError(
                f"model {model or 'default'!r} has no vision weights; name a seeded tower (--vision default)"
            )
        vision = None
    hidden_size = info.spec.hidden_size
    if checkpoint is None and info.spec.architecture not in ("llama", "qwen2", "qwen3"):
        name = model or "default"
        raise ModelLoadError(
            f"model {name!r} cannot take images: {info.spec.architecture} multimodal is not supported "
            "(images need the default model, a Llama-family model or an Idefics3/SmolVLM directory)"
        )
    if checkpoint is not None and vision is None:
        config = VisionConfig.from_hf(checkpoint[1])
        image_token_id = checkpoint[1].get("image_token_id", info.tokenizer.backend.token_to_id(IMAGE_TOKEN))
    else:
        config = VisionConfig.named(vision or "default", hidden_size)
        image_token_id = info.tokenizer.backend.token_to_id(IMAGE_TOKEN)
        if image_token_id is None:
            image_token_id = info.tokenizer.backend.token_to_id(FALLBACK_IMAGE_TOKEN)
    if image_token_id is None or not 0 <= int(image_token_id) < info.spec.vocab_size:
        raise ModelLoadError(
            f"model {info.spec.name!r} has no usable image token ({IMAGE_TOKEN} or {FALLBACK_IMAGE_TOKEN})"
        )
    if policy is None:
        policy = ImagePolicy(tile_size=config.image_size, max_longest_edge=TILES_PER_EDGE * config.image_size)
    spec = MultimodalSpec(
        vision=config,
        policy=policy,
        image_token_id=int(image_token_id),
        is_random_init=checkpoint is None or vision is not None,
        hidden_size=hidden_size,
        template=ImageTemplate.from_tokenizer(info.tokenizer, policy.max_tiles_per_side),
    )
    return spec, None if spec.is_random_init else checkpoint[0]


def load_multimodal_spec(
    model: str | None, vision: str | None = None, policy: ImagePolicy | None = None
) -> MultimodalSpec:
    """The image side of ``model`` (see the module docstring); ModelLoadError for a model that
    cannot take images. ``vision`` names a randomly initialised tower shape ("default",
    "smolvlm-256m") instead of the checkpoint's; ``policy`` defaults to tiles of the tower's
    image size and a longest edge of 4 tiles."""
    return _resolve(model, vision, policy)[0]


def load_vision_encoder(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device | str,
    vision: str | None = None,
    seed: int = 0,
) -> VisionEncoder:
    """The tower + connector of ``model``: checkpoint weights, or seeded random ones."""
    spec, checkpoint_dir = _resolve(model, vision, None)
    encoder = VisionEncoder(spec.vision, dtype=dtype, device=device)
    if checkpoint_dir is None:
        encoder.init_random(seed)
    else:
        weights = (
            (name, tensor)
            for name, tensor in iter_safetensors(safetensors_files(checkpoint_dir))
            if name.startswith(VISION_WEIGHT_PREFIXES)
        )
        try:
            encoder.load_weights(weights)
        except ValueError as exc:
            raise ModelLoadError(f"cannot load vision weights from {checkpoint_dir}: {exc}") from None
    return encoder.eval()


def encode_images(encoder: VisionEncoder, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
    """Encode several images' tiles in one forward; each image's [rows, hidden] in the encoder
    dtype, rows = its num_tiles * tokens_per_tile."""
    if not pixel_values:
        return []
    device = next(encoder.parameters()).device
    tiles = torch.cat([pixels.to(device) for pixels in pixel_values], dim=0)
    with torch.inference_mode():
        rows = encoder(tiles)
    sizes = [pixels.shape[0] * encoder.config.tokens_per_tile for pixels in pixel_values]
    return list(rows.split(sizes, dim=0))
