"""Model layer: checkpoint loading (GGUF, Hugging Face safetensors), tokenizers and the
decoder implementations (Llama / SmolLM2 / Qwen2 / Qwen3, Gemma 3)."""

from epdserve.models.loader import LoadedModel, load_model, resolve_model_path
from epdserve.models.spec import ModelLoadError, ModelSpec
from epdserve.models.tokenizer import Tokenizer

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "ModelSpec",
    "Tokenizer",
    "load_model",
    "resolve_model_path",
]
