"""OpenAI-compatible HTTP endpoints over the router (FastAPI).

    POST /v1/completions  POST /v1/chat/completions  (stream and non-stream)
    POST /tokenize  /detokenize  (as vLLM serves them)
    GET  /v1/models  /v1/workers  /v1/roles  /v1/traffic  /health  /metrics
    POST /v1/workers/{worker_id}/role  (--role-switching manual|auto: move a worker to a role)

User errors are 400 with OpenAI's error body, overload is 429/503 with Retry-After, a failed
worker is 503 (or an SSE error event once a stream has started); never a 500 for user input.
``"return_timing": true`` adds the server-side timestamps of the request (``timing``).

Fields: what the models in ``protocol`` name is honoured; an unknown field that would change the
output if honoured (``protocol.REFUSED_FIELDS``) is a 400 naming it; any other unknown field is
ignored and named in the response's ``Warning`` header (a few that label a request or pick
among things this server has one of, ``protocol.NO_EFFECT_FIELDS``, are accepted quietly).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
    DetokenizeRequest,
    RoleSwitchRequest,
    TokenizeRequest,
    error_body,
    error_response,
)
from epdserve.router.responses import Formatter, ToolMode
from epdserve.router.role_switch import SwitchRefused
from epdserve.router.tools import forced_schema, parse_tool_choice, parse_tools, parser_for
from epdserve.sampling import SamplingParams
from epdserve.structured import (
    StructuredFields,
    check_grammar,
    grammar_for,
    grammar_tokenizer,
    json_schema_grammar,
)
from epdserve.validate import (
    InvalidFieldError,
    RequestLimits,
    check_logprobs,
    check_messages,
    check_model,
    check_prompt_ids,
    check_prompt_text,
    check_sampling,
    check_token_ids,
    longest_token_chars,
    sampling_params,
)

T = TypeVar("T")


@dataclass(frozen=True)
class ServedModel:
    names: tuple[str, ...]  # the first is reported in responses
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    mm_spec: MultimodalSpec | None = None  # None: text only
    image_limits: ImageLimits = ImageLimits()
    max_n: int = 16  # sequences per request
    architecture: str = "llama"  # picks the tool-call format (router.tools.parser_for)
    max_prompts: int = 64  # prompts in one completions request
    _grammar_tokenizer: list = field(default_factory=list, compare=False, repr=False)
    _grammar_lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def grammar_tokenizer(self):  # noqa: ANN201 - llguidance.LLTokenizer
        """The tokenizer structured outputs are checked against, built once (0.2 s and 23 MB
        for SmolLM2's 49,152 tokens, 2.3 s and 212 MB for Gemma-3's 262,144): ``serve`` starts
        building it in a thread at start-up; requests call this off the event loop."""
        with self._grammar_lock:
            if not self._grammar_tokenizer:
                t = self.tokenizer
                self._grammar_tokenizer.append(grammar_tokenizer(t.backend.to_str(), self.vocab_size,
                                                                 t.eos_token_ids))
            return self._grammar_tokenizer[0]

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

    @app.get("/v1/traffic")
    async def traffic(window_s: float = 600.0) -> Response:
        """The requests of the last ``window_s`` seconds: arrival, prompt and answer tokens, class."""
        if not 0 < window_s <= 7 * 86400:
            return error_response(400, "window_s must be in (0, 604800] seconds", param="window_s")
        return JSONResponse(router.flow.traffic.as_json(window_s))

    @app.get("/v1/roles")
    async def roles() -> dict:
        return router.roles_json()

    @app.post("/v1/workers/{worker_id}/role")
    async def switch_role(worker_id: str, body: RoleSwitchRequest) -> Response:
        """Drain the worker and move it to ``body.role`` (202: begun; the worker registers in
        its new role once what it holds has finished). 404: no such worker; 409: it cannot
        switch now (not ready, already that role, the last of its role, switching is off)."""
        if router.registry.get(worker_id) is None:
            return error_response(404, f"no worker {worker_id!r}", param="worker_id")
        try:
            worker = router.switch_role(worker_id, body.role, "requested by the API")
        except SwitchRefused as e:
            return error_response(409, str(e))
        return JSONResponse({"id": worker_id, "from_role": str(worker.role), "to_role": body.role,
                             "state": worker.state.value, "num_requests": len(worker.request_ids)}, 202)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        try:
            check_model(body.model, served.names)
            ignored = body.ignored_fields()
            if body.suffix:
                raise InvalidFieldError("suffix is not supported by this server", "suffix")
            if body.echo and body.logprobs is not None:
                raise InvalidFieldError("echo with logprobs is not supported (it needs the prompt's logprobs)", "echo")
            grammar = await _grammar(body.structured_fields())
            fields = replace(body.sampling_fields(body.max_tokens, body.logprobs), grammar=grammar)
            check_sampling(fields, limits)
            prompts_ids, params, echo = [], [], []
            for prompt in body.prompts(served.max_prompts):
                if isinstance(prompt, str):
                    prompt_ids = served.tokenizer.encode(check_prompt_text(prompt, limits))
                else:
                    prompt_ids = prompt
                check_prompt_ids(prompt_ids, limits)
                prompts_ids.append(prompt_ids)
                params.append(sampling_params(fields, len(prompt_ids), limits))
                if body.echo:
                    echo.append(prompt if isinstance(prompt, str) else served.tokenizer.decode(prompt))
        except EpdserveError as e:
            return _invalid(e, "prompt")
        return await _serve(body, prompts_ids, params, request, chat=False, echo=echo if body.echo else None,
                            ignored=ignored)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        arrived = time.time()  # before images are fetched and checked: that time is queueing too
        try:
            check_model(body.model, served.names)
            ignored = body.ignored_fields()
            if body.top_logprobs is not None:
                check_logprobs(body.top_logprobs, limits, "top_logprobs")
            tools = parse_tools(body.tools) if body.tools is not None else []
            choice = parse_tool_choice(body.tool_choice, tools)
            tool_mode = ToolMode(choice, parser_for(served.architecture),
                                 parallel=(body.model_extra or {}).get("parallel_tool_calls") is not False)
            grammar = await _grammar(body.structured_fields())
            schema = forced_schema(choice, tools)
            if schema is not None:
                if grammar is not None:
                    raise InvalidFieldError("a forced tool_choice cannot be combined with a structured output",
                                            "tool_choice")
                grammar = await asyncio.to_thread(_tool_grammar, schema)
            fields = replace(body.chat_sampling_fields(), grammar=grammar)
            check_sampling(fields, limits)
            messages = body.chat_messages()
            check_messages(messages, limits)
            if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
                messages = tool_mode.parser.render(messages, tools)
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
        return await _serve(body, [prompt.token_ids], [params], request, chat=True, images=prompt.images,
                            arrived=arrived, tools=tool_mode if tools else None, ignored=ignored)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        """vLLM's /tokenize: a prompt's (or chat messages') token ids, and their count."""
        try:
            if body.model is not None:
                check_model(body.model, served.names)
            if (body.prompt is None) == (body.messages is None):
                raise InvalidFieldError("give exactly one of prompt and messages", "prompt")
            if body.prompt is not None:
                add_special = True if body.add_special_tokens is None else body.add_special_tokens
                ids = served.tokenizer.encode(check_prompt_text(body.prompt, limits), add_special_tokens=add_special)
            else:
                messages = [msg.model_dump(exclude_none=True) for msg in body.messages]
                check_messages(messages, limits)
                text = served.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
                ids = served.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        except EpdserveError as e:
            return _invalid(e, "prompt")
        strs = [served.tokenizer.backend.id_to_token(i) for i in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        """vLLM's /detokenize: the text of token ids."""
        try:
            if body.model is not None:
                check_model(body.model, served.names)
            if len(body.tokens) > served.max_model_len:
                raise InvalidFieldError(f"at most {served.max_model_len} tokens, got {len(body.tokens)}", "tokens")
            check_token_ids(body.tokens, limits, "tokens")
        except EpdserveError as e:
            return _invalid(e, "tokens")
        return JSONResponse({"prompt": served.tokenizer.decode(body.tokens)})

    async def _grammar(fields: StructuredFields) -> str | None:
        """The request's grammar, compiled and checked off the event loop (a large schema
        takes a while); no thread for a request without one."""
        if fields == _NO_CONSTRAINT:
            return None
        return await asyncio.to_thread(lambda: grammar_for(fields, served.grammar_tokenizer()))

    def _tool_grammar(schema: dict) -> str:
        grammar = json_schema_grammar(schema, "tools")
        check_grammar(grammar, served.grammar_tokenizer(), "tools")
        return grammar

    def _invalid(error: EpdserveError, default_param: str) -> JSONResponse:
        """A 400 naming the field at fault (``default_param`` when the error names none)."""
        param = error.param if isinstance(error, InvalidFieldError) else default_param
        return error_response(400, str(error), param=param)

    async def _serve(body, prompts_ids: list[list[int]], params: list[SamplingParams],  # noqa: ANN001
                     request: Request, chat: bool, images: list[ImageInput] | None = None,
                     arrived: float | None = None, echo: list[str] | None = None, tools: ToolMode | None = None,
                     ignored: list[str] | None = None) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        handles: list[RequestHandle] = []

        async def open_all() -> None:
            for i, (prompt_ids, prompt_params) in enumerate(zip(prompts_ids, params)):
                path_id = request_id if len(prompts_ids) == 1 else f"{request_id}-{i}"
                handles.append(await router.open(path_id, prompt_ids, prompt_params, images, arrived))

        # Admission may wait (a P/D reservation queued at a full decode worker): a client that
        # leaves meanwhile takes its place in that queue with it.
        opened = await _until_disconnect(request, open_all())
        error = None if opened is None else opened.exception()
        if opened is None or error is not None:
            for handle in handles:  # a batch is all or nothing
                router.abort(handle.request_id)
            if isinstance(error, Overloaded):
                return error_response(error.status, str(error), retry_after=error.retry_after)
            if error is not None:
                raise error
            return Response(status_code=499)
        fmt = Formatter(request_id, served.names[0], chat, served.tokenizer, bool(body.return_timing), params[0].n,
                        num_prompts=len(handles), echo=echo, tools=tools)
        headers = {"Warning": _warning(ignored)} if ignored else {}
        if body.is_stream:
            return StreamingResponse(
                _stream(handles, fmt, body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **headers},
            )
        return await _complete(handles, fmt, request, headers)

    async def _stream(handles: list[RequestHandle], fmt: Formatter, include_usage: bool) -> AsyncIterator[bytes]:
        done = False
        try:
            if fmt.chat:
                for index in range(fmt.num_choices):
                    yield _sse(fmt.role_chunk(index))
            async for prompt_index, batch in _batches(handles):
                # Every event queued at this wake-up goes out in one write.
                chunks = []
                for event in batch:
                    if event.error is not None:
                        chunks.append(_sse(error_body(event.error, ERROR_TYPES[503], 503)))
                        done = True
                        break
                    out = event.output
                    index = fmt.add(out, prompt_index)
                    last = fmt.is_done and event is batch[-1]
                    chunks.append(_sse(fmt.chunk(index, out, timing=handles[0].timing if last else None)))
                yield b"".join(chunks)
                if done:
                    break
            else:
                done = True
                if include_usage:
                    yield _sse(fmt.usage_chunk(handles[0].timing))
            yield b"data: [DONE]\n\n"
        finally:
            if not done:
                for handle in handles:
                    router.abort(handle.request_id)

    async def _complete(handles: list[RequestHandle], fmt: Formatter, request: Request,
                        headers: dict[str, str]) -> Response:
        async def collect() -> str | None:
            async for prompt_index, batch in _batches(handles):
                for event in batch:
                    if event.error is not None:
                        return event.error
                    fmt.add(event.output, prompt_index)
            return None

        collected = await _until_disconnect(request, collect())
        if collected is None:
            for handle in handles:
                router.abort(handle.request_id)
            return Response(status_code=499)
        error = collected.result()
        if error is not None:
            for handle in handles:
                router.abort(handle.request_id)
            return error_response(503, error, retry_after=1)
        return JSONResponse(fmt.full_response(handles[0].timing), headers=headers)

    return app


_NO_CONSTRAINT = StructuredFields()
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


async def _until_disconnect(request: Request, work: Awaitable[T]) -> asyncio.Future[T] | None:
    """Run ``work`` until it ends or the client disconnects: its finished task, or None when
    the client left first (``work`` is then cancelled, and its clean-up has run)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if task.done():
        return task
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


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


def _warning(ignored: list[str], max_names: int = 16, max_chars: int = 64) -> str:
    """The Warning header naming ignored fields: printable ASCII only (names escaped as Python
    escapes them: control characters, non-ASCII, quotes), at most ``max_names`` of
    ``max_chars`` each."""
    names = [name.encode("unicode_escape").decode("ascii").replace('"', '\\"')[:max_chars]
             for name in ignored[:max_names]]
    more = f" and {len(ignored) - max_names} more" if len(ignored) > max_names else ""
    return f'299 epdserve "ignored fields: {", ".join(names)}{more}"'


async def _batches(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, list]]:
    """(prompt index, event batch) from every handle as they come; one handle is read directly."""
    if len(handles) == 1:
        async for batch in handles[0].event_batches():
            yield 0, batch
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for batch in handle.event_batches():
                await queue.put((index, batch))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(tasks)
        while remaining:
            index, batch = await queue.get()
            if batch is None:
                remaining -= 1
                continue
            yield index, batch
    finally:
        for task in tasks:
            task.cancel()
