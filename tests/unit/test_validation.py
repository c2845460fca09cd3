"""Request bounds at the edge (epdserve/validate.py), the request models' strictness, and
the HTTP guards (body size limit, API key) on a real ASGI app, in-process."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from epdserve.router.guards import ApiKeyAuth, BodySizeLimit
from epdserve.router.protocol import ChatCompletionRequest, CompletionRequest, error_response
from epdserve.validate import (
    INT64_MAX,
    INT64_MIN,
    MIN_TOP_P,
    InvalidFieldError,
    RequestLimits,
    SamplingFields,
    check_messages,
    check_model,
    check_prompt_ids,
    check_prompt_text,
    check_sampling,
    longest_token_chars,
    sampling_params,
)

LIMITS = RequestLimits(vocab_size=1000, max_model_len=64, max_n=4)


@pytest.mark.parametrize(
    "fields,param",
    [
        (SamplingFields(seed=1 << 64), "seed"),
        (SamplingFields(seed=INT64_MAX + 1), "seed"),
        (SamplingFields(seed=INT64_MIN - 1), "seed"),
        (SamplingFields(seed=INT64_MAX - 2, n=4), "seed"),  # seed + 3 leaves int64
        (SamplingFields(n=0), "n"),
        (SamplingFields(n=5), "n"),
        (SamplingFields(n=True), "n"),
        (SamplingFields(top_k=-2), "top_k"),
        (SamplingFields(top_k=1001), "top_k"),
        (SamplingFields(stop_token_ids=[1000]), "stop_token_ids"),
        (SamplingFields(stop_token_ids=[-1]), "stop_token_ids"),
        (SamplingFields(stop_token_ids=[1 << 70]), "stop_token_ids"),
        (SamplingFields(stop_token_ids=[1] * 1025), "stop_token_ids"),
        (SamplingFields(stop=[""]), "stop"),
        (SamplingFields(stop=["x"] * 17), "stop"),
        (SamplingFields(stop="x" * 1025), "stop"),
        (SamplingFields(stop="\ud800"), "stop"),
        (SamplingFields(temperature=math.nan), "temperature"),
        (SamplingFields(temperature=math.inf), "temperature"),
        (SamplingFields(temperature=10**400), "temperature"),
        (SamplingFields(temperature=-0.1), "temperature"),
        (SamplingFields(temperature=2.5), "temperature"),
        (SamplingFields(top_p=0.0), "top_p"),
        (SamplingFields(top_p=1.5), "top_p"),
        (SamplingFields(top_p=math.nan), "top_p"),
        (SamplingFields(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingFields(repetition_penalty=1e-300), "repetition_penalty"),
        (SamplingFields(repetition_penalty=-math.inf), "repetition_penalty"),
        (SamplingFields(presence_penalty=3.0), "presence_penalty"),
        (SamplingFields(presence_penalty=0.5), "presence_penalty"),  # in range, not supported
        (SamplingFields(frequency_penalty=math.nan), "frequency_penalty"),
        (SamplingFields(logprobs=21), "logprobs"),
        (SamplingFields(logprobs=-1), "logprobs"),
        (SamplingFields(max_tokens=0), "max_tokens"),
        (SamplingFields(max_tokens=64), "max_tokens"),
        (SamplingFields(max_tokens=64, max_tokens_name="max_completion_tokens"), "max_completion_tokens"),
        (SamplingFields(max_tokens=1.5), "max_tokens"),
        (SamplingFields(min_tokens=-1), "min_tokens"),
        (SamplingFields(ignore_eos=1), "ignore_eos"),
    ],
)
def test_out_of_bounds_field_is_named(fields, param):
    with pytest.raises(InvalidFieldError) as info:
        check_sampling(fields, LIMITS)
    assert info.value.param == param and param in str(info.value)


def test_bounds_are_inclusive_and_seeds_stay_valid_for_torch():
    for seed, n in ((INT64_MAX, 1), (INT64_MAX - 3, 4), (INT64_MIN, 4), (0, 4)):
        params = sampling_params(SamplingFields(seed=seed, n=n), 10, LIMITS)
        for index in range(n):  # the engine seeds sequence i with seed + i
            torch.Generator().manual_seed(params.seed + index)
    edge = SamplingFields(n=4, top_k=1000, temperature=2.0, top_p=1.0, logprobs=20, stop=["x" * 1024] * 16,
                          stop_token_ids=[0, 999] * 512, repetition_penalty=100.0, presence_penalty=0.0,
                          frequency_penalty=-0.0, max_tokens=54, min_tokens=54)
    params = sampling_params(edge, 10, LIMITS)
    assert params.max_tokens == 54 and params.top_k == 1000 and len(params.stop) == 16
    assert sampling_params(SamplingFields(top_k=-1), 10, LIMITS).top_k == 0
    # A top_p that rounds to 0 in float32 keeps the most likely token, as any top_p below 1 / vocab does.
    assert sampling_params(SamplingFields(top_p=5e-324), 10, LIMITS).top_p == MIN_TOP_P
    assert sampling_params(SamplingFields(), 10, LIMITS).max_tokens == 54  # all the room left


def test_max_tokens_and_min_tokens_against_the_prompt():
    with pytest.raises(InvalidFieldError, match="context length") as info:
        sampling_params(SamplingFields(max_tokens=10), 60, LIMITS)
    assert info.value.param == "max_tokens"
    with pytest.raises(InvalidFieldError) as info:
        sampling_params(SamplingFields(min_tokens=10), 60, LIMITS)
    assert info.value.param == "min_tokens"


def test_prompts():
    with pytest.raises(InvalidFieldError, match="empty"):
        check_prompt_text("", LIMITS)
    with pytest.raises(InvalidFieldError, match="not valid Unicode"):
        check_prompt_text("ok \udfff", LIMITS)
    with pytest.raises(InvalidFieldError, match="characters"):
        check_prompt_text("x" * (LIMITS.max_prompt_chars + 1), LIMITS)
    check_prompt_text("x" * LIMITS.max_prompt_chars, LIMITS)
    assert longest_token_chars(["a", "\u0120hello", "<|im_start|>"]) == 12
    check_prompt_ids([0, 999] + [5] * 61, LIMITS)
    for ids, fragment in (([], "empty"), ([1] * 64, "max_model_len"), ([1000], "vocabulary"),
                          ([-1], "vocabulary"), ([1 << 80], "vocabulary"), ([True], "vocabulary")):
        with pytest.raises(InvalidFieldError, match=fragment):
            check_prompt_ids(ids, LIMITS)
    with pytest.raises(InvalidFieldError, match="does not exist"):
        check_model("gpt-4", ("tiny",))
    with pytest.raises(InvalidFieldError, match="not valid Unicode"):
        check_model("\ud800", ("tiny",))


def test_messages():
    check_messages([{"role": "user", "content": None}, {"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}], LIMITS)
    cases = [
        ([], "empty"),
        ([{"role": "user", "content": "x"}] * 65, "at most 64 messages"),
        ([{"role": "user", "content": [{"type": "text", "text": "x"}] * 65}], "content parts"),
        ([{"role": "user", "content": "x" * (LIMITS.max_prompt_chars + 1)}], "characters"),
        ([{"role": "user", "content": "\ud800"}], "not valid Unicode"),
        ([{"role": "user", "content": [{"type": "text", "text": ["nested"]}]}], "must be a string"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "content part"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}], "must be a string"),
    ]
    for messages, fragment in cases:
        with pytest.raises(InvalidFieldError, match=fragment):
            check_messages(messages, LIMITS)


def test_request_models_are_strict_but_take_what_openai_clients_send():
    # The official client and vLLM's send null for options they leave unset.
    chat = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "stream_options": None, "logprobs": None, "top_logprobs": None, "n": None, "stream": None,
        "temperature": 1, "user": "someone", "max_completion_tokens": 5})
    fields = chat.chat_sampling_fields()
    assert fields.max_tokens == 5 and fields.max_tokens_name == "max_completion_tokens" and fields.logprobs is None
    assert chat.chat_messages() == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    ).chat_sampling_fields().logprobs == 0
    CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "logprobs": None, "stream_options": None})
    bad = [
        {"model": "m", "prompt": "x", "n": True},
        {"model": "m", "prompt": "x", "max_tokens": 1.5},
        {"model": "m", "prompt": "x", "max_tokens": "5"},
        {"model": "m", "prompt": "x", "stream": "yes"},
        {"model": "m", "prompt": "x", "stream": 1},
        {"model": "m", "prompt": "x", "temperature": "0.5"},
        {"model": "m", "prompt": [1, "2"]},
        {"model": 5, "prompt": "x"},
    ]
    for body in bad:
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(body)
    for content in ([{"type": "text", "text": {"deep": [[[]]]}}], [{"type": "input_audio"}], [["text"]], 5):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": content}]})


def test_error_response_quotes_unencodable_text():
    response = error_response(400, "model '\ud800' does not exist", param="\udc80")
    body = json.loads(response.body)
    assert response.status_code == 400 and body["error"]["message"] == "model '\\ud800' does not exist"
    assert body["error"]["param"] == "\\udc80" and body["error"]["type"] == "BadRequestError"


def test_validation_module_does_not_import_torch():
    code = ("import sys, epdserve.validate, epdserve.structured, epdserve.router.protocol, epdserve.router.tools; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# -- the HTTP guards, on a small real app ---------------------------------------------


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"num_bytes": len(await request.body())})


async def _text(_: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def _app(max_bytes: int, api_key: str | None = None, public_metrics: bool = False):
    routes = [Route("/v1/echo", _echo, methods=["POST"])] + [Route(p, _text) for p in ("/health", "/metrics", "/v1/workers", "/v1/models")]
    app = Starlette(routes=routes)
    if api_key:
        app = ApiKeyAuth(app, api_key, public_metrics)
    return BodySizeLimit(app, max_bytes)


def _call(app, messages: list[dict], headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes, int]:
    """Drive the ASGI app with these request messages; (status, body, messages it read)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/echo", "raw_path": b"/v1/echo", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    pending = list(messages)
    sent: list[dict] = []

    async def receive() -> dict:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body, len(messages) - len(pending)


