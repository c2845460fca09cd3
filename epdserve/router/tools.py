"""OpenAI tool calling for models whose chat templates know nothing of tools.

The request's ``tools`` and ``tool_choice`` are checked here (``parse_tools``,
``parse_tool_choice``); the conversation is rewritten into plain system/user/assistant
messages the model's own template renders (``ToolParser.render``): the tools are described
in a system instruction, earlier calls and their results become text in the family's call
format. The model's output is then split back into content and calls, either at once
(``ToolParser.parse``) or as it streams (``ToolStream``), which never sends a call's text
as content.

Parser per model family (``PARSERS``, chosen by ``parser_for(architecture)``):

    family   architectures             a call (one block each)                   a tool result
    hermes   llama (SmolLM2), default  <tool_call>                               <tool_response>
                                       {"name": ..., "arguments": {...}}         ...
                                       </tool_call>                              </tool_response>
    gemma    gemma3, gemma*            ```tool_call                              ```tool_output
                                       {"name": ..., "arguments": {...}}         ...
                                       ```                                       ```

Tool results are rendered as user turns in both families (every ChatML template renders a
user turn, not all render a "tool" one); consecutive results share one turn. Gemma's
template demands strict user/assistant alternation, so there a result turn also merges with
an adjacent user message. When parsing, ``"parameters"`` is accepted for ``"arguments"``
(small models write either) and a missing one means ``{}``; arguments that are not a JSON
object make the block malformed, and a malformed or unterminated block stays in the content.

``tool_choice`` "required" or a named function is enforced by guided decoding instead:
``forced_schema`` is the JSON schema of the whole output (vLLM's shapes) and
``forced_calls`` reads the calls back out of it.

Router floor: imports no torch and nothing of the engine, cluster or model runtime.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from epdserve.validate import InvalidFieldError

__all__ = [
    "PARSERS",
    "GemmaParser",
    "HermesParser",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "ToolParser",
    "ToolStream",
    "forced_calls",
    "forced_schema",
    "parse_tool_choice",
    "parse_tools",
    "parser_for",
    "tool_call_deltas",
    "tool_calls_json",
]

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOOL_CHOICE_MODES = ("auto", "none", "required")


@dataclass(frozen=True)
class Tool:
    """One function the model may call; ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str | None
    parameters: dict


