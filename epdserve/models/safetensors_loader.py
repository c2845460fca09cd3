"""Read a Hugging Face model directory: config.json, generation_config.json, *.safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from epdserve.models.spec import ModelLoadError

if TYPE_CHECKING:  # torch is imported by safe_open(framework="pt") when tensors are read
    import torch


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; {} when absent, ModelLoadError when unreadable."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return value


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    config = read_json(model_dir / "config.json")
    if not config:
        raise ModelLoadError(f"{model_dir} has no config.json (expected a Hugging Face model directory)")
    return config


def configured_eos_token_ids(model_dir: Path, hf_config: dict[str, Any]) -> tuple[int, ...]:
    """eos_token_id from generation_config.json, else config.json (int or list); may be ()."""
    for source in (
        read_json(model_dir / "generation_config.json"),
        hf_config,
        hf_config.get("text_config") or {},
    ):
        value = source.get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        return tuple(dict.fromkeys(int(token_id) for token_id in ids))
    return ()


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shards: those named by model.safetensors.index.json, else *.safetensors."""
    index = read_json(model_dir / "model.safetensors.index.json")
    if index:
        names = sorted(set(index.get("weight_map", {}).values()))
        files = [model_dir / name for name in names]
        missing = [str(file.name) for file in files if not file.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} lacks shards {', '.join(missing)}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor in ``files``, read through a memory map."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not iterable
                    yield name, shard.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from None
