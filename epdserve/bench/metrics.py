"""Per-request measurements and the aggregate serving metrics, with vLLM's definitions.

    send          first content chunk    content chunk ...  last token chunk
     |---- TTFT ---->|<-- ITL -->|<-- ITL -->| ... |--------->|
     |<------------------------- E2EL (latency) -------------->|

- TTFT: send -> first chunk whose text (``choices[0].text`` or ``delta.content``) is non-empty.
- ITL: every gap between successive content chunks, pooled over all completed requests.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token.
- Goodput: completed requests per second that meet every given SLO; a failed request is a miss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from epdserve.service import SERVICE_CLASSES, ClassSLO

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
SLO_NAMES = ("ttft", "tpot", "e2el")
# Keys of a server's per-request ``timing`` object that decompose TTFT, each in milliseconds.
TTFT_COMPONENTS = ("queue_ms", "encode_ms", "prefill_ms", "exposed_transfer_ms", "first_token_ms")


@dataclass(frozen=True)
class RequestOutput:
    """What the client measured for one request. Times are seconds from ``time.perf_counter``."""

    success: bool
    start_s: float  # send time, seconds since the benchmark started
    latency_s: float  # send -> last token chunk; send -> failure for a failed request
    ttft_s: float  # send -> first content chunk; 0.0 for a failed request
    itl_s: tuple[float, ...]  # gaps between successive content chunks
    prompt_len: int  # the server's usage.prompt_tokens when reported, else the dataset's count
    output_tokens: int | None  # the server's usage.completion_tokens; None when not reported
    generated_text: str
    error: str  # empty when success
    timing: Mapping[str, Any] | None = None  # the server's raw ``timing`` object, if any


@dataclass(frozen=True)
class MetricSummary:
    """Statistics of one metric over its samples, in milliseconds; 0.0 when there are none."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: tuple[tuple[float, float], ...]  # (percentile, value)


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    total_input: int  # prompt tokens of completed requests
    total_output: int  # output tokens of completed requests
    request_throughput: float  # completed requests / s
    request_goodput: float | None  # requests / s meeting every SLO; None without SLOs
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output tokens) / s
    output_lens: tuple[int, ...]  # per request, 0 for a failed one
    summaries: Mapping[str, MetricSummary]  # keyed by METRIC_NAMES


def percentile_label(p: float) -> str:
    """``99.0`` -> ``"99"``, ``99.9`` -> ``"99.9"``: the spelling of vLLM's ``pN_X_ms`` keys."""
    return str(int(p)) if int(p) == p else str(p)


def summarize(values_s: Sequence[float], percentiles: Sequence[float]) -> MetricSummary:
    """Mean, median, std and percentiles of samples in seconds, reported in milliseconds."""
    data = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    return MetricSummary(
        mean_ms=float(np.mean(data)),
        median_ms=float(np.median(data)),
        std_ms=float(np.std(data)),
        percentiles_ms=tuple((float(p), float(np.percentile(data, p))) for p in percentiles),
    )


def output_token_count(output: RequestOutput, count_tokens: Callable[[str], int] | None) -> int:
    """Output tokens of a completed request: the server's usage count when it reported one, else
    the tokenizer's count of the generated text, else the number of content chunks."""
    if output.output_tokens is not None:
        return output.output_tokens
    if count_tokens is not None:
        return count_tokens(output.generated_text)
    return len(output.itl_s) + 1


def compute_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    percentiles: Sequence[float],
    goodput_slos_ms: Mapping[str, float] | None = None,
    count_tokens: Callable[[str], int] | None = None,
) -> BenchMetrics:
    """Aggregate per-request outputs of a run that took ``duration_s`` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    slos_s = {name: ms / 1000.0 for name, ms in (goodput_slos_ms or {}).items()}
    unknown = set(slos_s) - set(SLO_NAMES)
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use {', '.join(SLO_NAMES)}")
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    output_lens: list[int] = []
    total_input = 0
    num_good = 0
    for out in outputs:
        if not out.success:
            output_lens.append(0)
            continue
        num_tokens = output_token_count(out, count_tokens)
        output_lens.append(num_tokens)
        total_input += out.prompt_len
        # A one-token output has no TPOT; it counts as 0 against a TPOT SLO (vLLM's rule).
        tpot = (out.latency_s - out.ttft_s) / (num_tokens - 1) if num_tokens > 1 else 0.0
        if num_tokens > 1:
            tpots.append(tpot)
        ttfts.append(out.ttft_s)
        itls.extend(out.itl_s)
        e2els.append(out.latency_s)
        observed = {"ttft": out.ttft_s, "tpot": tpot, "e2el": out.latency_s}
        if slos_s and all(observed[name] <= slo for name, slo in slos_s.items()):
            num_good += 1
    completed = len(ttfts)
    total_output = sum(output_lens)
    samples = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    return BenchMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration_s,
        request_goodput=num_good / duration_s if slos_s else None,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        output_lens=tuple(output_lens),
        summaries={name: summarize(samples[name], percentiles) for name in METRIC_NAMES},
    )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def ttft_breakdown_ms(outputs: Sequence[RequestOutput]) -> dict[str, dict[str, float]]:
    """Mean and p99 of each TTFT component the server reported, over completed requests.

    Only components present as numbers in at least one ``timing`` object appear; the result is
    empty when the server returned no timing at all.
    """
    breakdown: dict[str, dict[str, float]] = {}
    for key in TTFT_COMPONENTS:
        values = [
            float(out.timing[key])
            for out in outputs
            if out.success and out.timing is not None and _is_number(out.timing.get(key))
        ]
        if values:
            breakdown[key] = {"mean": float(np.mean(values)), "p99": float(np.percentile(values, 99))}
    return breakdown


def class_attainment(outputs: Sequence[RequestOutput], classes: Sequence[str], slos: Mapping[str, ClassSLO],
                     count_tokens: Callable[[str], int] | None = None) -> dict[str, dict[str, Any]]:
    """Per service class (``classes[i]`` is request i's): requests, those refused at admission
    (HTTP 429), completed, and of the completed those that met the class's SLO
    (``ClassSLO.is_met``, the router's rule; None without an SLO)."""
    out: dict[str, dict[str, Any]] = {}
    for name in SERVICE_CLASSES:
        mine = [o for o, c in zip(outputs, classes) if c == name]
        if not mine:
            continue
        done = [o for o in mine if o.success]
        slo = slos.get(name)
        met = None
        if slo is not None:
            met = 0
            for o in done:
                n = output_token_count(o, count_tokens)
                met += slo.is_met(o.ttft_s, (o.latency_s - o.ttft_s) / (n - 1) if n > 1 else None)
        out[name] = {"num_requests": len(mine), "num_refused": sum(1 for o in mine if "HTTP 429" in o.error),
                     "num_completed": len(done), "num_slo_met": met,
                     "attainment_of_completed": met / len(done) if met is not None and done else None,
                     "attainment": met / len(mine) if met is not None else None}
    return out
