"""Decode streams for the interference experiment: a fixed number of requests always in flight.

Each slot streams one request of ``output_len`` tokens (``ignore_eos``), then sends the next,
until the deadline, when it hangs up (which aborts the request on the server). Slot i's first
request is shortened to ``output_len * (i + 1) / num_slots`` so that the slots restart at
different times and the batch's context lengths stay spread over a fixed range instead of
growing for the whole run:

    slot 0 |--|--------|--------|---...
    slot 1 |----|--------|--------|-...
    slot 2 |------|--------|--------...
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp

from epdserve.bench.client import ClientConfig, SseParser, request_body
from epdserve.bench.workloads import BenchTokenizer, SampleRequest

# Openings of ordinary prose. Prompts of random token ids make a small greedy model settle into
# short loops that contain a token with no text of its own (a byte piece held back until its
# character is complete); every such token merges two steps into one chunk, a periodic doubled
# gap that has nothing to do with the server.
STREAM_OPENINGS = (
    "The history of the city begins with a small harbour where fishermen",
    "In the morning the train left the station and crossed the long valley where",
    "To build a reliable service, an engineer first writes down what users expect and",
    "The recipe calls for flour, butter, two eggs and a cup of milk, which",
    "Scientists studying the northern forests noticed that the trees",
    "When the library opened its new wing, the first visitors were surprised to find",
    "The committee met on Tuesday to discuss the budget for next year, and",
    "Along the river there is a path that walkers follow in spring because",
)


@dataclass(frozen=True)
class StreamTrace:
    chunk_times_s: tuple[float, ...]  # arrival of each content chunk, seconds since the run started
    error: str


async def read_stream_until(
    session: aiohttp.ClientSession, config: ClientConfig, request: SampleRequest, run_start: float, stop_s: float
) -> StreamTrace:
    """Stream one request and timestamp its content chunks; hang up at ``stop_s`` (seconds since
    ``run_start``, a ``time.perf_counter`` reading)."""
    times: list[float] = []
    parser = SseParser()

    async def collect(response: aiohttp.ClientResponse) -> None:
        async for chunk in response.content.iter_any():
            now_s = time.perf_counter() - run_start
            times.extend(now_s for payload in parser.feed(chunk) if has_text(payload, config.is_chat))

    try:
        async with session.post(config.api_url, json=request_body(config, request)) as response:
            if response.status != 200:
                return StreamTrace((), f"HTTP {response.status}: {(await response.text())[:200]}")
            await asyncio.wait_for(collect(response), max(0.0, stop_s - (time.perf_counter() - run_start)))
    except asyncio.TimeoutError:
        pass
    except aiohttp.ClientError as e:
        return StreamTrace(tuple(times), f"{type(e).__name__}: {e}")
    return StreamTrace(tuple(times), "")


def has_text(payload: str, is_chat: bool) -> bool:
    """Whether an SSE payload is a chunk carrying generated text (vLLM's content chunk)."""
    if payload.strip() == "[DONE]":
        return False
    choices = json.loads(payload).get("choices") or []
    if not choices:
        return False
    return bool((choices[0].get("delta") or {}).get("content") if is_chat else choices[0].get("text"))


async def run_slot(
    session: aiohttp.ClientSession,
    config: ClientConfig,
    tokenizer: BenchTokenizer,
    slot: int,
    num_slots: int,
    output_len: int,
    run_start: float,
    stop_s: float,
) -> list[StreamTrace]:
    """Keep one decode request of slot ``slot`` in flight until ``stop_s``; one trace per request."""
    text = STREAM_OPENINGS[slot % len(STREAM_OPENINGS)]
    prompt_len = tokenizer.count(text)
    num_tokens = max(2, output_len * (slot + 1) // num_slots)
    traces = []
    while time.perf_counter() - run_start < stop_s:
        trace = await read_stream_until(session, config, SampleRequest(text, prompt_len, num_tokens), run_start,
                                        stop_s)
        traces.append(trace)
        if trace.error:
            break
        num_tokens = output_len
    return traces