def test_body_limit_counts_chunked_bytes_and_stops_reading():
    app = _app(max_bytes=100)
    chunks = [{"type": "http.request", "body": b"x" * 40, "more_body": True} for _ in range(10)]
    status, body, num_read = _call(app, chunks, [])
    error = json.loads(body)["error"]
    assert status == 413 and error["type"] == "RequestTooLargeError" and "100 bytes" in error["message"]
    assert num_read == 3  # stopped at the chunk that passed the limit
    exact = [{"type": "http.request", "body": b"x" * 50, "more_body": True}, {"type": "http.request", "body": b"x" * 50}]
    status, body, _ = _call(app, exact, [])
    assert status == 200 and json.loads(body) == {"num_bytes": 100}


def test_body_limit_refuses_a_declared_length_before_reading():
    app = _app(max_bytes=100)
    status, body, num_read = _call(app, [{"type": "http.request", "body": b"x" * 101}], [(b"content-length", b"101")])
    assert status == 413 and num_read == 0
    status, _, _ = _call(app, [{"type": "http.request", "body": b""}], [(b"content-length", b"nope")])
    assert status == 400
    client = TestClient(_app(max_bytes=100))
    assert client.post("/v1/echo", content=b"y" * 100).json() == {"num_bytes": 100}
    assert client.post("/v1/echo", content=b"y" * 101).status_code == 413


def test_api_key_guards_every_path_but_health():
    client = TestClient(_app(1 << 20, api_key="sekret"))
    for path in ("/metrics", "/v1/workers", "/v1/models"):
        r = client.get(path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert client.get(path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert client.get(path, headers={"Authorization": "Bearer sekreT"}).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer sekret\xe9".encode("latin-1")}).status_code == 401
    assert client.get("/health").status_code == 200
    public = TestClient(_app(1 << 20, api_key="sekret", public_metrics=True))
    assert public.get("/metrics").status_code == 200 and public.get("/v1/workers").status_code == 200
    assert public.get("/v1/models").status_code == 401
