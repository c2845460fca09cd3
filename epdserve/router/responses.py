"""OpenAI response objects and stream chunks for one request: its choices (prompts x n), echo,
logprobs, usage, and tool calls parsed out of the text.

Choice ``index`` is ``prompt_index * n + sequence_index`` (a completions batch of prompts, each
with n sequences), as OpenAI and vLLM number them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from epdserve.cluster import messages as m
from epdserve.models.tokenizer import Tokenizer
from epdserve.router.timing import timing_json
from epdserve.router.tools import (
    ToolCall,
    ToolChoice,
    ToolParser,
    ToolStream,
    forced_calls,
    tool_call_deltas,
    tool_calls_json,
)


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's output turns into tool calls: parsed from free text (``auto``)
    with the model family's parser, or read from grammar-forced JSON (``required``, named)."""

    choice: ToolChoice
    parser: ToolParser
    parallel: bool = True  # parallel_tool_calls: false keeps the first call

    @property
    def is_forced(self) -> bool:
        return self.choice.mode in ("required", "named")


class Formatter:
    def __init__(self, request_id: str, model: str, chat: bool, tokenizer: Tokenizer, timing: bool, n: int,
                 num_prompts: int = 1, echo: list[str] | None = None, tools: ToolMode | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.tokenizer = tokenizer
        self.with_timing = timing
        self.n = n
        self.num_choices = n * num_prompts
        self.created = int(time.time())
        self.echo = echo  # per prompt: its text, put before each of its choices' text
        self.tools = tools if tools is not None and tools.choice.mode != "none" else None
        k = self.num_choices
        self.texts = [""] * k
        self.num_tokens = [0] * k
        self.logprobs: list[list[m.TokenLogprob]] = [[] for _ in range(k)]
        self.finish_reasons: list[str | None] = [None] * k
        self.num_finished = 0
        self._echoed = [False] * k
        self._streams: list[ToolStream | None] = [None] * k
        self._num_calls = [0] * k  # tool calls streamed per choice
        self._prompt_tokens = [0] * num_prompts
        self._cached_tokens = [0] * num_prompts

    def add(self, out: m.TokenOutput, prompt_index: int = 0) -> int:
        """Record one output; returns its choice index."""
        i = prompt_index * self.n + out.index
        self.texts[i] += out.text
        self.num_tokens[i] += len(out.token_ids)
        self.logprobs[i] += out.logprobs
        if out.finished:
            self.finish_reasons[i] = out.finish_reason
            self.num_finished += 1
        self._prompt_tokens[prompt_index] = out.num_prompt_tokens or self._prompt_tokens[prompt_index]
        self._cached_tokens[prompt_index] = max(self._cached_tokens[prompt_index], out.num_cached_tokens)
        return i

    @property
    def is_done(self) -> bool:
        return self.num_finished >= self.num_choices

    def _usage(self) -> dict:
        prompt, completion = sum(self._prompt_tokens), sum(self.num_tokens)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if any(self._cached_tokens):
            usage["prompt_tokens_details"] = {"cached_tokens": sum(self._cached_tokens)}
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

    def _body(self, choices: list[dict], timing: m.Timing | None = None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}
        if timing is not None and self.with_timing:
            body["timing"] = timing_json(timing)
        return body

    def role_chunk(self, index: int) -> dict:
        return self._body([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])

    def chunk(self, index: int, out: m.TokenOutput, timing: m.Timing | None = None) -> dict:
        """The stream chunk of one output of choice ``index`` (after ``add``)."""
        finish = out.finish_reason if out.finished else None
        logprobs = self._logprobs_json(out.logprobs)
        text = out.text
        if not self.chat:
            if self.echo is not None and not self._echoed[index]:
                self._echoed[index] = True
                text = self.echo[index // self.n] + text
            return self._body([{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                              timing)
        delta: dict = {"content": text}
        if self.tools is not None and self.tools.choice.mode == "named":
            delta = {"tool_calls": [self._named_delta(index, text)]} if text or out.finished else {}
            if finish == "stop":
                finish = "tool_calls"
        elif self.tools is not None:
            content, calls = self._tool_delta(index, text, out.finished)
            delta = {"content": content} if content or not calls else {}
            if calls:
                delta["tool_calls"] = tool_call_deltas(calls, self._num_calls[index])
                self._num_calls[index] += len(calls)
            if finish == "stop" and self._num_calls[index]:
                finish = "tool_calls"
        return self._body([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], timing)

    def _named_delta(self, index: int, text: str) -> dict:
        """A named tool choice streams as its call: the output is the arguments' JSON, sent as
        it is generated (id, type and name with the first piece, as OpenAI streams calls)."""
        if self._num_calls[index]:
            return {"index": 0, "function": {"arguments": text}}
        self._num_calls[index] = 1
        return {"index": 0, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.tools.choice.name, "arguments": text}}

    def _tool_delta(self, index: int, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """Content to stream now and tool calls completed, for a chat request with tools."""
        tools = self.tools
        if tools.is_forced:
            if not finished:
                return "", []
            calls = self._keep(forced_calls(self.texts[index], tools.choice))
            return ("" if calls else self.texts[index]), calls
        stream = self._streams[index]
        if stream is None:
            stream = self._streams[index] = tools.parser.stream()
        content, calls = stream.feed(text)
        if finished:
            more, last = stream.finish()
            content, calls = content + more, calls + last
        budget = 1 - self._num_calls[index] if not tools.parallel else len(calls)
        return content, calls[:max(budget, 0)]

    def _keep(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.tools.parallel else calls[:1]

    def usage_chunk(self, timing: m.Timing | None) -> dict:
        body = self._body([], timing)
        body["usage"] = self._usage()
        return body

    def _message(self, i: int) -> tuple[dict, str | None]:
        """The assistant message of choice ``i`` and its finish reason."""
        text, finish = self.texts[i], self.finish_reasons[i]
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish
        if self.tools.is_forced:
            content, calls = (None, self._keep(forced_calls(text, self.tools.choice)))
            if not calls:
                content = text
        else:
            content, calls = self.tools.parser.parse(text)
            calls = self._keep(calls)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = tool_calls_json(calls)
            if finish == "stop":
                finish = "tool_calls"
        return message, finish

    def full_response(self, timing: m.Timing | None) -> dict:
        choices = []
        for i in range(self.num_choices):
            logprobs = self._logprobs_json(self.logprobs[i])
            if self.chat:
                message, finish = self._message(i)
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                text = self.texts[i] if self.echo is None else self.echo[i // self.n] + self.texts[i]
                choices.append({"index": i, "text": text, "logprobs": logprobs,
                                "finish_reason": self.finish_reasons[i]})
        body = self._body(choices, timing)
        body["object"] = "chat.completion" if self.chat else "text_completion"
        body["usage"] = self._usage()
        return body