@dataclass(frozen=True)
class ToolChoice:
    """What the request lets the model do: "auto" | "none" | "required" | "named" (``name``)."""

    mode: str
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """One call the model made; ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


def _new_call(name: str, arguments: dict) -> ToolCall:
    """A call with a fresh OpenAI-style id ("call_" + 24 hex digits) and compact arguments."""
    return ToolCall(id="call_" + uuid.uuid4().hex[:24], name=name, arguments=_compact(arguments))


def _compact(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


# --------------------------------------------------------------------------- request fields


def _optional_type(value: object, kind: type, what: str, param: str) -> None:
    """``value`` is None or of ``kind`` (never a bool standing in for something else)."""
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise InvalidFieldError(f"{param} must be {what}", param)


def _parse_tool(item: object, where: str) -> Tool:
    """One entry of ``tools``: {"type": "function", "function": {"name", ...}}."""
    if not isinstance(item, dict):
        raise InvalidFieldError(f"{where} must be an object", where)
    if item.get("type") != "function":
        raise InvalidFieldError(f"{where}.type must be 'function'", f"{where}.type")
    function = item.get("function")
    if not isinstance(function, dict):
        raise InvalidFieldError(f"{where}.function must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidFieldError(
            f"{where}.function.name must be 1 to 64 characters of a-z, A-Z, 0-9, '_' and '-'",
            f"{where}.function.name")
    description = function.get("description")
    _optional_type(description, str, "a string", f"{where}.function.description")
    parameters = function.get("parameters")
    _optional_type(parameters, dict, "a JSON schema object", f"{where}.function.parameters")
    _optional_type(function.get("strict"), bool, "a boolean", f"{where}.function.strict")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    return Tool(name=name, description=description, parameters=parameters)


def parse_tools(tools: object) -> list[Tool]:
    """The request's ``tools`` as sent in JSON (None: not given, no tools).

    Raises InvalidFieldError naming the offending field, e.g. "tools.2.function.name".
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidFieldError("tools must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidFieldError(f"a request has at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    parsed: list[Tool] = []
    seen: set[str] = set()
    for i, item in enumerate(tools):
        tool = _parse_tool(item, f"tools.{i}")
        if tool.name in seen:
            raise InvalidFieldError(f"tool name {tool.name!r} is given twice", f"tools.{i}.function.name")
        seen.add(tool.name)
        parsed.append(tool)
    return parsed


def parse_tool_choice(tool_choice: object, tools: list[Tool]) -> ToolChoice:
    """The request's ``tool_choice``: None means "auto" with tools and "none" without; a
    choice that needs tools ("auto", "required", a named function) is refused without."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in _TOOL_CHOICE_MODES:
            raise InvalidFieldError(
                "tool_choice must be 'auto', 'none', 'required' or a function", "tool_choice")
        choice = ToolChoice(tool_choice)
    elif isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise InvalidFieldError("tool_choice.type must be 'function'", "tool_choice.type")
        function = tool_choice.get("function")
        if not isinstance(function, dict):
            raise InvalidFieldError("tool_choice.function must be an object", "tool_choice.function")
        name = function.get("name")
        if not isinstance(name, str):
            raise InvalidFieldError("tool_choice.function.name must be a string", "tool_choice.function.name")
        choice = ToolChoice("named", name)
    else:
        raise InvalidFieldError(
            "tool_choice must be 'auto', 'none', 'required' or a function", "tool_choice")
    if choice.mode != "none" and not tools:
        raise InvalidFieldError(f"tool_choice {choice.mode!r} needs tools", "tool_choice")
    if choice.mode == "named" and all(tool.name != choice.name for tool in tools):
        raise InvalidFieldError(
            f"tool_choice names {choice.name!r}, which is not one of the tools", "tool_choice.function.name")
    return choice


# --------------------------------------------------------------------------- forced calls


def forced_schema(choice: ToolChoice, tools: list[Tool]) -> dict | None:
    """The JSON schema the whole output must follow, or None when the model chooses freely.

    named: the tool's parameters (the output is the arguments object); required: a non-empty
    array of {"name", "parameters"} objects, one alternative per tool (vLLM's shapes). The
    wrapper objects take no other keys (a small model otherwise wanders into a "description").
    """
    if choice.mode == "named":
        return next(tool.parameters for tool in tools if tool.name == choice.name)
    if choice.mode == "required":
        alternatives = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "parameters": tool.parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        return {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
    return None


def _loads(text: str) -> Any:
    """JSON value of ``text``; raises ValueError, also for NaN and Infinity (not JSON)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def forced_calls(text: str, choice: ToolChoice) -> list[ToolCall]:
    """The calls in an output produced under ``forced_schema(choice, ...)``; [] for text that
    does not follow it (never raises)."""
    try:
        value = _loads(text)
    except (ValueError, RecursionError):
        return []
    if choice.mode == "named" and choice.name is not None:
        return [_new_call(choice.name, value)] if isinstance(value, dict) else []
    if choice.mode != "required" or not isinstance(value, list):
        return []
    calls = []
    for item in value:
        if not isinstance(item, dict):
            return []
        name, arguments = item.get("name"), item.get("parameters")
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return []
        calls.append(_new_call(name, arguments))
    return calls


# --------------------------------------------------------------------------- response shapes


def tool_calls_json(calls: list[ToolCall]) -> list[dict]:
    """OpenAI's ``message.tool_calls``."""
    return [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls
    ]


def tool_call_deltas(calls: list[ToolCall], first_index: int = 0) -> list[dict]:
    """OpenAI's streaming ``delta.tool_calls`` entries, each call whole in one delta;
    ``first_index`` is the number of calls this choice already streamed."""
    return [
        {"index": first_index + i, **entry} for i, entry in enumerate(tool_calls_json(calls))
    ]


# --------------------------------------------------------------------------- output parsing


def _call_of_block(body: str) -> ToolCall | None:
    """The call in one block's body ({"name", "arguments" | "parameters"}), None if malformed."""
    try:
        value = _loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return _new_call(name, arguments)


class _StrippedText:
    """Content as it streams, stripped like the whole text would be: leading whitespace is
    dropped, trailing whitespace held until more text follows it (and dropped at the end)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def add(self, text: str) -> str:
        """The part of ``text`` (after what was held) that is safe to send now."""
        text = self._held + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body):]
        self._started = self._started or bool(body)
        return body


class ToolStream:
    """Splits one output, delta by delta, into content and the calls between
    ``open_marker`` and ``close_marker``.

    Text that could still become the open marker is held back; a block is sent as a call
    once it closes, or as content if its body is not a call. The content sent, all together,
    is the text outside the calls, stripped.
    """

    def __init__(self, open_marker: str, close_marker: str) -> None:
        self._open = open_marker
        self._close = close_marker
        self._pending = ""  # outside a block: text not yet sent; inside: the block's body
        self._inside = False
        self._content = _StrippedText()

    def _held_prefix(self) -> int:
        """Length of the longest end of the pending text that begins the open marker."""
        for size in range(min(len(self._open) - 1, len(self._pending)), 0, -1):
            if self._pending.endswith(self._open[:size]):
                return size
        return 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Content safe to send now and the calls that ``delta`` completed."""
        searched = max(0, len(self._pending) - len(self._close if self._inside else self._open) + 1)
        self._pending += delta
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                end = self._pending.find(self._close, searched)
                if end < 0:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(self._close):]
                self._inside = False
                call = _call_of_block(body)
                if call is None:
                    content.append(self._open + body + self._close)
                else:
                    calls.append(call)
            else:
                start = self._pending.find(self._open)
                if start < 0:
                    keep = self._held_prefix()
                    content.append(self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                content.append(self._pending[:start])
                self._pending = self._pending[start + len(self._open):]
                self._inside = True
            searched = 0
        return self._content.add("".join(content)), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: the held-back text, an unterminated block as content."""
        rest = (self._open if self._inside else "") + self._pending
        self._pending, self._inside = "", False
        return self._content.add(rest), []


# --------------------------------------------------------------------------- prompt rendering


Content = str | list | None


def _text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def _join(first: Content, second: Content, separator: str) -> Content:
    """Two message contents as one: strings joined by ``separator``; with a list of parts,
    a list whose parts are kept (the boundary text parts merged, so no template trims the
    separator away)."""
    if not first:
        return second
    if not second:
        return first
    if isinstance(first, str) and isinstance(second, str):
        return first + separator + second
    head = [_text_part(first)] if isinstance(first, str) else list(first)
    tail = [_text_part(second)] if isinstance(second, str) else list(second)
    last, next_ = head[-1], tail[0]
    if _is_text_part(last) and _is_text_part(next_):
        return [*head[:-1], _text_part(last["text"] + separator + next_["text"]), *tail[1:]]
    return [*head, *tail]


def _is_text_part(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def _plain_text(content: Content) -> str:
    """The text of a content: a string, None, or the text parts of a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part["text"] for part in content if _is_text_part(part))
    return ""


def _tool_json(tool: Tool) -> str:
    """A tool as the instruction lists it (OpenAI's own shape)."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters
    return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


def _call_arguments(value: object, where: str) -> object:
    """An earlier call's arguments as a JSON value: the JSON text parsed (kept as text when
    it is not JSON), or an object given as is."""
    if isinstance(value, dict):
        return value
    if value is None:
        return {}
    if not isinstance(value, str):
        raise InvalidFieldError(f"{where} must be a string of JSON", where)
    try:
        return _loads(value)
    except (ValueError, RecursionError):
        return value


def _earlier_calls(tool_calls: object, where: str) -> list[tuple[str, object]]:
    """(name, arguments) of an assistant message's ``tool_calls`` (OpenAI's shape)."""
    if not isinstance(tool_calls, list):
        raise InvalidFieldError(f"{where} must be a list", where)
    calls = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidFieldError(f"{where}.{j}.function must be an object", f"{where}.{j}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            param = f"{where}.{j}.function.name"
            raise InvalidFieldError(f"{param} must be a non-empty string", param)
        calls.append((name, _call_arguments(function.get("arguments"), f"{where}.{j}.function.arguments")))
    return calls


class ToolParser:
    """One model family's tool format: how tools, calls and results are written into the
    prompt, and how calls are read out of the output."""

    family: str = ""
    open_marker: str = ""
    close_marker: str = ""
    # Whether a tool result turn also merges with an adjacent user message (templates that
    # demand strict user/assistant alternation).
    merge_user_turns: bool = False

    def instruction(self, tools: list[Tool]) -> str:
        """The system text that lists ``tools`` and tells the model how to call them."""
        raise NotImplementedError

    def format_call(self, name: str, arguments: object) -> str:
        """One call as the model writes it."""
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.open_marker}\n{body}\n{self.close_marker}"

    def format_result(self, text: str) -> str:
        """One tool result as the prompt shows it."""
        raise NotImplementedError

    def render(self, messages: list[dict], tools: list[Tool]) -> list[dict]:
        """``messages`` (OpenAI chat messages as dicts) as role/content messages the family's
        template renders: tools in the first system message, calls and results as text.

        List contents (images included) are kept, only extended where text is added. Raises
        InvalidFieldError for an assistant message's malformed ``tool_calls``.
        """
        rendered: list[dict] = []
        result_turn = False  # whether rendered[-1] is a user turn holding tool results
        for i, message in enumerate(messages):
            role = message.get("role")
            content: Content = message.get("content")
            if role == "tool":
                block = self.format_result(_plain_text(content))
                if rendered and rendered[-1]["role"] == "user" and (result_turn or self.merge_user_turns):
                    rendered[-1]["content"] = _join(rendered[-1]["content"], block, "\n")
                else:
                    rendered.append({"role": "user", "content": block})
                result_turn = True
                continue
            if role == "user" and result_turn and self.merge_user_turns:
                rendered[-1]["content"] = _join(rendered[-1]["content"], content, "\n\n")
                continue
            if role == "developer":
                role = "system"
            if role == "assistant" and message.get("tool_calls"):
                calls = _earlier_calls(message["tool_calls"], f"messages.{i}.tool_calls")
                content = _join(content, "\n".join(self.format_call(n, a) for n, a in calls), "\n")
            rendered.append({"role": role, "content": "" if content is None else content})
            result_turn = False
        if tools:
            instruction = self.instruction(tools)
            if rendered and rendered[0]["role"] == "system":
                rendered[0]["content"] = _join(rendered[0]["content"], instruction, "\n\n")
            else:
                rendered.insert(0, {"role": "system", "content": instruction})
        return rendered

    def stream(self) -> ToolStream:
        """A splitter for one streamed output."""
        return ToolStream(self.open_marker, self.close_marker)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output: the text outside the calls (stripped; None when empty) and the
        calls. Malformed blocks stay in the content; never raises."""
        stream = self.stream()
        content, calls = stream.feed(text)
        rest, last = stream.finish()
        return (content + rest) or None, calls + last


