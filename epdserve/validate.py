"""Bounds on every field of a generation request, checked before anything is queued.

The one place where request limits live: the router's HTTP API and ``epdserve generate`` both
call it, so a value that passes here is one every worker can run (workers still check their
own invariants in ``SamplingParams``). Types are checked here too, not only by the HTTP
layer's models: ``bool`` is never an ``int``, and floats must be finite.

Imports neither torch nor the engine: the router process stays torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from epdserve.errors import InvalidRequestError
from epdserve.sampling import SamplingParams
from epdserve.service import MAX_PRIORITY, SERVICE_TIERS
from epdserve.service import resolve as resolve_service

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
# Characters of prompt text per token of context when the tokenizer's longest token is not
# known (SmolLM2's longest, a run of spaces, has 81).
DEFAULT_MAX_CHARS_PER_TOKEN = 128
# top_p below this keeps the same tokens (only the most likely: its probability is at least
# 1 / vocab_size > MIN_TOP_P), and is raised to it: smaller values round to 0 in float32.
MIN_TOP_P = 1e-6


class InvalidFieldError(InvalidRequestError):
    """A request field is out of bounds; ``param`` names it as the client sent it."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for; every bound is inclusive unless said otherwise."""

    vocab_size: int
    max_model_len: int  # prompt + output tokens; a prompt has at most max_model_len - 1
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_chars: int = 1024  # per stop string
    max_stop_token_ids: int = 1024
    max_logprobs: int = 20  # logprobs (completions), top_logprobs (chat)
    max_temperature: float = 2.0
    min_repetition_penalty: float = 0.01
    max_repetition_penalty: float = 100.0
    max_abs_presence_penalty: float = 2.0  # presence_penalty and frequency_penalty
    max_logit_bias: int = 1024  # entries of logit_bias
    max_abs_logit_bias: float = 100.0
    # The longest token's text: a prompt text longer than this x max_model_len cannot fit,
    # and is refused before it is tokenized.
    max_chars_per_token: int = DEFAULT_MAX_CHARS_PER_TOKEN

    def __post_init__(self) -> None:
        if self.vocab_size < 1 or self.max_model_len < 2 or self.max_n < 1 or self.max_chars_per_token < 1:
            raise ValueError(f"invalid request limits: {self}")

    @property
    def max_prompt_chars(self) -> int:
        """Characters of prompt text (all chat messages together)."""
        return self.max_model_len * self.max_chars_per_token

    @property
    def max_messages(self) -> int:
        """Chat messages (and content parts) in one request: each costs at least one token."""
        return self.max_model_len


@dataclass(frozen=True)
class SamplingFields:
    """The sampling fields of a request as the client sent them (None: not given)."""

    n: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: object = None  # {"token id": bias}
    grammar: str | None = None  # from epdserve.structured.grammar_for (already checked)
    max_tokens_name: str = "max_tokens"  # the field max_tokens came from, for error messages
    service_tier: object = None  # OpenAI's service_tier (epdserve.service.resolve)
    priority: object = None  # vLLM's priority


def longest_token_chars(vocab: Iterable[str]) -> int:
    """An upper bound on the characters one token's text has: its longest vocabulary entry
    (a byte-level entry has a character per byte, and a byte is at most one character)."""
    return max((len(token) for token in vocab), default=1)


def _show(value: int) -> str:
    """An integer for an error message: its first digits when it is long."""
    digits = str(value)
    return digits if len(digits) <= 30 else f"{digits[:12]}... ({len(digits)} characters)"


