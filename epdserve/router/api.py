"""OpenAI-compatible HTTP endpoints over the router (FastAPI).

    POST /v1/completions  POST /v1/chat/completions  (stream and non-stream)
    GET  /v1/models  /v1/workers  /health  /metrics

User errors are 400 with OpenAI's error body, overload is 429/503 with Retry-After, a failed
worker is 503 (or an SSE error event once a stream has started); never a 500 for user input.
``"return_timing": true`` adds the server-side timestamps of the request (``timing``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from epdserve.cluster import messages as m
from epdserve.errors import EpdserveError
from epdserve.models.multimodal import MultimodalSpec
from epdserve.models.tokenizer import Tokenizer
from epdserve.router.admission import Overloaded
from epdserve.router.core import Router
from epdserve.router.guards import DEFAULT_MAX_REQUEST_BYTES, ApiKeyAuth, BodySizeLimit
from epdserve.router.images import ImageInput, ImageLimits, build_chat_prompt
from epdserve.router.path import RequestHandle
from epdserve.router.protocol import (
    ERROR_TYPES,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    error_response,
)
from epdserve.router.timing import timing_json
from epdserve.sampling import SamplingParams
from epdserve.validate import (
    InvalidFieldError,
    RequestLimits,
    check_logprobs,
    check_messages,
    check_model,
    check_prompt_ids,
    check_prompt_text,
    check_sampling,
    longest_token_chars,
    sampling_params,
)


@dataclass(frozen=True)
class ServedModel:
    names: tuple[str, ...]  # the first is reported in responses
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    mm_spec: MultimodalSpec | None = None  # None: text only
    image_limits: ImageLimits = ImageLimits()
    max_n: int = 16  # sequences per request

    @property
    def limits(self) -> RequestLimits:
        return RequestLimits(vocab_size=self.vocab_size, max_model_len=self.max_model_len, max_n=self.max_n,
                             max_chars_per_token=longest_token_chars(self.tokenizer.backend.get_vocab()))


def create_app(router: Router, served: ServedModel, api_key: str | None = None, *,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, public_metrics: bool = False) -> FastAPI:
    """The API; with ``api_key``, every path but /health needs it (/metrics and /v1/workers
    not either under ``public_metrics``). Bodies over ``max_request_bytes`` are a 413."""
    app = FastAPI(title="epdserve", docs_url=None, redoc_url=None)
    limits = served.limits
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key, public_metrics=public_metrics)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)  # outermost: before the key

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # The deepest error says the most (a union's other members fail at its top).
        error = max(errors, key=lambda e: len(e.get("loc", ())), default={})
        if error.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON")
        where = _field_path(error.get("loc", ()))
        message = str(error.get("msg", "invalid value"))
        return error_response(400, f"{where}: {message}" if where else message, param=where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if router.mode() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "epdserve",
             "max_model_len": served.max_model_len}
            for name in served.names
        ]}

    @app.get("/v1/workers")
    async def workers() -> dict:
        return {"object": "list", "mode": router.mode(),
                "data": router.workers_json()}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        try:
            check_model(body.model, served.names)
            fields = body.sampling_fields(body.max_tokens, body.logprobs)
            check_sampling(fields, limits)
            prompt = body.single_prompt()
            if isinstance(prompt, str):
                prompt_ids = served.tokenizer.encode(check_prompt_text(prompt, limits))
            else:
                prompt_ids = prompt
            check_prompt_ids(prompt_ids, limits)
            params = sampling_params(fields, len(prompt_ids), limits)
        except EpdserveError as e:
            return _invalid(e, "prompt")
        return await _serve(body, prompt_ids, params, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        arrived = time.time()  # before images are fetched and checked: that time is queueing too
        try:
            check_model(body.model, served.names)
            if body.top_logprobs is not None:
                check_logprobs(body.top_logprobs, limits, "top_logprobs")
            fields = body.chat_sampling_fields()
            check_sampling(fields, limits)
            messages = body.chat_messages()
            check_messages(messages, limits)
        except EpdserveError as e:
            return _invalid(e, "messages")
        try:
            prompt = await build_chat_prompt(messages, served.tokenizer, served.mm_spec, served.image_limits)
        except EpdserveError as e:
            return _invalid(e, "messages")
        except Exception as e:  # a chat template that raises on these messages
            return error_response(400, f"cannot apply the chat template: {e}", param="messages")
        try:
            check_prompt_ids(prompt.token_ids, limits, "messages")
            params = sampling_params(fields, len(prompt.token_ids), limits)
        except EpdserveError as e:
            return _invalid(e, "messages")
        return await _serve(body, prompt.token_ids, params, request, chat=True, images=prompt.images, arrived=arrived)

    def _invalid(error: EpdserveError, default_param: str) -> JSONResponse:
        """A 400 naming the field at fault (``default_param`` when the error names none)."""
        param = error.param if isinstance(error, InvalidFieldError) else default_param
        return error_response(400, str(error), param=param)

    async def _serve(body, prompt_ids: list[int], params: SamplingParams, request: Request, chat: bool,  # noqa: ANN001
                     images: list[ImageInput] | None = None, arrived: float | None = None) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            handle = await router.open(request_id, prompt_ids, params, images, arrived)
        except Overloaded as e:
            return error_response(e.status, str(e), retry_after=e.retry_after)
        fmt = _Formatter(request_id, served.names[0], chat, served.tokenizer, bool(body.return_timing), params.n)
        if body.is_stream:
            return StreamingResponse(
                _stream(handle, fmt, body.include_usage, request),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _complete(handle, fmt, request)

    async def _stream(handle: RequestHandle, fmt: _Formatter, include_usage: bool, request: Request) -> AsyncIterator[bytes]:
        done = False
        try:
            if fmt.chat:
                for index in range(fmt.n):
                    yield _sse(fmt.chunk(index, role=True))
            async for batch in handle.event_batches():
                # Every event queued at this wake-up goes out in one write.
                chunks = []
                for event in batch:
                    if event.error is not None:
                        chunks.append(_sse(error_body(event.error, ERROR_TYPES[503], 503)))
                        done = True
                        break
                    out = event.output
                    fmt.add(out)
                    last = out.finished and handle.num_finished >= fmt.n and event is batch[-1]
                    chunks.append(_sse(fmt.chunk(out.index, out=out, timing=handle.timing if last else None)))
                yield b"".join(chunks)
                if done:
                    break
            else:
                done = True
                if include_usage:
                    yield _sse(fmt.usage_chunk(handle))
            yield b"data: [DONE]\n\n"
        finally:
            if not done:
                router.abort(handle.request_id)

    async def _complete(handle: RequestHandle, fmt: _Formatter, request: Request) -> Response:
        async def collect() -> str | None:
            async for event in handle.events():
                if event.error is not None:
                    return event.error
                fmt.add(event.output)
            return None

        collector = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        if not collector.done():
            collector.cancel()
            router.abort(handle.request_id)
            return Response(status_code=499)
        error = collector.result()
        if error is not None:
            return error_response(503, error, retry_after=1)
        return JSONResponse(fmt.full_response(handle))

    return app


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "list", "dict"})


def _field_path(loc: tuple) -> str:
    """A pydantic error location as the client's field path (``messages.0.content.1.text``):
    without "body", union member labels (``str``, ``list[int]``, model names) and the tag a
    tagged union repeats before the field of the same name."""
    parts: list[str] = []
    for item in loc:
        text = str(item)
        if item == "body" or (isinstance(item, str) and ("[" in text or text in _TYPE_LABELS or text[:1].isupper())):
            continue
        if isinstance(item, str) and parts and parts[-1] == text:
            continue
        parts.append(text)
    return ".".join(parts)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj: dict) -> bytes:
    # msgspec writes UTF-8 directly (as json.dumps(ensure_ascii=False)); a non-finite float
    # becomes null, which keeps every chunk valid JSON.
    return b"data: " + _json_encode(obj) + b"\n\n"


_json_encode = msgspec.json.Encoder().encode


class _Formatter:
    """Builds OpenAI response objects and chunks for one request."""

    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: Tokenizer, timing: bool, n: int) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.tokenizer = tokenizer
        self.with_timing = timing
        self.n = n
        self.created = int(time.time())
        self.texts = [""] * n
        self.num_tokens = [0] * n
        self.logprobs: list[list[m.TokenLogprob]] = [[] for _ in range(n)]
        self.finish_reasons: list[str | None] = [None] * n
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    def add(self, out: m.TokenOutput) -> None:
        i = out.index
        self.texts[i] += out.text
        self.num_tokens[i] += len(out.token_ids)
        self.logprobs[i] += out.logprobs
        if out.finished:
            self.finish_reasons[i] = out.finish_reason
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)

    def _usage(self) -> dict:
        completion = sum(self.num_tokens)
        usage = {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self.num_prompt_tokens + completion}
        if self.num_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs_json(self, entries: list[m.TokenLogprob], offset: int = 0) -> dict | None:
        if not entries:
            return None
        if self.chat:
            return {"content": [
                {"token": self._token_text(e.token_id), "logprob": e.logprob,
                 "bytes": list(self._token_text(e.token_id).encode()),
                 "top_logprobs": [{"token": self._token_text(t), "logprob": lp,
                                   "bytes": list(self._token_text(t).encode())}
                                  for t, lp in zip(e.top_token_ids, e.top_logprobs)]}
                for e in entries]}
        tokens = [self._token_text(e.token_id) for e in entries]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token_text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs)}
                                 for e in entries],
                "text_offset": offsets}

    def chunk(self, index: int, out: m.TokenOutput | None = None, role: bool = False, timing: m.Timing | None = None) -> dict:
        finish = out.finish_reason if out is not None and out.finished else None
        logprobs = self._logprobs_json(out.logprobs) if out is not None else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": out.text if out else ""}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": out.text if out else "", "logprobs": logprobs, "finish_reason": finish}
            obj = "text_completion"
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if timing is not None and self.with_timing:
            body["timing"] = timing_json(timing)
        return body

    def usage_chunk(self, handle: RequestHandle) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": self._usage()}
        if self.with_timing:
            body["timing"] = timing_json(handle.timing)
        return body

    def full_response(self, handle: RequestHandle) -> dict:
        choices = []
        for i in range(self.n):
            logprobs = self._logprobs_json(self.logprobs[i])
            if self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": self.texts[i]},
                                "logprobs": logprobs, "finish_reason": self.finish_reasons[i]})
            else:
                choices.append({"index": i, "text": self.texts[i], "logprobs": logprobs,
                                "finish_reason": self.finish_reasons[i]})
        body = {"id": self.request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self._usage()}
        if self.with_timing:
            body["timing"] = timing_json(handle.timing)
        return body
