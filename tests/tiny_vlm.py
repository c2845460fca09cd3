"""A tiny random Idefics3 (SmolVLM-style) checkpoint, written by Hugging Face transformers.

Shared by the model tests (exactness against transformers) and the serving tests (a real
checkpoint directory through the whole E/P/D path).
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
import torch
import transformers

TILE = 64  # tiny tower: 64-px tiles of 16-px patches, scale 2 -> 4 tokens per tile
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<image>", "<fake_token_around_image>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)
]
WORDS = ["\n", "\n\n"] + [f"w{i}" for i in range(300 - len(SPECIAL_TOKENS) - 2)]
VOCAB = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS)}
IMAGE_TOKEN_ID = VOCAB["<image>"]


def _save_tiny_tokenizer(model_dir: Path) -> None:
    """A WordLevel tokenizer over VOCAB: words split on spaces, newline runs kept as tokens."""
    pre = tokenizers.pre_tokenizers
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = pre.Sequence(
        [pre.Split(tokenizers.Regex(r"\n+"), behavior="isolated"), pre.Split(" ", behavior="removed")]
    )
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.save(str(model_dir / "tokenizer.json"))
    # A template that iterates content parts, as SmolVLM's does.
    template = (
        "{% for message in messages %}{{ message['role'] }}{% for part in message['content'] %}"
        "{% if part['type'] == 'text' %} {{ part['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
        "{% if add_generation_prompt %}w7{% endif %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def write_tiny_vlm(model_dir: Path) -> torch.nn.Module:
    """Save a random Idefics3 checkpoint and tokenizer into ``model_dir``; returns the HF model."""
    config = transformers.Idefics3Config(
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "image_size": TILE, "patch_size": 16},
        text_config={"model_type": "llama", "vocab_size": len(VOCAB), "hidden_size": 64,
                     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "max_position_embeddings": 512,
                     "bos_token_id": 1, "eos_token_id": 2},
        scale_factor=2,
        image_token_id=IMAGE_TOKEN_ID,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # make norms and biases matter
        for name, param in reference.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.normal_(0.5 if name.endswith("weight") else 0.0, 0.3)
    reference.save_pretrained(model_dir)
    _save_tiny_tokenizer(model_dir)
    return reference
