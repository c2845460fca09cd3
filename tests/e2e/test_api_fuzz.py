"""Fuzzing /v1/completions and /v1/chat/completions of a real ``epdserve serve`` (P/D and
colocated) from the server's own OpenAPI description, plus hand-written edge cases.

Bodies come from schemathesis, in its positive mode (they fit the description, with the server's
bounds written into it, so most reach a worker) and its negative mode (each breaks the
description somewhere, bounds included), and from a strategy that puts edge values (huge ints,
NaN, Infinity, lone surrogates, deep nesting, wrong types) into otherwise valid bodies and sends
raw byte garbage. No response may be a 5xx, every worker must stay ready, and every KV block
must come back. Generation is derandomized (fixed seed): a CI run repeats the same requests.
"""

from __future__ import annotations

import copy
import json
import os

import httpx
import pytest
from serving import Server, start_server, stop_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
VOCAB_SIZE = 49152  # SmolLM2's
MAX_MODEL_LEN = 64
MAX_N = 4
MAX_REQUEST_BYTES = 1 << 20
KEY = "fuzz-key-1f7c"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Short context, little KV: every generation is short.
TINY = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "0.05", "--max-n", str(MAX_N),
        "--max-request-bytes", str(MAX_REQUEST_BYTES)]
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
NUM_SCHEMA_CASES = {"positive": 150, "negative": 200}  # per server
NUM_EDGE_CASES = 150  # per server
MAX_FUZZ_TOKENS = 4  # positive cases generate at most this many tokens per sequence


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    """1 prefill + 1 decode; the API key from $EPDSERVE_API_KEY (never on a command line)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("EPDSERVE_API_KEY", KEY)
        server = start_server(TINY + ["--max-pending", "4"], str(tmp_path_factory.mktemp("fuzz_pd")))
    server.api_key = KEY
    yield server
    stop_server(server)


def _post(server: Server, path: str, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **AUTH, **(headers or {})})


def _assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def _assert_healthy(server: Server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert all(w["state"] == "ready" for w in server.workers()), server.workers()
    server.wait_all_blocks_free()


def _complete_ok(server: Server, **kw) -> dict:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, **kw}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


# -- hand-written cases -------------------------------------------------------------------


def test_out_of_range_stop_token_id_is_400_and_the_server_keeps_serving(pd):
    # min_tokens > 0 makes the sampler ban the stop ids: an id past the vocabulary indexed the logits.
    for ids in ([VOCAB_SIZE + 7], [-1], [1 << 64]):
        body = {"model": MODEL, "prompt": "Count: one two", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": ids}
        _assert_error(_post(pd, "/v1/completions", body), 400, "stop_token_ids")
    _complete_ok(pd, min_tokens=2, stop_token_ids=[VOCAB_SIZE - 1])
    _assert_healthy(pd)


def test_seeds_beyond_int64_are_400_and_hold_no_admission_slot(pd):
    # The server admits 4 requests at once: refused requests must not keep a slot.
    for _ in range(4):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": 1 << 64}
        _assert_error(_post(pd, "/v1/completions", body), 400, "seed")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "seed": (1 << 63) - 2, "n": 3}  # seed + 2 leaves int64
    _assert_error(_post(pd, "/v1/chat/completions", body), 400, "seed")
    _complete_ok(pd, seed=(1 << 63) - 1, temperature=1.0)
    _assert_healthy(pd)


def test_body_above_max_request_bytes_is_413(pd):
    big = json.dumps({"model": MODEL, "prompt": "x" * MAX_REQUEST_BYTES}).encode()
    _assert_error(_post(pd, "/v1/completions", big), 413)

    def chunked():  # no Content-Length: the server counts what arrives
        for i in range(0, len(big), 64 << 10):
            yield big[i:i + (64 << 10)]

    response = httpx.post(f"{pd.url}/v1/completions", content=chunked(), timeout=60,
                          headers={"Content-Type": "application/json", **AUTH})
    _assert_error(response, 413)
    _complete_ok(pd)


def test_lone_surrogates_and_malformed_bodies_are_400(pd):
    surrogate = '{"model": "%s", "prompt": "hi \\ud800 there", "max_tokens": 2}' % MODEL
    _assert_error(_post(pd, "/v1/completions", surrogate.encode()), 400, "prompt")
    chat = '{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}' % MODEL
    _assert_error(_post(pd, "/v1/chat/completions", chat.encode()), 400, "messages.0.content.0.text")
    _assert_error(_post(pd, "/v1/completions", b'{"model": "\\ud800", "prompt": "x"}'), 400, "model")
    for raw in (b'{"model": "m", "prompt": "\xff\xfe"}', b"[" * 100_000, b'{"model": 1e999999}', b"\x00",
                b'{"model": "%s", "prompt": "x", "max_tokens": %s}' % (MODEL.encode(), b"9" * 5000)):
        _assert_error(_post(pd, "/v1/completions", raw), 400)
    _assert_healthy(pd)


def test_api_key_from_the_environment_guards_metrics_and_workers(pd):
    for path in ("/metrics", "/v1/workers", "/v1/models"):
        _assert_error(httpx.get(f"{pd.url}{path}", timeout=10), 401)
        assert httpx.get(f"{pd.url}{path}", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(f"{pd.url}/health", timeout=10).status_code == 200
    # The key is in no command line, and the ready line shows how to send it, not the key.
    for pid in [pd.process.pid, *(w["pid"] for w in pd.workers())]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert KEY.encode() not in f.read()
    log = os.path.join(pd.log_dir, "server.log")
    pd.wait_until(lambda: os.path.exists(log) and "curl" in open(log).read(), 10, "the curl line in the log")
    text = open(log).read()
    assert KEY not in text and 'Bearer $EPDSERVE_API_KEY' in text


# -- fuzzing ----------------------------------------------------------------------------


def _bound(prop: dict, **constraints) -> None:
    """Add JSON-schema constraints to the non-null member of an optional property."""
    for member in prop.get("anyOf", [prop]):
        if member.get("type") not in (None, "null"):
            member.update(constraints)


def _schema_with_limits(raw: dict) -> dict:
    """The served OpenAPI description of the two endpoints, with this server's bounds written in
    (what epdserve/validate.py checks) and generation kept to MAX_FUZZ_TOKENS tokens."""
    schema = copy.deepcopy(raw)
    schema["paths"] = {path: schema["paths"][path] for path in ENDPOINTS}
    models = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = models[name]["properties"]
        props["model"]["enum"] = [MODEL]
        _bound(props["n"], minimum=1, maximum=MAX_N)
        props["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": MAX_FUZZ_TOKENS}  # not null either
        _bound(props["min_tokens"], minimum=0, maximum=1)
        _bound(props["seed"], minimum=-(1 << 63), maximum=(1 << 63) - MAX_N)
        _bound(props["top_k"], minimum=-1, maximum=VOCAB_SIZE)
        _bound(props["temperature"], minimum=0, maximum=2)
        _bound(props["top_p"], exclusiveMinimum=0, maximum=1)
        _bound(props["repetition_penalty"], minimum=0.01, maximum=100)
        for penalty in ("presence_penalty", "frequency_penalty"):
            _bound(props[penalty], minimum=0, maximum=0)
        _bound(props["stop_token_ids"], maxItems=8, items={"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1})
        for member in props["stop"]["anyOf"]:
            if member.get("type") == "string":
                member.update(minLength=1, maxLength=16)
            elif member.get("type") == "array":
                member.update(minItems=1, maxItems=4, items={"type": "string", "minLength": 1, "maxLength": 16})
        models[name]["required"] = sorted({*models[name]["required"], "max_tokens"})
    completion = models["CompletionRequest"]["properties"]
    _bound(completion["logprobs"], minimum=0, maximum=20)
    for member in completion["prompt"]["anyOf"]:
        if member.get("type") == "string":
            member.update(minLength=1, maxLength=200)
        elif member["items"].get("type") == "integer":
            member.update(minItems=1, maxItems=MAX_MODEL_LEN - 1 - MAX_FUZZ_TOKENS,
                          items={"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1})
        else:
            member.update(minItems=1, maxItems=1)
    chat = models["ChatCompletionRequest"]["properties"]
    _bound(chat["top_logprobs"], minimum=0, maximum=20)
    chat["messages"].update(minItems=1, maxItems=3)
    return schema


def _run_schema_cases(server: Server, schema: dict, mode, statuses: list[int]) -> None:
    strategy = schemathesis.openapi.from_dict(schema).as_strategy(generation_mode=mode)

    @settings(max_examples=NUM_SCHEMA_CASES[mode.value], derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def send(case) -> None:
        if isinstance(case.body, dict) and case.body.get("max_tokens") is None:
            case.body["max_tokens"] = MAX_FUZZ_TOKENS  # valid either way; keeps the generation short
        response = case.call(base_url=server.url, headers=AUTH, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{response.status_code} {response.text[:500]}\n{case.as_curl_command()}"

    send()


EDGE_VALUES = [
    1 << 64, -(1 << 63) - 1, 10 ** 300, -1, 0, float("nan"), float("inf"), float("-inf"), 1e308, -0.0,
    "\ud800", "", "x" * 5000, [], {}, [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]], None, True,
    [1 << 64], [float("nan")], ["\udfff"], {"type": "text", "text": {"x": [1]}},
]
COMMON_FIELDS = ["model", "max_tokens", "n", "stop", "temperature", "top_p", "top_k", "seed", "presence_penalty",
                 "frequency_penalty", "stream", "stream_options", "ignore_eos", "min_tokens", "repetition_penalty",
                 "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output", "return_timing", "logprobs"]
COMPLETION_FIELDS = [*COMMON_FIELDS, "prompt", "echo"]
CHAT_FIELDS = [*COMMON_FIELDS, "messages", "max_completion_tokens", "top_logprobs",
               "message.role", "message.content", "part.type", "part.text"]
RAW_BODIES = [b"", b"{", b"null", b"[]", b'"x"', b"\xff\xfe\xfd", b"{" * 50_000, b'{"model": NaN}',
              b'{"model": "%s", "prompt": "hi", "n": Infinity}' % MODEL.encode()]


@st.composite
def edge_requests(draw) -> tuple[str, bytes]:
    """A valid body with one field (top level, or inside a message) set to an edge value."""
    chat = draw(st.booleans())
    body = ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
            if chat else {"model": MODEL, "prompt": "Hello"})
    body["max_tokens"] = 2
    value = draw(st.sampled_from(EDGE_VALUES))
    where = draw(st.sampled_from(CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if where.startswith("message."):
        body["messages"][0][where.split(".")[1]] = value
    elif where.startswith("part."):
        body["messages"][0]["content"][0][where.split(".")[1]] = value
    else:
        body[where] = value
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, json.dumps(body).encode()  # ensure_ascii: a lone surrogate travels as \ud800


def _run_edge_cases(server: Server, statuses: list[int]) -> None:
    for raw in RAW_BODIES:
        for path in ENDPOINTS:
            response = _post(server, path, raw)
            statuses.append(response.status_code)
            assert response.status_code < 500, response.text

    @settings(max_examples=NUM_EDGE_CASES, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(request=edge_requests())
    def send(request: tuple[str, bytes]) -> None:
        path, body = request
        response = _post(server, path, body)
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{response.status_code} {response.text[:500]}\n{body[:500]!r}"
        if response.headers["content-type"] == "application/json":
            assert ("error" if response.status_code >= 400 else "choices") in response.json()

    send()


def _fuzz(server: Server) -> list[int]:
    raw = httpx.get(f"{server.url}/openapi.json", headers=AUTH, timeout=10).json()
    schema = _schema_with_limits(raw)
    statuses: list[int] = []
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
        _run_schema_cases(server, schema, mode, statuses)
    _run_edge_cases(server, statuses)
    _assert_healthy(server)
    return statuses


def test_fuzz_pd(pd):
    statuses = _fuzz(pd)
    assert len(statuses) >= 500 and max(statuses) < 500
    assert statuses.count(200) >= 50  # the positive cases reach the workers


def test_fuzz_colocated_with_public_metrics(tmp_path):
    server = start_server(TINY + ["--colocated-workers", "1", "--api-key", KEY, "--public-metrics"], str(tmp_path))
    try:
        for path in ("/metrics", "/v1/workers"):
            assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 200
        _assert_error(httpx.get(f"{server.url}/v1/models", timeout=10), 401)
        statuses = _fuzz(server)
        assert len(statuses) >= 500 and max(statuses) < 500
        assert statuses.count(200) >= 50
    finally:
        stop_server(server)
