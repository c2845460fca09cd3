"""OpenAI request bodies (with the extension fields vLLM's clients send) and error bodies.

The models check types only, strictly (an integer field takes no float or string, a boolean
no number); ``null`` means "not given" for every optional field, as the OpenAI and vLLM
clients send it. Bounds live in ``epdserve.validate``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from epdserve.structured import StructuredFields
from epdserve.validate import InvalidFieldError, SamplingFields


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = None


# Fields that would change the output if honoured and are not: a 400 naming the field (when
# given a value other than their "off" one, shown here).
REFUSED_FIELDS: dict[str, object] = {
    "best_of": 1, "prompt_logprobs": None, "functions": None, "function_call": None, "audio": None,
    "prediction": None, "web_search_options": None, "logits_processors": None, "guided_json_object": None,
    "allowed_token_ids": None, "bad_words": None, "truncate_prompt_tokens": None, "min_p": 0.0,
    "length_penalty": 1.0, "use_beam_search": False, "reasoning_effort": None, "modalities": ["text"],
}
# Fields accepted with no effect by their nature (they label the request, or pick among things
# this server has one of); documented, and not reported.
NO_EFFECT_FIELDS = frozenset({"user", "metadata", "store", "guided_decoding_backend", "request_id",
                              "parallel_tool_calls"})


class _Common(BaseModel):
    # Unknown fields are kept aside (``ignored_fields``): those in REFUSED_FIELDS are a 400,
    # the others are ignored and named in the response's Warning header.
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: StrictInt | None = None
    n: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    # vLLM extension fields
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = None
    repetition_penalty: StrictFloat | None = None
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    # epdserve extension: server-side timestamps of the request in the response
    return_timing: StrictBool | None = None
    # service class (epdserve.service): OpenAI's tier, vLLM's priority (lower first)
    service_tier: StrictStr | None = None
    priority: StrictInt | None = None
    logit_bias: dict[StrictStr, StrictFloat | StrictInt] | None = None
    # structured outputs (checked by epdserve.structured)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None

    def structured_fields(self) -> StructuredFields:
        return StructuredFields(self.response_format, self.structured_outputs, self.guided_json,
                                self.guided_regex, self.guided_choice, self.guided_grammar)

    def ignored_fields(self) -> list[str]:
        """Unknown top-level fields this server ignores; raises InvalidFieldError for one that
        would change the output (REFUSED_FIELDS, given a value other than its off value)."""
        ignored = []
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED_FIELDS:
                if value is not None and value != REFUSED_FIELDS[name]:
                    raise InvalidFieldError(f"{name} is not supported by this server", name)
            elif name not in NO_EFFECT_FIELDS:
                ignored.append(name)
        return ignored

    def sampling_fields(self, max_tokens: int | None, logprobs: int | None,
                        max_tokens_name: str = "max_tokens") -> SamplingFields:
        return SamplingFields(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logprobs=logprobs, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias, max_tokens_name=max_tokens_name, service_tier=self.service_tier,
            priority=self.priority,
        )

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None

    def prompts(self, max_prompts: int) -> list[str | list[int]]:
        """The request's prompts: one string or token-id list, or a list of them (a batch)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > max_prompts:
                raise InvalidFieldError(f"a request has at most {max_prompts} prompts, got {len(prompt)}", "prompt")
            return list(prompt)
        return [prompt]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: StrictStr


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="allow")

    url: StrictStr
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["image_url"]
    image_url: ImageURL | StrictStr


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None  # checked by router.tools
    tool_choice: StrictStr | dict[str, Any] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as plain dicts; list contents keep their parts (text, image_url), and
        tool calls and results their fields."""
        out = []
        for message in self.messages:
            entry: dict[str, Any] = {
                "role": message.role,
                "content": message.content if not isinstance(message.content, list)
                else [part.model_dump(exclude_none=True) for part in message.content]}
            for name in ("name", "tool_calls", "tool_call_id"):
                if getattr(message, name) is not None:
                    entry[name] = getattr(message, name)
            out.append(entry)
        return out

    def chat_sampling_fields(self) -> SamplingFields:
        """``max_tokens``, else its newer name ``max_completion_tokens``; ``top_logprobs``
        alternatives per token (0 when absent) once ``logprobs`` is true."""
        if self.max_tokens is None and self.max_completion_tokens is not None:
            max_tokens, name = self.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, name = self.max_tokens, "max_tokens"
        logprobs = (0 if self.top_logprobs is None else self.top_logprobs) if self.logprobs else None
        return self.sampling_fields(max_tokens, logprobs, name)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: true for a prompt, false for messages
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[StrictInt]


class RoleSwitchRequest(BaseModel):
    """``POST /v1/workers/{worker_id}/role``: move the worker to ``role`` (router/role_switch.py)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["colocated", "prefill", "decode"]


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def _printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates from a request) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(status: int, message: str, retry_after: int | None = None, param: str | None = None) -> JSONResponse:
    """OpenAI's error body; message and param may quote the request, so they are made encodable."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = error_body(_printable(message), ERROR_TYPES.get(status, "Error"), status,
                      None if param is None else _printable(param))
    return JSONResponse(body, status, headers=headers)


ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
