"""Per-request records of a simulation, turned into bench's result (same keys, same metrics).

Each completed request decomposes its TTFT from its simulated moments (``Flight``, named by
``request.EventType``), in milliseconds::

    arrived ─queue─▶ encode_start ─encode─▶ encode_end ─queue─▶ prefill_start
            ─prefill─▶ prefill_end ─▶ first_token

by the server's own rule (``router/timing.py`` ``ttft_parts_s``): the queue is every wait, for
an encoder and then for the prefill step (without images it ends at ``prefill_start``), the
encode part runs from the first of its images' batches beginning to its last embedding in, and
prefill counts from max(prefill_start, encode_end).

The first token is sampled by the prefill (or colocated) instance and streamed at once, so
``first_token_ms`` is 0 and the components add up to TTFT. ``exposed_transfer_ms`` is the
KV transfer still in flight after the prefill step ended: it delays the second token.

Inter-token gaps and per-request ``timing`` objects are kept for every ``detail_every``-th
request only (all of them up to ``max_detail_requests``), so a million-request run fits in
memory; TTFT, TPOT and E2E cover every request.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from epdserve.bench.metrics import TTFT_COMPONENTS, RequestOutput, compute_metrics
from epdserve.bench.report import RunInfo, build_result
from epdserve.request import EventType
from epdserve.router.timing import ttft_parts_s

FLIGHT_EVENTS = (EventType.ARRIVED, EventType.ENCODE_START, EventType.ENCODE_END, EventType.PREFILL_START,
                 EventType.PREFILL_END, EventType.KV_TRANSFER_END, EventType.FIRST_TOKEN, EventType.FINISHED)
# A detail request's ``timing`` object: these moments, keyed by value as bench's timings are.
DETAIL_EVENTS = (EventType.ARRIVED, EventType.PREFILL_START, EventType.PREFILL_END, EventType.KV_TRANSFER_END,
                 EventType.FIRST_TOKEN, EventType.FINISHED)


class Flight:
    """One request while it is in the simulated cluster (times: seconds, sim clock).

    Its moments are named by ``request.EventType`` values, as ``messages.Timing``'s fields are
    (``flight.prefill_start`` is ``flight.at(EventType.PREFILL_START)``); None: not yet.
    ``encode_end`` (all embeddings in) is the arrival for a request without images.
    """

    __slots__ = (
        *(event.value for event in FLIGHT_EVENTS),
        "colocated",
        "decode",
        "encoders",
        "index",
        "kv_exposed_s",
        "kv_sent",
        "mm_inputs",
        "num_cached_tokens",
        "num_decode_cached",
        "num_handed_over",
        "num_output",
        "num_pending_images",
        "predicted_ttft_s",
        "num_prompt",
        "prefill",
        "prompt",
        "prompt_blocks",
        "key",
        "request_id",
        "token_times",
    )

    def __init__(self, index: int, arrived: float, num_prompt: int, num_output: int, prompt: list[int]) -> None:
        self.index = index
        self.request_id = str(index)
        self.arrived = self.encode_end = arrived
        self.encode_start = None  # the first of its images' encoder batches began (None: no images)
        self.prefill_start = self.prefill_end = self.kv_transfer_end = self.first_token = self.finished = None
        self.num_prompt = num_prompt
        self.num_output = num_output
        self.prompt = prompt
        self.prompt_blocks = None  # router/workers.py PromptBlocks (prefix-aware routing, decode reservations)
        self.key = 0  # queue order (epdserve.service.schedule_key; 0: interactive)
        self.kv_exposed_s = 0.0  # KV transfer still in flight when the prefill step ended (a duration)
        self.kv_sent = 0  # prompt tokens whose KV is queued on the prefill instance's link
        self.token_times: list[float] | None = None  # detail requests only
        self.colocated = self.prefill = self.decode = None  # instances
        self.encoders: dict = {}  # encode instance -> images of this request not yet encoded there
        self.num_pending_images = 0
        self.mm_inputs: list = []
        self.num_cached_tokens = 0
        self.num_decode_cached = 0  # P/D: leading prompt tokens its decode instance's reservation found cached
        self.num_handed_over = 0  # tokens generated before its decode instance handed it over
        self.predicted_ttft_s = None  # predictive admission's prediction (before its correction)

    def at(self, event: EventType) -> float | None:
        """When ``event`` happened (None: not yet); ``event`` is one of ``FLIGHT_EVENTS``."""
        return getattr(self, event.value)


class MissWatch:
    """Ends a run early once it can no longer meet an SLO: requests that already missed a
    per-request threshold (failed; TTFT, TPOT or E2E over) are counted against the misses
    the attainment target allows and against each percentile target's allowance."""

    def __init__(self, num_requests: int, thresholds_s: Mapping[str, float], percentiles: Mapping[str, float],
                 attainment: float) -> None:
        n = num_requests
        self.thresholds_s = {k: v for k, v in thresholds_s.items() if math.isfinite(v)}
        self.budgets = {k: n - math.ceil(p / 100.0 * n) for k, p in percentiles.items() if k in self.thresholds_s}
        self.joint_budget = math.floor((1.0 - attainment) * n + 1e-9)
        self.misses = dict.fromkeys(self.budgets, 0)
        self.missed: set[int] = set()
        self.is_hopeless = False

    def _miss(self, index: int, metric: str | None) -> None:
        if metric in self.misses:
            self.misses[metric] += 1
            if self.misses[metric] > self.budgets[metric]:
                self.is_hopeless = True
        if index not in self.missed:
            self.missed.add(index)
            if len(self.missed) > self.joint_budget:
                self.is_hopeless = True

    def on_first_token(self, index: int, ttft_s: float) -> None:
        if ttft_s > self.thresholds_s.get("ttft", math.inf):
            self._miss(index, "ttft")

    def on_complete(self, index: int, tpot_s: float, e2el_s: float) -> None:
        if tpot_s > self.thresholds_s.get("tpot", math.inf):
            self._miss(index, "tpot")
        if e2el_s > self.thresholds_s.get("e2el", math.inf):
            self._miss(index, "e2el")

    def on_fail(self, index: int) -> None:
        for metric in ("ttft", "tpot", "e2el"):
            if metric in self.misses:
                self._miss(index, metric)
        self._miss(index, None)


