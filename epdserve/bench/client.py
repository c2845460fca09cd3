"""The load generator: streaming requests to an OpenAI-compatible endpoint, sent on schedule.

Each request streams (``"stream": true``) and asks for usage in the last chunk
(``stream_options.include_usage``). Timestamps are taken with ``time.perf_counter`` when a
network read returns, before parsing, so parsing cost does not inflate the measured gaps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from epdserve.bench import BenchError
from epdserve.bench.metrics import RequestOutput
from epdserve.bench.workloads import SampleRequest

SERVER_CHECK_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ClientConfig:
    api_url: str  # base URL + endpoint
    model: str
    is_chat: bool  # /v1/chat/completions (messages) rather than /v1/completions (prompt)
    temperature: float = 0.0
    ignore_eos: bool = False
    return_timing: bool = False  # ask the server for its per-request ``timing`` object
    api_key: str | None = None
    timeout_s: float = 6 * 60 * 60  # whole-request limit, seconds (vLLM's client uses 6 h)
    max_concurrency: int | None = None  # requests in flight at once; None: unlimited

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.timeout_s <= 0:
            raise BenchError(f"--timeout must be > 0, got {self.timeout_s}")


class SseParser:
    """Incremental Server-Sent Events parser: bytes in, the ``data`` payload of each event out."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Payloads of the events this chunk completes; comment lines (``:``) are dropped."""
        self._buffer += chunk
        events = []
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:
                if self._data_lines:
                    events.append("\n".join(self._data_lines))
                    self._data_lines = []
            elif line.startswith("data:"):
                self._data_lines.append(line[5:].removeprefix(" "))
        return events

    def close(self) -> list[str]:
        """Payloads of an event the stream ended without terminating."""
        return self.feed(b"\n\n") if self._buffer or self._data_lines else []


def request_body(config: ClientConfig, request: SampleRequest) -> dict[str, Any]:
    """The JSON body: ``prompt`` for /v1/completions, one user message for chat."""
    body: dict[str, Any] = {"model": config.model, "max_tokens": request.expected_output_len}
    if config.is_chat:
        content: str | list[dict[str, Any]] = request.prompt
        if request.images:
            content = [{"type": "text", "text": request.prompt}] + [
                {"type": "image_url", "image_url": {"url": url}} for url in request.images
            ]
        body["messages"] = [{"role": "user", "content": content}]
        body["max_completion_tokens"] = request.expected_output_len
    else:
        body["prompt"] = request.prompt
    body.update(temperature=config.temperature, stream=True, stream_options={"include_usage": True})
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.return_timing:
        body["return_timing"] = True
    if request.service_tier is not None:
        body["service_tier"] = request.service_tier
    return body


def _error_message(payload: object) -> str:
    if isinstance(payload, dict):
        inner = payload.get("error", payload)
        if isinstance(inner, dict):
            return str(inner.get("message") or inner)
        return str(inner)
    return str(payload)


class _Stream:
    """Accumulates one response's chunks; times in seconds since the request was sent."""

    def __init__(self, is_chat: bool) -> None:
        self.is_chat = is_chat
        self.first_content_s: float | None = None
        self.first_choice_s: float | None = None
        self.last_content_s = 0.0
        self.last_choice_s = 0.0
        self.itl_s: list[float] = []
        self.text: list[str] = []
        self.usage: dict[str, Any] = {}
        self.timing: dict[str, Any] | None = None
        self.error = ""

    def add(self, data: dict[str, Any], now_s: float) -> None:
        if data.get("error") is not None:
            self.error = f"server error: {_error_message(data)}"
        if isinstance(data.get("timing"), dict):
            self.timing = data["timing"]
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        choices = data.get("choices")
        if not choices:
            return
        choice = choices[0]
        text = (choice.get("delta") or {}).get("content") if self.is_chat else choice.get("text")
        if text is None and self.is_chat:
            text = (choice.get("message") or {}).get("content")
        if self.first_choice_s is None:
            self.first_choice_s = now_s
        self.last_choice_s = now_s
        if not text:
            return
        if self.first_content_s is None:
            self.first_content_s = now_s
        else:
            self.itl_s.append(now_s - self.last_content_s)
        self.last_content_s = now_s
        self.text.append(text)

    def output(self, request: SampleRequest, start_s: float, end_s: float) -> RequestOutput:
        ttft = self.first_content_s if self.first_content_s is not None else self.first_choice_s
        error = self.error or ("" if ttft is not None else "the stream ended before any token")
        success = not error
        completion_tokens = self.usage.get("completion_tokens")
        prompt_tokens = self.usage.get("prompt_tokens")
        return RequestOutput(
            success=success,
            start_s=start_s,
            latency_s=self.last_choice_s if success else end_s,
            ttft_s=ttft if success and ttft is not None else 0.0,
            itl_s=tuple(self.itl_s) if success else (),
            prompt_len=prompt_tokens if isinstance(prompt_tokens, int) else request.prompt_len,
            output_tokens=completion_tokens if isinstance(completion_tokens, int) else None,
            generated_text="".join(self.text),
            error=error,
            timing=self.timing,
        )


