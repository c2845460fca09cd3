"""Structured outputs: the request fields that constrain the text, turned into one grammar.

A request may constrain its output by OpenAI's ``response_format`` (``json_object``,
``json_schema``), by vLLM's ``structured_outputs`` object (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``), or by vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` fields; at most one of them. Whichever it is becomes an
llguidance grammar (a string) here, once, at the edge, and is checked against the served
tokenizer; ``SamplingParams.grammar`` carries that string to the workers, which build a matcher
from it (``engine/grammar.py``) and mask every step's logits with it.

llguidance rather than xgrammar: both run on the CPU, and both cost far less than a decode
step (per token 13.8 vs 3.4 us for the same schema, on steps of 20-60 ms:
``benchmarks/grammar_backends.py``); llguidance has no dependencies, so the router, which
imports no torch, validates a schema with the very compiler the workers run, where xgrammar
pulls in torch, transformers and triton.

JSON is generated without free whitespace (``", "`` between items, ``": "`` after keys): with
flexible whitespace a small model can emit blank lines until it runs out of tokens.

Imports no torch: the router process uses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from epdserve.validate import InvalidFieldError, check_text

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_CHOICES = 256  # entries of a choice constraint
MAX_CHOICE_CHARS = 1024


@dataclass(frozen=True)
class StructuredFields:
    """The structured-output fields of a request as the client sent them (None: not given)."""

    response_format: object = None
    structured_outputs: object = None
    guided_json: object = None
    guided_regex: object = None
    guided_choice: object = None
    guided_grammar: object = None


@lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer (``tokenizers`` JSON), with ``vocab_size`` tokens (the
    width of the model's logits) and the ids that end a sequence; built once per process
    (about 0.2 s for SmolLM2's 49,152 tokens)."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def json_schema_grammar(schema: object, param: str) -> str:
    """The grammar of JSON that follows ``schema`` (a dict, or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidFieldError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise InvalidFieldError(f"{param} must be a JSON schema object", param)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise InvalidFieldError(f"{param} is not a usable JSON schema: {e}", param) from None


def _text(value: object, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidFieldError(f"{param} must be a non-empty string", param)
    return check_text(value, param)


def _choice_grammar(choices: object, param: str) -> str:
    """One of the given strings, exactly (as vLLM's guided_choice)."""
    if not isinstance(choices, list) or not choices:
        raise InvalidFieldError(f"{param} must be a non-empty list of strings", param)
    if len(choices) > MAX_CHOICES:
        raise InvalidFieldError(f"{param} has {len(choices)} entries; at most {MAX_CHOICES} are allowed", param)
    for choice in choices:
        if not isinstance(choice, str) or not 1 <= len(choice) <= MAX_CHOICE_CHARS:
            raise InvalidFieldError(f"each entry of {param} must be a string of 1 to {MAX_CHOICE_CHARS} characters",
                                    param)
        check_text(choice, param)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _response_format(value: object) -> str | None:
    param = "response_format"
    if not isinstance(value, dict) or "type" not in value:
        raise InvalidFieldError("response_format must be an object with a type", param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidFieldError("response_format.json_schema must be an object with a schema", param)
        if "schema" not in spec:
            raise InvalidFieldError("response_format.json_schema.schema is required",
                                         "response_format.json_schema.schema")
        return json_schema_grammar(spec["schema"], "response_format.json_schema.schema")
    raise InvalidFieldError(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {str(kind)[:40]!r}", param)


def _from_kind(kind: str, value: object, param: str) -> str:
    """One constraint of vLLM's kinds (json, regex, choice, grammar, json_object)."""
    if kind == "json":
        return json_schema_grammar(value, param)
    if kind == "json_object":
        if value is not True:
            raise InvalidFieldError(f"{param} must be true", param)
        return json_schema_grammar({"type": "object"}, param)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(_text(value, param))
    if kind == "choice":
        return _choice_grammar(value, param)
    if kind == "grammar":
        # A Lark grammar (llguidance's dialect; GBNF is converted, as vLLM's clients send either).
        try:
            text = any_to_lark(_text(value, param))
        except InvalidFieldError:
            raise
        except Exception as e:  # noqa: BLE001 - the converter raises plain exceptions
            raise InvalidFieldError(f"{param} is not a valid GBNF grammar: {e}", param) from None
        return llguidance.LLMatcher.grammar_from_lark(text)
    raise AssertionError(kind)


_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _structured_outputs(value: object) -> str | None:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidFieldError("structured_outputs must be an object", param)
    given = [k for k in _KINDS if value.get(k) is not None]
    unknown = sorted(set(value) - set(_KINDS) - {"disable_fallback", "disable_any_whitespace",
                                                   "disable_additional_properties", "whitespace_pattern"})
    if unknown:
        raise InvalidFieldError(f"structured_outputs.{unknown[0]} is not supported", f"{param}.{unknown[0]}")
    if len(given) > 1:
        raise InvalidFieldError(f"structured_outputs takes one of {', '.join(_KINDS)}; got {', '.join(given)}",
                                     param)
    if not given:
        return None
    return _from_kind(given[0], value[given[0]], f"{param}.{given[0]}")


def grammar_for(fields: StructuredFields, tokenizer: llguidance.LLTokenizer | None) -> str | None:
    """The grammar the request's output must follow, or None when it asks for none.

    At most one of the fields may constrain; the grammar is checked against ``tokenizer``
    (when given) so that a worker never receives one it cannot build."""
    sources = []
    if fields.response_format is not None:
        grammar = _response_format(fields.response_format)
        if grammar is not None:
            sources.append(("response_format", grammar))
    if fields.structured_outputs is not None:
        grammar = _structured_outputs(fields.structured_outputs)
        if grammar is not None:
            sources.append(("structured_outputs", grammar))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(fields, f"guided_{kind}")
        if value is not None:
            sources.append((f"guided_{kind}", _from_kind(kind, value, f"guided_{kind}")))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise InvalidFieldError(f"a request takes one structured-output constraint; got {names}", sources[1][0])
    param, grammar = sources[0]
    check_grammar(grammar, tokenizer, param)
    return grammar


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer | None, param: str) -> None:
    """A grammar llguidance can build (for ``tokenizer``, when given)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        message = messages[0] if messages else "invalid grammar"
        raise InvalidFieldError(f"{param} cannot be compiled: {message[:500]}", param)