def _int(value: object, param: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidFieldError(f"{param} must be an integer", param)
    if value < low:
        raise InvalidFieldError(f"{param} must be at least {low}, got {_show(value)}", param)
    if value > high:
        raise InvalidFieldError(f"{param} must be at most {high}, got {_show(value)}", param)
    return value


def _float(value: object, param: str, low: float, high: float, low_open: bool = False) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidFieldError(f"{param} must be a number", param)
    try:
        number = float(value)
    except OverflowError:  # an int past the float range
        number = math.inf if value > 0 else -math.inf
    if not math.isfinite(number):
        raise InvalidFieldError(f"{param} must be a finite number, got {number}", param)
    if number < low or number > high or (low_open and number == low):
        interval = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise InvalidFieldError(f"{param} must be in {interval}, got {number:g}", param)
    return number


def _bool(value: object, param: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidFieldError(f"{param} must be true or false", param)
    return value


def check_text(value: object, param: str) -> str:
    """A string that can be encoded as UTF-8 (JSON can carry lone surrogates such as \\ud800)."""
    if not isinstance(value, str):
        raise InvalidFieldError(f"{param} must be a string", param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidFieldError(f"{param} has a character that is not valid Unicode at position {e.start}",
                                param) from None
    return value


def check_model(name: object, served_names: Sequence[str]) -> str:
    check_text(name, "model")
    if name not in served_names:
        raise InvalidFieldError(f"model {name[:100]!r} does not exist; this server serves {served_names[0]!r}", "model")
    return name


def check_prompt_text(prompt: object, limits: RequestLimits, param: str = "prompt") -> str:
    """Prompt text before tokenizing: non-empty, valid Unicode, not longer than could fit."""
    check_text(prompt, param)
    if not prompt:
        raise InvalidFieldError("prompt must not be empty", param)
    if len(prompt) > limits.max_prompt_chars:
        raise InvalidFieldError(
            f"the prompt has {len(prompt)} characters; at most {limits.max_prompt_chars} are allowed "
            f"({limits.max_chars_per_token} per token of the {limits.max_model_len}-token context)", param)
    return prompt


def check_prompt_length(num_tokens: int, max_model_len: int, param: str = "prompt") -> None:
    """A prompt of ``num_tokens`` tokens: at least one, and room for one output token."""
    if num_tokens == 0:
        raise InvalidFieldError("prompt must not be empty", param)
    if num_tokens >= max_model_len:
        raise InvalidFieldError(
            f"this model's maximum context length (max_model_len) is {max_model_len} tokens; "
            f"the prompt has {num_tokens} tokens", param)


def check_prompt_ids(token_ids: Sequence[int], limits: RequestLimits, param: str = "prompt") -> None:
    """Prompt token ids: 1 .. max_model_len - 1 of them, each in the vocabulary."""
    check_prompt_length(len(token_ids), limits.max_model_len, param)
    check_token_ids(token_ids, limits, param)


def check_token_ids(token_ids: Sequence[int], limits: RequestLimits, param: str) -> None:
    """Each id in the vocabulary."""
    for token_id in token_ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < limits.vocab_size:
            shown = _show(token_id) if isinstance(token_id, int) else repr(token_id)[:40]
            raise InvalidFieldError(f"token id {shown} is outside the vocabulary (0 .. {limits.vocab_size - 1})", param)


def check_messages(messages: Sequence[dict], limits: RequestLimits) -> None:
    """Chat messages as plain dicts (``role``, ``content``: a string, None or a list of parts):
    their number, their parts and the length of all their text together."""
    if not messages:
        raise InvalidFieldError("messages must not be empty", "messages")
    if len(messages) > limits.max_messages:
        raise InvalidFieldError(f"a request has at most {limits.max_messages} messages, got {len(messages)}", "messages")
    num_chars = num_parts = 0
    for i, message in enumerate(messages):
        content = message.get("content")
        where = f"messages.{i}.content"
        if content is None:
            continue
        if isinstance(content, str):
            num_chars += len(check_text(content, where))
            continue
        if not isinstance(content, list):
            raise InvalidFieldError(f"{where} must be a string or a list of content parts", where)
        num_parts += len(content)
        for j, part in enumerate(content):
            num_chars += _part_chars(part, f"{where}.{j}")
    if num_parts > limits.max_messages:
        raise InvalidFieldError(f"a request has at most {limits.max_messages} content parts, got {num_parts}", "messages")
    if num_chars > limits.max_prompt_chars:
        raise InvalidFieldError(
            f"the messages have {num_chars} characters; at most {limits.max_prompt_chars} are allowed", "messages")


def _part_chars(part: object, where: str) -> int:
    """Characters of text in one content part ({"type": "text", "text"} or an image_url part)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        return len(check_text(part.get("text"), f"{where}.text"))
    if kind == "image_url":
        image_url = part.get("image_url")
        check_text(image_url.get("url") if isinstance(image_url, dict) else image_url, f"{where}.image_url.url")
        return 0
    raise InvalidFieldError(f"{where} must be a content part of type 'text' or 'image_url'", where)


def check_service(service_tier: object, priority: object) -> None:
    """A request's service class fields (``epdserve.service``): a known tier, a bounded integer."""
    if priority is not None:
        _int(priority, "priority", -MAX_PRIORITY, MAX_PRIORITY)
    if service_tier is not None and not (isinstance(service_tier, str) and service_tier in SERVICE_TIERS):
        raise InvalidFieldError(f"service_tier must be one of {', '.join(SERVICE_TIERS)}", "service_tier")


def check_sampling(fields: SamplingFields, limits: RequestLimits) -> None:
    """Every bound that does not depend on the prompt's length."""
    n = 1 if fields.n is None else _int(fields.n, "n", 1, limits.max_n)
    if fields.seed is not None:
        # Sequence i of the request samples with seed + i, which must stay an int64.
        _int(fields.seed, "seed", INT64_MIN, INT64_MAX - (n - 1))
    if fields.max_tokens is not None:
        _int(fields.max_tokens, fields.max_tokens_name, 1, limits.max_model_len - 1)
    if fields.min_tokens is not None:
        _int(fields.min_tokens, "min_tokens", 0, limits.max_model_len - 1)
    if fields.temperature is not None:
        _float(fields.temperature, "temperature", 0.0, limits.max_temperature)
    if fields.top_p is not None:
        _float(fields.top_p, "top_p", 0.0, 1.0, low_open=True)
    if fields.top_k is not None and fields.top_k != -1:
        _int(fields.top_k, "top_k", 0, limits.vocab_size)
    if fields.repetition_penalty is not None:
        _float(fields.repetition_penalty, "repetition_penalty", limits.min_repetition_penalty,
               limits.max_repetition_penalty)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(fields, name)
        if value is not None and _float(value, name, -limits.max_abs_presence_penalty,
                                         limits.max_abs_presence_penalty) != 0.0:
            raise InvalidFieldError(f"{name} is not supported (only 0); use repetition_penalty", name)
    if fields.logprobs is not None:
        check_logprobs(fields.logprobs, limits)
    _check_stop(fields.stop, limits)
    _check_stop_token_ids(fields.stop_token_ids, limits)
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        _bool(getattr(fields, name), name, False)
    check_logit_bias(fields.logit_bias, limits)
    check_service(fields.service_tier, fields.priority)
    if fields.grammar is not None:
        for name in ("ignore_eos", "min_tokens"):
            if getattr(fields, name):
                raise InvalidFieldError(f"{name} cannot be combined with a structured output (the output ends "
                                        "where its grammar does)", name)


def check_logit_bias(value: object, limits: RequestLimits) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: {"token id": bias in [-100, 100]}, as (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidFieldError("logit_bias must be an object mapping token ids to biases", "logit_bias")
    if len(value) > limits.max_logit_bias:
        raise InvalidFieldError(f"logit_bias has {len(value)} entries; at most {limits.max_logit_bias} are allowed",
                                "logit_bias")
    pairs = []
    for key, bias in value.items():
        if not isinstance(key, str) or not key.isascii() or not key.isdigit() or len(key) > 20:
            raise InvalidFieldError(f"logit_bias keys must be token ids, got {str(key)[:40]!r}", "logit_bias")
        token_id = _int(int(key), "logit_bias", 0, limits.vocab_size - 1)
        pairs.append((token_id, _float(bias, "logit_bias", -limits.max_abs_logit_bias, limits.max_abs_logit_bias)))
    return tuple(pairs)


def check_logprobs(value: object, limits: RequestLimits, param: str = "logprobs") -> int:
    """Top alternatives returned per token (``logprobs``, or chat's ``top_logprobs``)."""
    return _int(value, param, 0, limits.max_logprobs)


def _check_stop(stop: object, limits: RequestLimits) -> None:
    if stop is None:
        return
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)):
        raise InvalidFieldError("stop must be a string or a list of strings", "stop")
    if len(strings) > limits.max_stop_strings:
        raise InvalidFieldError(f"stop has {len(strings)} strings; at most {limits.max_stop_strings} are allowed", "stop")
    for s in strings:
        check_text(s, "stop")
        if not 1 <= len(s) <= limits.max_stop_chars:
            raise InvalidFieldError(f"each stop string must have 1 to {limits.max_stop_chars} characters", "stop")


def _check_stop_token_ids(token_ids: object, limits: RequestLimits) -> None:
    if token_ids is None:
        return
    if not isinstance(token_ids, (list, tuple)):
        raise InvalidFieldError("stop_token_ids must be a list of token ids", "stop_token_ids")
    if len(token_ids) > limits.max_stop_token_ids:
        raise InvalidFieldError(
            f"stop_token_ids has {len(token_ids)} ids; at most {limits.max_stop_token_ids} are allowed",
            "stop_token_ids")
    for token_id in token_ids:
        _int(token_id, "stop_token_ids", 0, limits.vocab_size - 1)


def resolve_max_tokens(fields: SamplingFields, num_prompt_tokens: int, limits: RequestLimits) -> int:
    """Output tokens of each sequence: as asked, or all the room the context leaves."""
    room = limits.max_model_len - num_prompt_tokens
    max_tokens = room if fields.max_tokens is None else fields.max_tokens
    if max_tokens > room:
        raise InvalidFieldError(
            f"{fields.max_tokens_name} is {max_tokens}, but the prompt has {num_prompt_tokens} tokens and this "
            f"model's maximum context length is {limits.max_model_len}", fields.max_tokens_name)
    min_tokens = fields.min_tokens or 0
    if min_tokens > max_tokens:
        raise InvalidFieldError(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    return max_tokens


def sampling_params(fields: SamplingFields, num_prompt_tokens: int, limits: RequestLimits) -> SamplingParams:
    """Check every field (``check_sampling``, then against the prompt's length) and build the
    worker-side parameters; unset fields take the OpenAI defaults."""
    check_sampling(fields, limits)
    max_tokens = resolve_max_tokens(fields, num_prompt_tokens, limits)
    stop = fields.stop
    return SamplingParams(
        n=1 if fields.n is None else fields.n,
        max_tokens=max_tokens,
        min_tokens=fields.min_tokens or 0,
        temperature=1.0 if fields.temperature is None else float(fields.temperature),
        top_p=1.0 if fields.top_p is None else max(float(fields.top_p), MIN_TOP_P),
        top_k=0 if fields.top_k is None else fields.top_k,
        seed=fields.seed,
        stop=() if stop is None else ((stop,) if isinstance(stop, str) else tuple(stop)),
        stop_token_ids=tuple(fields.stop_token_ids or ()),
        ignore_eos=_bool(fields.ignore_eos, "ignore_eos", False),
        repetition_penalty=1.0 if fields.repetition_penalty is None else float(fields.repetition_penalty),
        logprobs=fields.logprobs,
        skip_special_tokens=_bool(fields.skip_special_tokens, "skip_special_tokens", True),
        include_stop_str_in_output=_bool(fields.include_stop_str_in_output, "include_stop_str_in_output", False),
        logit_bias=check_logit_bias(fields.logit_bias, limits),
        grammar=fields.grammar,
        priority=resolve_service(fields.service_tier, fields.priority)[1],
    )
