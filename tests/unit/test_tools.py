"""Tool calling on the router (epdserve/router/tools.py): request validation, forced-call
schemas, output parsing whole and streamed (split at every character), and prompts rendered
through the real SmolLM2 and Gemma 3 chat templates."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import pytest

from epdserve.router.tools import (
    PARSERS,
    GemmaParser,
    HermesParser,
    Tool,
    ToolCall,
    ToolChoice,
    ToolParser,
    forced_calls,
    forced_schema,
    parse_tool_choice,
    parse_tools,
    parser_for,
    tool_call_deltas,
    tool_calls_json,
)
from epdserve.validate import InvalidFieldError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = parse_tools([WEATHER, TIME])


def _param(tools: object) -> str | None:
    with pytest.raises(InvalidFieldError) as info:
        parse_tools(tools)
    return info.value.param


def _choice_param(tool_choice: object, tools: list[Tool]) -> str | None:
    with pytest.raises(InvalidFieldError) as info:
        parse_tool_choice(tool_choice, tools)
    return info.value.param


def _named(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


# --------------------------------------------------------------------------- validation


def test_parse_tools_defaults() -> None:
    weather, time = TOOLS
    assert weather == Tool("get_weather", "The current weather in a city.", WEATHER["function"]["parameters"])
    assert time == Tool("get_time", None, {"type": "object", "properties": {}})
    assert parse_tools(None) == []
    strict = {"type": "function", "function": {"name": "a-b_9", "strict": True, "parameters": {}}}
    assert parse_tools([strict]) == [Tool("a-b_9", None, {})]


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ({"type": "function"}, "tools"),
        ([WEATHER] * 129, "tools"),
        ([WEATHER, "x"], "tools.1"),
        ([{"type": "code", "function": {"name": "f"}}], "tools.0.type"),
        ([{"function": {"name": "f"}}], "tools.0.type"),
        ([{"type": "function"}], "tools.0.function"),
        ([{"type": "function", "function": "f"}], "tools.0.function"),
        ([WEATHER, TIME, {"type": "function", "function": {}}], "tools.2.function.name"),
        ([{"type": "function", "function": {"name": ""}}], "tools.0.function.name"),
        ([{"type": "function", "function": {"name": "a" * 65}}], "tools.0.function.name"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools.0.function.name"),
        ([{"type": "function", "function": {"name": "dot.ted"}}], "tools.0.function.name"),
        ([{"type": "function", "function": {"name": 7}}], "tools.0.function.name"),
        ([WEATHER, WEATHER], "tools.1.function.name"),
        ([{"type": "function", "function": {"name": "f", "description": 1}}], "tools.0.function.description"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools.0.function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
         "tools.0.function.parameters"),
        ([{"type": "function", "function": {"name": "f", "strict": 1}}], "tools.0.function.strict"),
    ],
)
def test_parse_tools_errors(tools: object, param: str) -> None:
    assert _param(tools) == param


def test_parse_tools_limits() -> None:
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(128)]
    assert len(parse_tools(many)) == 128
    assert parse_tools([{"type": "function", "function": {"name": "a" * 64}}])[0].name == "a" * 64


def test_parse_tool_choice() -> None:
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")
    assert parse_tool_choice("none", []) == ToolChoice("none")
    for mode in ("auto", "none", "required"):
        assert parse_tool_choice(mode, TOOLS) == ToolChoice(mode)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_tool_choice(named, TOOLS) == ToolChoice("named", "get_time")


@pytest.mark.parametrize(
    ("tool_choice", "tools", "param"),
    [
        ("any", TOOLS, "tool_choice"),
        (1, TOOLS, "tool_choice"),
        (["auto"], TOOLS, "tool_choice"),
        ("required", [], "tool_choice"),
        ("auto", [], "tool_choice"),
        ({"type": "function", "function": {"name": "get_time"}}, [], "tool_choice"),
        ({"type": "tool", "function": {"name": "get_time"}}, TOOLS, "tool_choice.type"),
        ({"type": "function"}, TOOLS, "tool_choice.function"),
        ({"type": "function", "function": {}}, TOOLS, "tool_choice.function.name"),
        ({"type": "function", "function": {"name": "nope"}}, TOOLS, "tool_choice.function.name"),
    ],
)
def test_parse_tool_choice_errors(tool_choice: object, tools: list[Tool], param: str) -> None:
    assert _choice_param(tool_choice, tools) == param


# --------------------------------------------------------------------------- forced calls


def test_forced_schema() -> None:
    assert forced_schema(ToolChoice("auto"), TOOLS) is None
    assert forced_schema(ToolChoice("none"), TOOLS) is None
    assert forced_schema(ToolChoice("named", "get_weather"), TOOLS) == WEATHER["function"]["parameters"]
    assert forced_schema(ToolChoice("required"), TOOLS) == {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [
            {"type": "object",
             "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER["function"]["parameters"]},
             "required": ["name", "parameters"], "additionalProperties": False},
            {"type": "object",
             "properties": {"name": {"type": "string", "enum": ["get_time"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"], "additionalProperties": False},
        ]},
    }


def test_forced_calls() -> None:
    named = ToolChoice("named", "get_weather")
    (call,) = forced_calls(' { "city" : "Paris" } ', named)
    assert (call.name, call.arguments) == ("get_weather", '{"city":"Paris"}')
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert forced_calls('{"city": "Zürich"}', named)[0].arguments == '{"city":"Zürich"}'
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    calls = forced_calls(text, ToolChoice("required"))
    assert _named(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(
    ("text", "choice"),
    [
        ('{"city": "Paris"', ToolChoice("named", "get_weather")),
        ('["Paris"]', ToolChoice("named", "get_weather")),
        ("", ToolChoice("named", "get_weather")),
        ('{"city": NaN}', ToolChoice("named", "get_weather")),
        ('{"name": "get_time", "parameters": {}}', ToolChoice("required")),
        ("[]", ToolChoice("required")),
        ('[{"name": "get_time"}]', ToolChoice("required")),
        ('[{"name": "get_time", "parameters": []}]', ToolChoice("required")),
        ('[{"name": 3, "parameters": {}}]', ToolChoice("required")),
        ('[{"name": "get_time", "parameters": {}}, 5]', ToolChoice("required")),
        ('[{"name": "get_time", "parameters": {}}', ToolChoice("required")),
        ('{"city": "Paris"}', ToolChoice("auto")),
        ("[" * 100_000, ToolChoice("required")),
    ],
)
def test_forced_calls_bad_text(text: str, choice: ToolChoice) -> None:
    assert forced_calls(text, choice) == []


def test_response_shapes() -> None:
    calls = [ToolCall("call_1", "get_time", "{}"), ToolCall("call_2", "get_weather", '{"city":"Rome"}')]
    assert tool_calls_json(calls) == [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
    ]
    deltas = tool_call_deltas(calls, first_index=3)
    assert [d["index"] for d in deltas] == [3, 4]
    assert deltas[1] == {"index": 4, **tool_calls_json(calls)[1]}
    assert tool_call_deltas([]) == []


# --------------------------------------------------------------------------- parsing


def _hermes_call(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def _gemma_call(body: str) -> str:
    return f"```tool_call\n{body}\n```"


WEATHER_BODY = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME_BODY = '{"name": "get_time", "parameters": {}}'

# (text, expected content, expected calls) per family, built from the family's block format.
CASES = [
    ("no calls here", "no calls here", []),
    ("  padded\n\n", "padded", []),
    ("", None, []),
    ("   \n", None, []),
    ("{call}", None, [("get_weather", {"city": "Paris"})]),
    ("Let me check.\n{call}", "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("{call}\n{time}", None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("Before {call} middle {time} after.", "Before  middle  after.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("{call}{call}", None, [("get_weather", {"city": "Paris"})] * 2),
    ("{bad_json} ok", "{bad_json} ok", []),
    ("{bad_args}", "{bad_args}", []),
    ("{no_name}\n{time}", "{no_name}", [("get_time", {})]),
    ("{no_args}", None, [("get_time", {})]),
    ("text {open_only}", "text {open_only}", []),
    ("{call} then {open_only}", "then {open_only}", [("get_weather", {"city": "Paris"})]),
    ("ends with a partial marker {partial}", "ends with a partial marker {partial}", []),
    ("less < than and ` ticks ``` code ```", "less < than and ` ticks ``` code ```", []),
]


def _fill(template: str, parser: ToolParser) -> str:
    block = _hermes_call if isinstance(parser, HermesParser) else _gemma_call
    return (template
            .replace("{call}", block(WEATHER_BODY))
            .replace("{time}", block(TIME_BODY))
            .replace("{bad_json}", block('{"name": "get_weather", "arguments": {"city": '))
            .replace("{bad_args}", block('{"name": "get_weather", "arguments": "Paris"}'))
            .replace("{no_name}", block('{"arguments": {}}'))
            .replace("{no_args}", block('{"name": "get_time"}'))
            .replace("{open_only}", parser.open_marker + '\n{"name": "get_time", "arguments": {}}')
            .replace("{partial}", parser.open_marker[:-2]))


FAMILIES = [HermesParser(), GemmaParser()]


@pytest.mark.parametrize("parser", FAMILIES, ids=lambda p: p.family)
@pytest.mark.parametrize(("template", "content", "calls"), CASES, ids=[c[0][:30] for c in CASES])
def test_parse(parser: ToolParser, template: str, content: str | None, calls: list) -> None:
    text = _fill(template, parser)
    got_content, got_calls = parser.parse(text)
    assert got_content == (None if content is None else _fill(content, parser))
    assert _named(got_calls) == calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in got_calls)
    assert len({call.id for call in got_calls}) == len(got_calls)


@pytest.mark.parametrize("parser", FAMILIES, ids=lambda p: p.family)
def test_parse_compacts_arguments(parser: ToolParser) -> None:
    block = _hermes_call if isinstance(parser, HermesParser) else _gemma_call
    _, calls = parser.parse(block('{"name": "f", "arguments": {"a": [1, 2], "b": "é"}}'))
    assert calls[0].arguments == '{"a":[1,2],"b":"é"}'
    content, calls = parser.parse(block('{"name": "f", "arguments": {"a": Infinity}}'))
    assert calls == [] and content is not None


def _stream(parser: ToolParser, chunks: list[str]) -> tuple[list[str], list[ToolCall]]:
    stream = parser.stream()
    sent: list[str] = []
    calls: list[ToolCall] = []
    for chunk in chunks:
        content, new = stream.feed(chunk)
        sent.append(content)
        calls += new
    content, new = stream.finish()
    return [*sent, content], calls + new


def _check_stream(parser: ToolParser, text: str, chunks: list[str]) -> None:
    assert "".join(chunks) == text
    content, calls = parser.parse(text)
    sent, streamed = _stream(parser, chunks)
    assert ("".join(sent) or None) == content
    assert _named(streamed) == _named(calls)
    if content is None or parser.open_marker not in content:
        # Nothing of a call block went out as content at any point, not even a marker's start.
        for i in range(1, len(sent) + 1):
            so_far = "".join(sent[:i])
            assert parser.open_marker not in so_far
            assert (content or "").startswith(so_far)


@pytest.mark.parametrize("parser", FAMILIES, ids=lambda p: p.family)
@pytest.mark.parametrize("template", [c[0] for c in CASES], ids=[c[0][:30] for c in CASES])
def test_stream_split_everywhere(parser: ToolParser, template: str) -> None:
    text = _fill(template, parser)
    for cut in range(len(text) + 1):
        _check_stream(parser, text, [text[:cut], text[cut:]])
    _check_stream(parser, text, list(text))  # one character per delta
    rng = random.Random(len(text))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        _check_stream(parser, text, chunks)


def test_stream_holds_back_marker_text() -> None:
    stream = HermesParser().stream()
    assert stream.feed("Hello <tool") == ("Hello", [])
    assert stream.feed("_call>\n{\"name\": \"get_time\", ") == ("", [])
    content, calls = stream.feed('"arguments": {}}\n</tool_call> bye')
    assert content == "  bye" and _named(calls) == [("get_time", {})]  # "Hello " + " bye"
    assert stream.finish() == ("", [])
    stream = HermesParser().stream()
    assert stream.feed("a <tool") == ("a", [])
    assert stream.feed("box") == (" <toolbox", [])
    stream = GemmaParser().stream()
    assert stream.feed("Sure ``") == ("Sure", [])
    # The closing fence could begin a call; it waits for the next delta.
    assert stream.feed("`python\nx = 1\n```") == (" ```python\nx = 1", [])
    assert stream.feed("\nDone.") == ("\n```\nDone.", [])
    stream = GemmaParser().stream()
    assert stream.feed("```tool_call\n{") == ("", [])
    assert stream.finish() == ("```tool_call\n{", [])


# --------------------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def smollm2():
    from epdserve.models.loader import load_model_info

    info = load_model_info(None)
    assert info.spec.architecture == "llama"
    return info.tokenizer


@pytest.fixture(scope="module")
def gemma3():
    from epdserve.models.loader import load_model_info

    info = load_model_info("gemma3")
    assert info.spec.architecture == "gemma3"
    return info.tokenizer


def test_parser_for() -> None:
    assert isinstance(parser_for("gemma3"), GemmaParser)
    assert isinstance(parser_for("gemma"), GemmaParser)
    assert isinstance(parser_for("llama"), HermesParser)
    assert isinstance(parser_for("qwen2"), HermesParser)
    assert PARSERS == {"hermes": HermesParser, "gemma": GemmaParser}


CALLS = [
    {"id": "call_a", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "14:05"}]},
]


def _roles(messages: list[dict]) -> list[str]:
    return [message["role"] for message in messages]


@pytest.mark.parametrize("family", ["hermes", "gemma"])
def test_render_tool_conversation(family: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue("smollm2" if family == "hermes" else "gemma3")
    parser = PARSERS[family]()
    before = json.dumps(TOOL_CONVERSATION)
    messages = parser.render(TOOL_CONVERSATION, TOOLS)
    assert json.dumps(TOOL_CONVERSATION) == before  # the request's messages are not changed
    assert _roles(messages) == ["system", "user", "assistant", "user"]
    assert all(set(message) == {"role", "content"} for message in messages)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    for text in ("get_weather", "get_time", "The current weather in a city.", "sunny, 21 C", "14:05"):
        assert text in prompt
    assert prompt.count(parser.open_marker) >= 2 + 1  # the two earlier calls and the instruction
    result = "<tool_response>" if family == "hermes" else "```tool_output"
    assert messages[3]["content"].count(result) == 2
    # The earlier calls read back as the calls they were.
    _, calls = parser.parse(messages[2]["content"])
    assert _named(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("family", ["hermes", "gemma"])
def test_render_with_system_message(family: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue("smollm2" if family == "hermes" else "gemma3")
    parser = PARSERS[family]()
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": CALLS[1:]},
        {"role": "tool", "tool_call_id": "call_b", "content": "14:05"},
        {"role": "assistant", "content": "It is 14:05."},
        {"role": "user", "content": "And the weather in Rome?"},
    ]
    messages = parser.render(conversation, TOOLS)
    assert _roles(messages) == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("You are terse.\n\n")
    assert messages[2]["content"].startswith("Checking.\n" + parser.open_marker)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert "You are terse." in prompt and "get_weather" in prompt and "get_time" in prompt
    assert "SmolLM" not in prompt  # the tool instruction is the system message, not the default


def test_render_gemma_merges_result_and_user_turns(gemma3) -> None:
    conversation = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": CALLS[1:]},
        {"role": "tool", "content": "14:05"},
        {"role": "user", "content": "Thanks. And Paris?"},
    ]
    messages = GemmaParser().render(conversation, TOOLS)
    assert _roles(messages) == ["system", "user", "assistant", "user"]
    assert messages[0]["content"][0]["text"].startswith("Be brief.\n\n")
    assert messages[3]["content"] == "```tool_output\n14:05\n```\n\nThanks. And Paris?"
    prompt = gemma3.apply_chat_template(messages, add_generation_prompt=True)
    assert "Be brief." in prompt and "get_weather" in prompt and prompt.endswith("<start_of_turn>model\n")
    # Hermes keeps the user message its own turn.
    hermes = HermesParser().render(conversation, TOOLS)
    assert _roles(hermes) == ["system", "user", "assistant", "user", "user"]


def test_render_keeps_image_parts(gemma3) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    user_parts = [{"type": "text", "text": "What is this?"}, image]
    conversation = [{"role": "user", "content": user_parts}]
    for parser in FAMILIES:
        messages = parser.render(conversation, TOOLS)
        assert messages[1]["content"] is user_parts
    # A tool result merged before an image message keeps the image part where it was.
    conversation = [
        {"role": "user", "content": "Fetch the picture."},
        {"role": "assistant", "content": None, "tool_calls": CALLS[1:]},
        {"role": "tool", "content": "done"},
        {"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]},
    ]
    messages = GemmaParser().render(conversation, [])
    assert messages[2]["content"] == [{"type": "text", "text": "```tool_output\ndone\n```"}, image,
                                      {"type": "text", "text": "Describe it."}]
    assert conversation[3]["content"][0] is image
    prompt = gemma3.apply_chat_template(messages, add_generation_prompt=True)
    assert "done" in prompt and "Describe it." in prompt


def test_render_without_tools(smollm2) -> None:
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]
    assert HermesParser().render(conversation, []) == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    # Earlier calls are still written out when the request no longer offers tools.
    messages = HermesParser().render(TOOL_CONVERSATION, [])
    assert _roles(messages) == ["user", "assistant", "user"]
    assert "<tool_call>" in messages[1]["content"]
    smollm2.apply_chat_template(messages, add_generation_prompt=True)


def test_render_earlier_call_arguments() -> None:
    calls = [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
        {"type": "function", "function": {"name": "g", "arguments": "not json"}},
        {"type": "function", "function": {"name": "h"}},
    ]
    messages = HermesParser().render([{"role": "assistant", "content": None, "tool_calls": calls}], [])
    content = messages[0]["content"]
    assert '{"name": "f", "arguments": {"a": 1}}' in content
    assert '{"name": "g", "arguments": "not json"}' in content
    assert '{"name": "h", "arguments": {}}' in content


@pytest.mark.parametrize(
    ("tool_calls", "param"),
    [
        ("call", "messages.1.tool_calls"),
        ([{"type": "function"}], "messages.1.tool_calls.0.function"),
        ([CALLS[0], {"function": {"arguments": "{}"}}], "messages.1.tool_calls.1.function.name"),
        ([{"function": {"name": "f", "arguments": 3}}], "messages.1.tool_calls.0.function.arguments"),
    ],
)
def test_render_bad_tool_calls(tool_calls: object, param: str) -> None:
    conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": tool_calls}]
    with pytest.raises(InvalidFieldError) as info:
        HermesParser().render(conversation, [])
    assert info.value.param == param


def test_module_stays_off_torch() -> None:
    code = ("import sys, epdserve.router.tools; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'epdserve.engine', "
            "'epdserve.cluster', 'epdserve.models'))]; print(bad); sys.exit(bool(bad))")
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
