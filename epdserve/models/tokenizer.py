"""Tokenizer and chat template, from a Hugging Face-style tokenizer directory.

Runs on the ``tokenizers`` library and jinja2 only (no transformers import). A GGUF
model's tokenizer is converted into such a directory once, by ``gguf_loader``.

Files read: ``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens,
``add_bos_token``, ``chat_template``), ``chat_template.jinja`` (overrides the former).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from epdserve.errors import InvalidRequestError
from epdserve.models.safetensors_loader import read_json
from epdserve.models.spec import ModelLoadError

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")

# Gemma's turn format, used for Gemma 3 checkpoints that ship no template (the GGUF).
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

_FALLBACK_CHAT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}


def fallback_chat_template(architecture: str) -> str | None:
    """The built-in template for checkpoints of ``architecture`` that carry none."""
    return _FALLBACK_CHAT_TEMPLATES.get(architecture)


def _raise_template_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _compile_chat_template(template: str) -> jinja2.Template:
    """Compiled the way transformers does: sandboxed, trim_blocks, lstrip_blocks."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _token_content(value: Any) -> str | None:
    """A special token entry of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _select_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template}."""
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt text."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_token_ids: tuple[int, ...],
        special_tokens: dict[str, str],
        add_bos_token: bool | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens)
        bos_token = special_tokens.get("bos_token")
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        probe = backend.encode("a", add_special_tokens=True).ids
        self._backend_adds_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self.adds_bos = (
            self._backend_adds_bos
            if add_bos_token is None
            else (add_bos_token and self.bos_token_id is not None)
        )

    @classmethod
    def from_dir(
        cls,
        path: Path,
        eos_token_ids: tuple[int, ...] = (),
        default_chat_template: str | None = None,
    ) -> Tokenizer:
        """Load from an HF tokenizer directory; ``eos_token_ids`` defaults to the eos_token."""
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # noqa: BLE001 - the Rust library raises plain Exception
            raise ModelLoadError(f"cannot read {tokenizer_file}: {exc}") from None
        config = read_json(path / "tokenizer_config.json")
        special_tokens = {
            key: token for key in _SPECIAL_TOKEN_KEYS if (token := _token_content(config.get(key)))
        }
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _select_template(config.get("chat_template"))
        if not eos_token_ids:
            eos_id = backend.token_to_id(special_tokens.get("eos_token", ""))
            eos_token_ids = (eos_id,) if eos_id is not None else ()
        return cls(
            backend,
            eos_token_ids=eos_token_ids,
            special_tokens=special_tokens,
            add_bos_token=config.get("add_bos_token"),
            chat_template=chat_template or default_chat_template,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` a BOS is prepended where the
        model's tokenizer config says so. A text that already starts with the BOS token (as
        chat templates render it) does not get a second one."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if not add_special_tokens or self.bos_token_id is None:
            return ids
        bos = self.bos_token_id
        if self._backend_adds_bos and not self.adds_bos and ids[:1] == [bos]:
            ids = ids[1:]
        elif self.adds_bos and not self._backend_adds_bos:
            ids = [bos, *ids]
        if self.adds_bos and ids[:2] == [bos, bos]:
            ids = ids[1:]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role", "content"}, ...]) into the model's prompt text.

        Raises InvalidRequestError (a ValueError) when the model has no chat template or the
        template rejects the conversation.
        """
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use the completions API")
        if self._compiled_template is None:
            try:
                self._compiled_template = _compile_chat_template(self.chat_template)
            except jinja2.exceptions.TemplateError as exc:
                raise InvalidRequestError(f"the model's chat template is invalid: {exc}") from None
        try:
            return self._compiled_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, LookupError) as exc:
            # A template is code run on user data: any failure means the request does not fit it.
            raise InvalidRequestError(f"chat template error: {exc}") from None
