"""Structured outputs, tool calls, batched prompts, logit_bias, echo, /tokenize and the unknown-field
policy, through real servers: colocated, and P/D over shared memory and over TCP (where the first
token is sampled on the prefill worker and the constraint resumes on the decode worker)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from serving import SMALL, start_server, stop_server

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
PROMPTS = [f"Describe {who} as JSON." for who in
           ("a teacher", "my grandmother", "a chef from Rome", "a painter")]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    started = {}
    try:
        started["colocated"] = start_server(SMALL + ["--colocated-workers", "1", "--cores-per-worker", "2"],
                                            str(root / "co"))
        started["pd_shm"] = start_server(SMALL, str(root / "shm"))
        started["pd_tcp"] = start_server(SMALL + ["--kv-transport", "tcp"], str(root / "tcp"))
        yield started
    finally:
        for server in started.values():
            stop_server(server)


def _chat(server, **body) -> dict:
    r = server.client.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct", **body})
    assert r.status_code == 200, r.text
    return r.json()


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def test_json_schema_outputs_validate_and_match_across_topologies(servers):
    greedy = {}
    for name, server in servers.items():
        texts = []
        for prompt in PROMPTS:
            body = _chat(server, messages=[{"role": "user", "content": prompt}], max_tokens=96, temperature=0,
                         response_format=_schema_format(PERSON))
            choice = body["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
            texts.append(choice["message"]["content"])
        greedy[name] = texts
        # Sampled, several sequences: every one still follows the schema.
        body = _chat(server, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=96, temperature=1.0,
                     n=4, seed=7, response_format=_schema_format(PERSON))
        for choice in body["choices"]:
            jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    assert greedy["pd_shm"] == greedy["colocated"]
    assert greedy["pd_tcp"] == greedy["colocated"]


@pytest.mark.parametrize("topology", ["pd_shm", "pd_tcp"])
def test_constraint_holds_on_the_first_token_and_after_the_hand_off(servers, topology):
    server = servers[topology]
    pattern = r"Z[0-9]{6}-(yes|no)"
    for max_tokens in (1, 40):
        r = server.client.post("/v1/completions", json={
            "model": "SmolLM2-135M-Instruct", "prompt": "The answer is", "max_tokens": max_tokens,
            "temperature": 1.0, "seed": 3, "n": 3, "structured_outputs": {"regex": pattern}})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            text = choice["text"]
            if max_tokens == 1:  # only the prefill worker sampled
                assert text and text.startswith("Z"), text
            else:
                assert re.fullmatch(pattern, text), text
                assert choice["finish_reason"] == "stop"
    # json_object and a choice, the older vLLM fields
    body = _chat(server, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8, temperature=0,
                 guided_choice=["yes it is", "no"])
    assert body["choices"][0]["message"]["content"] in ("yes it is", "no")
    body = _chat(server, messages=[{"role": "user", "content": "A JSON object please"}], max_tokens=64,
                 temperature=0, response_format={"type": "json_object"})
    content = body["choices"][0]["message"]["content"]
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")


@pytest.mark.parametrize("topology", ["colocated", "pd_tcp"])
def test_forced_tool_calls_through_the_openai_client(servers, topology):
    client = openai.OpenAI(base_url=servers[topology].url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=WEATHER,
                                              tool_choice=tool_choice, max_tokens=48, temperature=0)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER[0]["function"]["parameters"])
        stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, tools=WEATHER,
                                                tool_choice=tool_choice, max_tokens=48, temperature=0, stream=True)
        deltas, finish = [], None
        for chunk in stream:
            if chunk.choices:
                deltas += chunk.choices[0].delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
        assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments
    # The conversation goes on with the call and its result in the history.
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
    ]
    resp = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=follow, tools=WEATHER,
                                          tool_choice="none", max_tokens=16, temperature=0)
    assert resp.choices[0].message.content and not resp.choices[0].message.tool_calls


def test_batched_prompts_logit_bias_echo_and_tokenize(servers):
    server = servers["pd_shm"]
    c = server.client
    prompts = ["The capital of France is", "One, two, three,", "Hello, my name is"]
    single = [c.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": p, "max_tokens": 6,
                                             "temperature": 0}).json()["choices"][0]["text"] for p in prompts]
    batch = c.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompts, "max_tokens": 6,
                                           "temperature": 0, "n": 2}).json()
    assert [ch["index"] for ch in batch["choices"]] == list(range(6))
    assert [ch["text"] for ch in batch["choices"]] == [t for t in single for _ in range(2)]
    # Token-id prompts, streamed: chunks name their choice; each choice's text as non-streamed.
    ids = [c.post("/tokenize", json={"prompt": p}).json()["tokens"] for p in prompts]
    texts = [""] * 3
    with c.stream("POST", "/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": ids,
                                                   "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    texts[ch["index"]] += ch["text"]
    assert texts == single
    # logit_bias -100 bans the greedy first token.
    first = c.post("/tokenize", json={"prompt": single[0], "add_special_tokens": False}).json()["tokens"][0]
    banned = c.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompts[0], "max_tokens": 6,
                                            "temperature": 0, "logit_bias": {str(first): -100}}).json()
    banned_ids = c.post("/tokenize", json={"prompt": banned["choices"][0]["text"],
                                           "add_special_tokens": False}).json()["tokens"]
    assert banned_ids[0] != first
    echoed = c.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompts[0], "max_tokens": 6,
                                            "temperature": 0, "echo": True}).json()
    assert echoed["choices"][0]["text"] == prompts[0] + single[0]
    tok = c.post("/tokenize", json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello world",
                                    "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024 and len(tok["token_strs"]) == tok["count"]
    assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}
    chat_tok = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > 3


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"guided_regex": "[0-9"}, "guided_regex"),
    ("/v1/chat/completions", {"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
    ("/v1/chat/completions", {"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"1": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "there"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": ["hi"] * 65}, "prompt"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
])
def test_bad_fields_are_400_naming_the_field(servers, path, body, param):
    server = servers["pd_tcp"]
    if "prompt" not in body and path == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": "hi"}], **body}
    r = server.client.post(path, json={"model": "SmolLM2-135M-Instruct", "max_tokens": 4, **body}
                           if path.startswith("/v1") else body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["code"] == 400


def test_unknown_fields_are_named_in_a_warning(servers):
    c = servers["pd_tcp"].client
    r = c.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2,
                                        "user": "u1", "frobnicate": 3, "zap": None})
    assert r.status_code == 200
    assert r.headers["warning"] == '299 epdserve "ignored fields: frobnicate, zap"'
    r = c.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2, "user": "u"})
    assert "warning" not in r.headers
    # A field name no header can carry as it is (non-ASCII, a line break, a quote) is escaped.
    r = c.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 2,
                                        "\U0001f600\n\"": 1})
    assert r.status_code == 200, r.text
    assert r.headers["warning"] == '299 epdserve "ignored fields: \\U0001f600\\n\\""'
    servers["pd_tcp"].wait_all_blocks_free()
