"""Model layer: checkpoint loading (GGUF, Hugging Face safetensors), tokenizers and the
decoder implementations (Llama / SmolLM2 / Qwen2 / Qwen3, Gemma 3).

The names below are imported on first use, so that ``epdserve.models.tokenizer`` and
``epdserve.models.spec`` can be used (e.g. by the router) without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LoadedModel": "epdserve.models.loader",
    "ModelInfo": "epdserve.models.loader",
    "load_model": "epdserve.models.loader",
    "load_model_info": "epdserve.models.loader",
    "resolve_model_path": "epdserve.models.loader",
    "ModelLoadError": "epdserve.models.spec",
    "ModelSpec": "epdserve.models.spec",
    "Tokenizer": "epdserve.models.tokenizer",
}

__all__ = [
    "LoadedModel",
    "ModelInfo",
    "ModelLoadError",
    "ModelSpec",
    "Tokenizer",
    "load_model",
    "load_model_info",
    "resolve_model_path",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'epdserve.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
