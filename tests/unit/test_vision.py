"""Vision tower, image policy and multimodal loading: exactness against HF Idefics3,
deterministic random towers, the resolution policy and rejection of bad images."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image
from tiny_vlm import IMAGE_TOKEN_ID, TILE, write_tiny_vlm

from epdserve.errors import InvalidRequestError
from epdserve.models import ModelLoadError, load_model
from epdserve.models.image_processing import (
    ImageGrid,
    ImagePolicy,
    content_hash,
    decode_image,
    image_grid,
    preprocess,
    probe_image,
)
from epdserve.models.multimodal import (
    FALLBACK_IMAGE_TOKEN,
    ImageSpan,
    encode_images,
    expand_image_placeholders,
    load_multimodal_spec,
    load_vision_encoder,
    merge_embeddings,
)
from epdserve.models.vision import VisionConfig, VisionEncoder, pixel_shuffle

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A random Idefics3 checkpoint saved by transformers, and the HF model itself."""
    model_dir = tmp_path_factory.mktemp("tiny-vlm")
    return model_dir, write_tiny_vlm(model_dir)


def _random_pixels(num_tiles: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(num_tiles, 3, TILE, TILE, generator=generator) * 2 - 1


def test_vision_rows_match_transformers(tiny_vlm: tuple[Path, torch.nn.Module]) -> None:
    model_dir, reference = tiny_vlm
    encoder = load_vision_encoder(str(model_dir), torch.float32, "cpu")
    pixels = [_random_pixels(5, seed=1), _random_pixels(1, seed=2)]
    ours = encode_images(encoder, pixels)
    with torch.inference_mode():
        for image, rows in zip(pixels, ours):
            theirs = reference.get_image_features(image[None]).pooler_output[0]
            assert rows.shape == (image.shape[0] * 4, 64)
            torch.testing.assert_close(rows, theirs, atol=1e-4, rtol=1e-4)


def test_logits_with_image_match_transformers(tiny_vlm: tuple[Path, torch.nn.Module]) -> None:
    model_dir, reference = tiny_vlm
    loaded = load_model(str(model_dir), torch.float32)
    spec = load_multimodal_spec(str(model_dir))
    assert (spec.image_token_id, spec.is_random_init, spec.vision.tokens_per_tile) == (
        IMAGE_TOKEN_ID,
        False,
        4,
    )
    grid = image_grid(100, 150, spec.policy)  # 2 cols x 3 rows + global
    assert (grid.rows, grid.cols, grid.num_tiles) == (3, 2, 7)
    text_ids = loaded.tokenizer.encode("w1 w2 <image> w3 w4", add_special_tokens=False)
    token_ids, spans = expand_image_placeholders(text_ids, IMAGE_TOKEN_ID, spec, [grid])
    expected_image_text = (
        "<fake_token_around_image><row_1_col_1>" + "<image>" * 4 + "<fake_token_around_image><row_1_col_2>"
        + "<image>" * 4 + "\n<fake_token_around_image><row_2_col_1>" + "<image>" * 4
        + "<fake_token_around_image><row_2_col_2>" + "<image>" * 4 + "\n<fake_token_around_image><row_3_col_1>"
        + "<image>" * 4 + "<fake_token_around_image><row_3_col_2>" + "<image>" * 4
        + "\n\n<fake_token_around_image><global-img>" + "<image>" * 4 + "<fake_token_around_image>"
    )  # fmt: skip
    image_ids = loaded.tokenizer.encode(expected_image_text, add_special_tokens=False)
    assert token_ids == text_ids[:2] + image_ids + text_ids[3:]
    assert spans == [ImageSpan(offset=2, length=len(image_ids), num_embeds=28)]
    pixels = _random_pixels(grid.num_tiles, seed=3)
    encoder = load_vision_encoder(str(model_dir), torch.float32, "cpu")
    [rows] = encode_images(encoder, [pixels])
    ids = torch.tensor(token_ids)
    with torch.inference_mode():
        embeds = merge_embeddings(loaded.model.embed(ids), ids, spec.image_token_id, rows)
        ours = loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids)), input_embeds=embeds))
        theirs = reference(input_ids=ids[None], pixel_values=pixels[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_checkpoint_with_missing_vision_tensor(
    tiny_vlm: tuple[Path, torch.nn.Module], tmp_path: Path
) -> None:
    model_dir, reference = tiny_vlm
    state = {k: v for k, v in reference.state_dict().items() if "encoder.layers.1.mlp.fc2.bias" not in k}
    from safetensors.torch import save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match="lacks 1 vision tensors: model.vision_model.encoder.layers.1.mlp"
    ):
        load_vision_encoder(str(tmp_path), torch.float32, "cpu")


def test_load_weights_rejects_unknown_and_misshaped() -> None:
    encoder = VisionEncoder(VisionConfig(image_size=32, hidden_size=16, num_layers=1, num_heads=2,
                                         intermediate_size=32, text_hidden_size=8), dtype=torch.float32,
                            device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="no matching vision parameter"):
        encoder.load_weights([("model.text_model.norm.weight", torch.zeros(8))])
    with pytest.raises(ValueError, match="has shape \\[8\\], expected \\[16\\]"):
        encoder.load_weights([("model.vision_model.encoder.layers.0.self_attn.k_proj.bias", torch.zeros(8))])


def test_pixel_shuffle_regroups_neighbours() -> None:
    # 4x4 patches, value = patch index: each output token holds a 2x2 block's features.
    x = torch.arange(16.0).view(1, 16, 1)
    out = pixel_shuffle(x, 2)
    assert out.shape == (1, 4, 4)
    assert out[0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    connector = transformers.models.idefics3.modeling_idefics3.Idefics3Connector
    x = torch.randn(3, 64, 5)
    for scale in (2, 4):
        assert torch.equal(pixel_shuffle(x, scale), connector.pixel_shuffle(None, x, scale))


def _weights(encoder: VisionEncoder) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in encoder.named_parameters()}


def test_random_tower_is_deterministic() -> None:
    first = _weights(load_vision_encoder(None, torch.bfloat16, "cpu", seed=7))
    second = _weights(load_vision_encoder(None, torch.bfloat16, "cpu", seed=7))
    other = _weights(load_vision_encoder(None, torch.bfloat16, "cpu", seed=8))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    qkv = "vision_model.encoder.layers.0.self_attn.qkv_proj.weight"
    assert not torch.equal(first[qkv], other[qkv])
    assert first[qkv].std().item() == pytest.approx(0.02, rel=0.05)


def test_default_spec_and_named_towers() -> None:
    spec = load_multimodal_spec(None)
    assert spec.is_random_init and spec.template is None
    assert spec.vision == VisionConfig() and spec.hidden_size == 576
    assert spec.vision.tokens_per_tile == 256
    assert spec.image_token_id == 16  # FALLBACK_IMAGE_TOKEN in SmolLM2's vocabulary
    grid = ImageGrid(width=1920, height=1080, rows=3, cols=4)
    assert spec.num_image_tokens(grid) == 13 * 256
    assert spec.image_prompt_ids(grid) == [16] * (13 * 256)
    assert spec.embedding_bytes(grid) == 13 * 256 * 576 * 2
    assert FALLBACK_IMAGE_TOKEN == "<empty_output>"
    smolvlm = load_multimodal_spec(None, vision="smolvlm-256m").vision
    assert (smolvlm.hidden_size, smolvlm.num_layers, smolvlm.tokens_per_tile) == (768, 12, 64)


def test_gemma3_cannot_take_images() -> None:
    with pytest.raises(ModelLoadError, match="gemma3 multimodal is not supported"):
        load_multimodal_spec("gemma3")


@pytest.mark.parametrize(
    ("size", "rows", "cols", "num_tiles"),
    [
        ((300, 200), 1, 1, 1),
        ((512, 512), 1, 1, 1),
        ((513, 512), 1, 2, 3),
        ((1920, 1080), 3, 4, 13),
        ((4000, 3000), 3, 4, 13),  # scaled to 2048 x 1536
        ((1000, 5000), 4, 1, 5),  # scaled to 410 x 2048
        ((2048, 2048), 4, 4, 17),
    ],
)
def test_resolution_policy(size: tuple[int, int], rows: int, cols: int, num_tiles: int) -> None:
    grid = image_grid(*size, ImagePolicy())
    assert (grid.rows, grid.cols, grid.num_tiles) == (rows, cols, num_tiles)


def test_preprocess_shapes_and_range() -> None:
    policy = ImagePolicy(tile_size=64, max_longest_edge=256)
    image = Image.new("RGB", (150, 70), (255, 0, 128))
    tiles = preprocess(image, policy)
    assert tiles.shape == (3 * 2 + 1, 3, 64, 64) and tiles.dtype == torch.float32
    assert tiles[:, 0].eq(1.0).all() and tiles[:, 1].eq(-1.0).all()
    assert tiles[:, 2].allclose(torch.tensor(128 / 255 * 2 - 1), atol=1e-6)
    gradient = Image.linear_gradient("L").convert("RGB").resize((128, 64))  # black top, white bottom
    tiles = preprocess(gradient, policy)  # 1 row x 2 cols + global
    assert tiles.shape == (3, 3, 64, 64)
    assert tiles.min() >= -1.0 and tiles.max() <= 1.0
    assert tiles[0, :, 0].mean() < tiles[0, :, -1].mean()  # rows stay top to bottom
    assert preprocess(Image.new("RGB", (30, 20)), policy).shape == (1, 3, 64, 64)


def _encoded(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


@pytest.mark.parametrize("image_format", ["PNG", "JPEG", "WEBP"])
def test_supported_formats_decode(image_format: str) -> None:
    data = _encoded(Image.new("RGB", (40, 30), (10, 200, 30)), image_format)
    image = decode_image(data, ImagePolicy())
    assert image.mode == "RGB" and image.size == (40, 30)
    assert probe_image(data, ImagePolicy()) == ImageGrid(width=40, height=30, rows=1, cols=1)


def test_transparent_png_composited_on_white() -> None:
    data = _encoded(Image.new("RGBA", (8, 8), (0, 0, 0, 0)), "PNG")
    assert decode_image(data, ImagePolicy()).getpixel((0, 0)) == (255, 255, 255)


def _assert_rejected(data: bytes, match: str, policy: ImagePolicy | None = None) -> None:
    policy = policy or ImagePolicy()
    for check in (decode_image, probe_image):
        with pytest.raises(InvalidRequestError, match=match) as excinfo:
            check(data, policy)
        assert "\n" not in str(excinfo.value)


def test_bad_images_rejected() -> None:
    png = _encoded(Image.effect_noise((64, 64), 50).convert("RGB"), "PNG")
    _assert_rejected(b"", "empty")
    _assert_rejected(b"definitely not an image", "not a readable image")
    _assert_rejected(png[: len(png) // 2], "PNG image is truncated or corrupt")
    _assert_rejected(_encoded(Image.new("RGB", (8, 8)), "GIF"), "format GIF is not supported")
    _assert_rejected(_encoded(Image.new("RGB", (8, 8)), "BMP"), "format BMP is not supported")
    _assert_rejected(png, "64x64 = 4096 pixels, the limit is 4095", ImagePolicy(max_input_pixels=4095))


def test_oversized_header_rejected_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    # Headers of large, nearly empty PNGs: rejected on the header alone.
    data = _encoded(Image.new("1", (3000, 2000)), "PNG")
    bomb = _encoded(Image.new("1", (20000, 20000)), "PNG")  # past PIL's own decompression-bomb limit
    monkeypatch.setattr(Image.Image, "load", lambda self: pytest.fail("pixels decoded"))
    policy = ImagePolicy(max_input_pixels=5_000_000)
    _assert_rejected(data, "3000x2000 = 6000000 pixels, the limit is 5000000", policy)
    _assert_rejected(bomb, "image is too large")


def test_content_hash() -> None:
    assert content_hash(b"abc") == content_hash(b"abc") != content_hash(b"abd")
    assert len(content_hash(b"")) == 32


def test_expand_rejects_mismatches() -> None:
    spec = load_multimodal_spec(None)
    grid = ImageGrid(width=10, height=10, rows=1, cols=1)
    with pytest.raises(InvalidRequestError, match="1 image placeholders for 2 images"):
        expand_image_placeholders([5, 99, 6], 99, spec, [grid, grid])
    with pytest.raises(InvalidRequestError, match="image token outside an image"):
        expand_image_placeholders([spec.image_token_id, 99], 99, spec, [grid])
    ids, spans = expand_image_placeholders([5, 99, 6, 99], 99, spec, [grid, grid])
    assert spans == [ImageSpan(1, 256, 256), ImageSpan(258, 256, 256)]
    assert ids[0] == 5 and ids[257] == 6 and len(ids) == 514