class HermesParser(ToolParser):
    """Hermes / Qwen style XML tags: the default for ChatML models such as SmolLM2."""

    family = "hermes"
    open_marker = "<tool_call>"
    close_marker = "</tool_call>"

    def instruction(self, tools: list[Tool]) -> str:
        listed = "\n".join(_tool_json(tool) for tool in tools)
        return (
            "# Tools\n\n"
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
            "Function results are given back within <tool_response></tool_response> XML tags."
        )

    def format_result(self, text: str) -> str:
        return f"<tool_response>\n{text}\n</tool_response>"


class GemmaParser(ToolParser):
    """Fenced ```tool_call blocks, the format Gemma 3 was shown for function calling."""

    family = "gemma"
    open_marker = "```tool_call"
    close_marker = "```"
    merge_user_turns = True

    def instruction(self, tools: list[Tool]) -> str:
        listed = "\n".join(_tool_json(tool) for tool in tools)
        return (
            "You have access to functions. If you decide to invoke any of the function(s), "
            "you MUST put it in the format of\n"
            '```tool_call\n{"name": function name, '
            '"arguments": dictionary of argument name and its value}\n```\n'
            "with one block per call. You SHOULD NOT include any other text in the response "
            "if you call a function. Function results are given back in ```tool_output blocks.\n\n"
            f"The functions you can call:\n{listed}"
        )

    def format_result(self, text: str) -> str:
        return f"```tool_output\n{text}\n```"


PARSERS: dict[str, type[ToolParser]] = {
    HermesParser.family: HermesParser,
    GemmaParser.family: GemmaParser,
}


def parser_for(architecture: str) -> ToolParser:
    """The parser of a model's family: Gemma's for "gemma*" architectures, else Hermes'."""
    return GemmaParser() if architecture.startswith("gemma") else HermesParser()