def _headers(config: ClientConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def send_request(
    session: aiohttp.ClientSession, config: ClientConfig, request: SampleRequest, bench_start: float
) -> RequestOutput:
    """Send one streaming request and measure it; failures are returned, never raised."""
    stream = _Stream(config.is_chat)
    sent = time.perf_counter()
    try:
        async with session.post(
            config.api_url,
            json=request_body(config, request),
            headers=_headers(config),
            timeout=aiohttp.ClientTimeout(total=config.timeout_s),
        ) as response:
            if response.status != 200:
                body = await response.text()
                with contextlib.suppress(ValueError):
                    body = _error_message(json.loads(body))
                stream.error = f"HTTP {response.status}: {body.strip()[:500] or response.reason}"
            elif response.content_type == "application/json":
                stream.add(await response.json(), time.perf_counter() - sent)
            else:
                parser = SseParser()
                async for chunk in response.content.iter_any():
                    now_s = time.perf_counter() - sent
                    for payload in parser.feed(chunk):
                        _add_payload(stream, payload, now_s)
                for payload in parser.close():
                    _add_payload(stream, payload, time.perf_counter() - sent)
    except asyncio.TimeoutError:
        stream.error = f"timed out after {config.timeout_s:g} s"
    except (aiohttp.ClientError, ValueError, UnicodeDecodeError) as e:
        stream.error = f"{type(e).__name__}: {e}"
    end_s = time.perf_counter() - sent
    return stream.output(request, sent - bench_start, end_s)


def _add_payload(stream: _Stream, payload: str, now_s: float) -> None:
    if payload.strip() == "[DONE]":
        return
    data = json.loads(payload)
    if isinstance(data, dict):
        stream.add(data, now_s)


async def list_models(
    base_url: str, api_key: str | None, timeout_s: float = SERVER_CHECK_TIMEOUT_S
) -> list[str]:
    """Model ids served at ``base_url`` (``GET /v1/models``); raises BenchError when unreachable.

    A server that answers with an error status is reachable: the list is then empty.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{base_url}/v1/models", headers=headers) as response,
        ):
            if response.status != 200:
                return []
            data = await response.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        raise BenchError(f"cannot reach server at {base_url} ({type(e).__name__})") from None
    except ValueError:
        return []
    items = data.get("data") if isinstance(data, dict) else None
    return [m["id"] for m in items or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]


@dataclass(frozen=True)
class BenchRun:
    outputs: tuple[RequestOutput, ...]  # in request order
    duration_s: float  # first send scheduled -> last request done


async def run_benchmark(
    config: ClientConfig,
    requests: Sequence[SampleRequest],
    arrival_offsets_s: Sequence[float],
    progress: Any = None,
) -> BenchRun:
    """Send ``requests[i]`` at ``arrival_offsets_s[i]`` seconds after the start, at most
    ``max_concurrency`` in flight; a request that has arrived waits for a free slot."""
    if len(arrival_offsets_s) != len(requests):
        raise ValueError("one arrival time per request is required")
    limit = config.max_concurrency or 0  # aiohttp: 0 is no connection limit
    semaphore = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
    connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=60)
    no_timeout = aiohttp.ClientTimeout(total=None)  # each request sets its own

    async with aiohttp.ClientSession(connector=connector, timeout=no_timeout) as session:

        async def limited(request: SampleRequest) -> RequestOutput:
            async with semaphore:
                output = await send_request(session, config, request, bench_start)
            if progress is not None:
                progress.update(1)
            return output

        bench_start = time.perf_counter()
        tasks = []
        for request, offset_s in zip(requests, arrival_offsets_s):
            delay_s = bench_start + offset_s - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            tasks.append(asyncio.create_task(limited(request)))
        outputs = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - bench_start
    return BenchRun(tuple(outputs), duration_s)
