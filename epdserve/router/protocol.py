"""OpenAI request bodies (with the extension fields vLLM's clients send) and error bodies.

The models check types only, strictly (an integer field takes no float or string, a boolean
no number); ``null`` means "not given" for every optional field, as the OpenAI and vLLM
clients send it. Bounds live in ``epdserve.validate``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from epdserve.errors import InvalidRequestError
from epdserve.validate import SamplingFields


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = None


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored

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

    def sampling_fields(self, max_tokens: int | None, logprobs: int | None,
                        max_tokens_name: str = "max_tokens") -> SamplingFields:
        return SamplingFields(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logprobs=logprobs, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            max_tokens_name=max_tokens_name,
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

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError("only one prompt per request is supported; send a batch as separate requests")
            return prompt[0]
        return prompt


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


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as plain dicts; list contents keep their parts (text, image_url)."""
        return [
            {"role": message.role,
             "content": message.content if not isinstance(message.content, list)
             else [part.model_dump(exclude_none=True) for part in message.content]}
            for message in self.messages
        ]

    def chat_sampling_fields(self) -> SamplingFields:
        """``max_tokens``, else its newer name ``max_completion_tokens``; ``top_logprobs``
        alternatives per token (0 when absent) once ``logprobs`` is true."""
        if self.max_tokens is None and self.max_completion_tokens is not None:
            max_tokens, name = self.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, name = self.max_tokens, "max_tokens"
        logprobs = (0 if self.top_logprobs is None else self.top_logprobs) if self.logprobs else None
        return self.sampling_fields(max_tokens, logprobs, name)


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
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