class Recorder:
    def __init__(self, num_requests: int, max_detail_requests: int, watch: MissWatch | None = None) -> None:
        n = num_requests
        self.watch = watch
        self.detail_every = max(1, math.ceil(n / max_detail_requests)) if max_detail_requests > 0 else 0
        self.is_done = np.zeros(n, dtype=bool)
        self.is_ok = np.zeros(n, dtype=bool)
        self.start = np.zeros(n)
        self.latency = np.zeros(n)
        self.ttft = np.zeros(n)
        self.prompt_len = np.zeros(n, dtype=np.int64)
        self.output_len = np.zeros(n, dtype=np.int64)
        self.components = {key: np.zeros(n) for key in TTFT_COMPONENTS}
        self.errors: dict[int, str] = {}
        self.itls: dict[int, tuple[float, ...]] = {}
        self.timings: dict[int, dict] = {}
        self.end_s = 0.0

    def is_detail(self, index: int) -> bool:
        return self.detail_every > 0 and index % self.detail_every == 0

    def fail(self, index: int, arrival: float, prompt_len: int, error: str, now: float) -> None:
        self.is_done[index] = True
        self.start[index] = arrival
        self.latency[index] = now - arrival
        self.prompt_len[index] = prompt_len
        self.errors[index] = error
        self.end_s = max(self.end_s, now)
        if self.watch is not None:
            self.watch.on_fail(index)

    def complete(self, f: Flight, num_output: int) -> None:
        """``f`` finished (at ``f.finished``) with ``num_output`` tokens."""
        i, now, arrived, first_token = f.index, f.finished, f.arrived, f.first_token
        self.is_done[i] = self.is_ok[i] = True
        self.start[i] = arrived
        self.latency[i] = now - arrived
        self.ttft[i] = first_token - arrived
        self.prompt_len[i] = f.num_prompt
        self.output_len[i] = num_output
        if self.watch is not None:
            tpot = (now - first_token) / (num_output - 1) if num_output > 1 else 0.0
            self.watch.on_complete(i, tpot, now - arrived)
        encode_end = None if f.encode_start is None else f.encode_end  # no images: no encode part
        queue, encode, prefill, first = ttft_parts_s(arrived, f.encode_start, encode_end, f.prefill_start,
                                                     f.prefill_end, first_token)
        parts = {
            "queue_ms": queue * 1e3,
            "encode_ms": encode * 1e3,
            "prefill_ms": prefill * 1e3,
            "exposed_transfer_ms": f.kv_exposed_s * 1e3,
            "first_token_ms": first * 1e3,
        }
        for key, value in parts.items():
            self.components[key][i] = value
        if f.token_times is not None:
            times = f.token_times
            self.itls[i] = tuple(b - a for a, b in itertools.pairwise(times))
            self.timings[i] = {
                **{e.value: f.at(e) or 0.0 for e in DETAIL_EVENTS},
                "num_cached_tokens": f.num_cached_tokens, **{k: round(v, 6) for k, v in parts.items()},
                "ttft_ms": (first_token - arrived) * 1e3, "e2e_ms": (now - arrived) * 1e3,
            }
        self.end_s = max(self.end_s, now)

    def outputs(self) -> list[RequestOutput]:
        out = []
        for i in range(len(self.is_done)):
            if not self.is_done[i]:
                raise RuntimeError(f"request {i} never finished")
            if self.is_ok[i]:
                out.append(RequestOutput(True, float(self.start[i]), float(self.latency[i]), float(self.ttft[i]),
                                         self.itls.get(i, ()), int(self.prompt_len[i]), int(self.output_len[i]),
                                         "", "", self.timings.get(i)))
            else:
                out.append(RequestOutput(False, float(self.start[i]), float(self.latency[i]), 0.0, (),
                                         int(self.prompt_len[i]), None, "", self.errors[i]))
        return out

    def ttft_breakdown_ms(self) -> dict[str, dict[str, float]]:
        """Mean and p99 of each TTFT component over completed requests (bench's shape)."""
        if not self.is_ok.any():
            return {}
        return {key: {"mean": float(np.mean(v[self.is_ok])), "p99": float(np.percentile(v[self.is_ok], 99))}
                for key, v in self.components.items()}


def build_sim_result(recorder: Recorder, model_id: str, request_rate: float, burstiness: float,
                     percentiles: Sequence[float], goodput_slos_ms: Mapping[str, float] | None,
                     simulator: Mapping[str, Any]) -> dict[str, Any]:
    """bench's result dict for the simulated run, plus a ``simulator`` section."""
    outputs = recorder.outputs()
    duration = max(recorder.end_s, 1e-9)
    metrics = compute_metrics(outputs, duration, percentiles, goodput_slos_ms)
    info = RunInfo(backend="epdserve-sim", model_id=model_id, tokenizer_id=model_id, num_prompts=len(outputs),
                   request_rate=request_rate, burstiness=burstiness, max_concurrency=None)
    result = build_result(info, outputs, duration, metrics, ttft_breakdown=recorder.ttft_breakdown_ms(),
                          goodput_slos_ms=goodput_slos_ms)
    result["simulator"] = {**simulator, "itl_sampled_every": recorder.detail_every}
    return result
