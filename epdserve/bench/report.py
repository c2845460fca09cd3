"""The benchmark's result: a JSON dict with vLLM's key names, and the printed summary table."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from epdserve.bench import BenchError
from epdserve.bench.metrics import METRIC_NAMES, BenchMetrics, RequestOutput, percentile_label

# (metric, short name, section header), in vLLM's order and wording.
METRIC_HEADERS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
TABLE_WIDTH = 50


@dataclass(frozen=True)
class RunInfo:
    """How the run was configured: the header fields of the result."""

    backend: str  # "openai" (/v1/completions) or "openai-chat", as vLLM names them
    model_id: str
    tokenizer_id: str
    num_prompts: int
    request_rate: float  # requests / s; inf: all at once
    burstiness: float
    max_concurrency: int | None


def build_result(
    info: RunInfo,
    outputs: Sequence[RequestOutput],
    duration_s: float,
    metrics: BenchMetrics,
    percentile_metrics: Sequence[str] = METRIC_NAMES,
    ttft_breakdown: Mapping[str, Mapping[str, float]] | None = None,
    service_classes: Mapping[str, Mapping[str, Any]] | None = None,
    request_classes: Sequence[str] | None = None,
    goodput_slos_ms: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The result dict; per-request lists are in request order, times in seconds.
    ``service_classes``: attainment per class (``metrics.class_attainment``), with each
    request's class in ``request_classes``; ``goodput_slos_ms``: the SLOs goodput counted
    against (kept, so that two results' goodputs are compared only when they agree)."""
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": info.backend,
        "backend": info.backend,
        "model_id": info.model_id,
        "tokenizer_id": info.tokenizer_id,
        "num_prompts": info.num_prompts,
        "request_rate": "inf" if math.isinf(info.request_rate) else info.request_rate,
        "burstiness": info.burstiness,
        "max_concurrency": info.max_concurrency,
        "duration": duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "goodput_slos_ms": dict(goodput_slos_ms) if goodput_slos_ms else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [out.prompt_len for out in outputs],
        "output_lens": list(metrics.output_lens),
        "ttfts": [out.ttft_s for out in outputs],
        "itls": [list(out.itl_s) for out in outputs],
        "latencies": [out.latency_s for out in outputs],
        "start_times": [out.start_s for out in outputs],
        "generated_texts": [out.generated_text for out in outputs],
        "errors": [out.error for out in outputs],
    }
    for name in METRIC_NAMES:
        if name not in percentile_metrics:
            continue
        summary = metrics.summaries[name]
        result[f"mean_{name}_ms"] = summary.mean_ms
        result[f"median_{name}_ms"] = summary.median_ms
        result[f"std_{name}_ms"] = summary.std_ms
        for p, value in summary.percentiles_ms:
            result[f"p{percentile_label(p)}_{name}_ms"] = value
    if any(out.timing is not None for out in outputs):
        result["timings"] = [dict(out.timing) if out.timing is not None else None for out in outputs]
    if ttft_breakdown:
        result["ttft_breakdown_ms"] = {k: dict(v) for k, v in ttft_breakdown.items()}
    if service_classes:
        result["service_classes"] = {k: dict(v) for k, v in service_classes.items()}
        result["request_service_classes"] = list(request_classes or [])
    return result


def _header(text: str, fill: str) -> str:
    return f"{text:{fill}^{TABLE_WIDTH}}"


def _row(label: str, value: float, decimals: bool = True) -> str:
    return f"{label:<40} {value:<10.2f}" if decimals else f"{label:<40} {value:<10}"


def format_table(result: Mapping[str, Any], percentile_metrics: Sequence[str] = METRIC_NAMES) -> str:
    """The summary vLLM prints after a run, from a ``build_result`` dict."""
    lines = [
        _header(" Serving Benchmark Result ", "="),
        _row("Successful requests:", result["completed"], decimals=False),
        _row("Failed requests:", result["failed"], decimals=False),
    ]
    if result["max_concurrency"] is not None:
        lines.append(_row("Maximum request concurrency:", result["max_concurrency"], decimals=False))
    if result["request_rate"] != "inf":
        lines.append(_row("Request rate configured (RPS):", result["request_rate"]))
    lines += [
        _row("Benchmark duration (s):", result["duration"]),
        _row("Total input tokens:", result["total_input_tokens"], decimals=False),
        _row("Total generated tokens:", result["total_output_tokens"], decimals=False),
        _row("Request throughput (req/s):", result["request_throughput"]),
    ]
    if result["request_goodput"] is not None:
        lines.append(_row("Request goodput (req/s):", result["request_goodput"]))
    lines += [
        _row("Output token throughput (tok/s):", result["output_throughput"]),
        _row("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for name, short, header in METRIC_HEADERS:
        if name not in percentile_metrics:
            continue
        lines += [
            _header(header, "-"),
            _row(f"Mean {short} (ms):", result[f"mean_{name}_ms"]),
            _row(f"Median {short} (ms):", result[f"median_{name}_ms"]),
        ]
        prefix, suffix = "p", f"_{name}_ms"
        for key, value in result.items():
            if key.startswith(prefix) and key.endswith(suffix) and key[1].isdigit():
                lines.append(_row(f"P{key[len(prefix) : -len(suffix)]} {short} (ms):", value))
    breakdown = result.get("ttft_breakdown_ms")
    if breakdown:
        lines.append(_header("TTFT Breakdown (server timing, ms)", "-"))
        for component, stats in breakdown.items():
            lines.append(_row(f"Mean {component}:", stats["mean"]))
            lines.append(_row(f"P99 {component}:", stats["p99"]))
    classes = result.get("service_classes")
    if classes:
        lines.append(_header("Service classes", "-"))
        for name, c in classes.items():
            met = "" if c["attainment"] is None else f", SLO met {100 * c['attainment_of_completed']:.0f} % of completed" if c["num_completed"] else ""
            lines.append(f"{name + ':':<14} {c['num_requests']} requests, {c['num_refused']} refused, "
                         f"{c['num_completed']} completed{met}")
    lines.append("=" * TABLE_WIDTH)
    return "\n".join(lines)


def write_result_json(result: Mapping[str, Any], path: str) -> None:
    """Write the result as one JSON object, creating parent directories."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            json.dump(result, f, ensure_ascii=False)
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e.strerror}") from None
