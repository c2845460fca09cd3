"""The flag groups and client set-up that ``bench serve`` (cli.py) and ``bench sweep``
(sweep.py) share: target, workload and sampling flags (named as in ``vllm bench serve``), their
parsing, and the workload and client they build."""

from __future__ import annotations

import argparse
import asyncio
import math
from typing import TYPE_CHECKING

from epdserve.bench import BenchError
from epdserve.bench.metrics import METRIC_NAMES, SLO_NAMES

if TYPE_CHECKING:
    from epdserve.bench.client import ClientConfig
    from epdserve.bench.workloads import BenchTokenizer, Workload

DEFAULT_NUM_PROMPTS = 1000  # random and sharegpt; a trace defaults to all its requests


def add_target_args(p: argparse.ArgumentParser) -> None:
    """Which server, model and endpoint; shared by ``bench serve`` and ``bench sweep``."""
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name sent in requests (default: first of /v1/models)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, or a directory holding one")
    p.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--timeout", type=float, default=6 * 60 * 60, help="per-request limit in seconds")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The dataset flags; shared by ``bench serve`` and ``bench sweep``."""
    d = p.add_argument_group("workload")
    d.add_argument(
        "--dataset", "--dataset-name", dest="dataset", default="random", help="random, random-mm, sharegpt, trace"
    )
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON file, or a trace: Mooncake JSONL or Azure CSV (*.csv)")
    d.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests to send (default {DEFAULT_NUM_PROMPTS}; a trace: all of it)",
    )
    d.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens")
    d.add_argument("--random-output-len", type=int, default=128, help="output tokens")
    d.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 +- R)")
    d.add_argument("--random-mm-base-items-per-request", type=int, default=1, help="random-mm: images per request")
    d.add_argument("--random-mm-num-mm-items-range-ratio", type=float, default=0.0,
                   help="random-mm: images per request uniform in base*(1 +- R)")
    d.add_argument("--random-mm-resolutions", default="512x512", help="random-mm: image sizes WxH[,WxH...], one drawn per image")
    d.add_argument("--sharegpt-output-len", type=int, default=None, help="fixed output length for sharegpt")
    d.add_argument("--trace-time-scale", type=float, default=1.0, help="multiplies trace timestamps")
    d.add_argument("--trace-length-scale", type=float, default=1.0, help="multiplies trace token lengths")
    d.add_argument("--seed", type=int, default=0)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Sampling flags; shared by ``bench serve`` and ``bench sweep``."""
    s = p.add_argument_group("sampling")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="generate exactly max_tokens (default: on for random and trace)",
    )


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            raise BenchError(f"--goodput takes KEY:MS pairs, got {pair!r}") from None
        if name not in SLO_NAMES:
            raise BenchError(f"--goodput metric must be one of {', '.join(SLO_NAMES)}, got {name!r}")
        if slos[name] < 0:
            raise BenchError(f"--goodput value must be >= 0 ms, got {pair!r}")
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise BenchError(f"--metric-percentiles takes comma-separated numbers, got {text!r}") from None
    if not all(0.0 <= p <= 100.0 for p in values):
        raise BenchError(f"percentiles must be in [0, 100], got {text!r}")
    return values


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown or not names:
        raise BenchError(f"--percentile-metrics takes names from {','.join(METRIC_NAMES)}, got {text!r}")
    return names


def load_workload(ns: argparse.Namespace, tokenizer: BenchTokenizer) -> Workload:
    """The requests and (for a trace) their send times, from the dataset flags."""
    from epdserve.bench.workloads import (
        DATASETS,
        Workload,
        random_requests,
        sharegpt_requests,
        trace_requests,
    )

    if ns.dataset not in DATASETS:
        raise BenchError(f"unknown dataset {ns.dataset!r}; choose one of {', '.join(DATASETS)}")
    if ns.num_prompts is not None and ns.num_prompts < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
    if ns.dataset == "random-mm":
        from epdserve.bench.mm_workloads import parse_resolutions, random_mm_requests

        if not ns.endpoint.rstrip("/").endswith("chat/completions"):
            raise BenchError("--dataset random-mm sends images: use --endpoint /v1/chat/completions")
        requests = random_mm_requests(
            tokenizer, ns.num_prompts or DEFAULT_NUM_PROMPTS, ns.random_input_len, ns.random_output_len,
            ns.random_range_ratio, ns.seed, ns.random_mm_base_items_per_request,
            ns.random_mm_num_mm_items_range_ratio, parse_resolutions(ns.random_mm_resolutions),
        )
        return Workload(tuple(requests), None)
    if ns.dataset == "random":
        if ns.dataset_path is not None:
            raise BenchError("--dataset random takes no --dataset-path (use sharegpt or trace)")
        num_prompts = ns.num_prompts or DEFAULT_NUM_PROMPTS
        requests = random_requests(
            tokenizer, num_prompts, ns.random_input_len, ns.random_output_len, ns.random_range_ratio, ns.seed
        )
        return Workload(tuple(requests), None)
    if ns.dataset_path is None:
        raise BenchError(f"--dataset {ns.dataset} needs --dataset-path FILE")
    if ns.dataset == "sharegpt":
        requests = sharegpt_requests(
            tokenizer, ns.dataset_path, ns.num_prompts or DEFAULT_NUM_PROMPTS, ns.seed, ns.sharegpt_output_len
        )
        return Workload(tuple(requests), None)
    if not math.isinf(ns.request_rate):
        raise BenchError(
            "--request-rate does not apply to a trace (it is replayed at its timestamps; "
            "see --trace-time-scale)"
        )
    return trace_requests(
        tokenizer, ns.dataset_path, ns.num_prompts, ns.seed, ns.trace_time_scale, ns.trace_length_scale
    )


def normalized_base_url(base_url: str) -> str:
    """``--base-url`` without a trailing slash; BenchError unless it is http(s)."""
    if not base_url.startswith(("http://", "https://")):
        raise BenchError(f"--base-url must start with http:// or https://, got {base_url!r}")
    return base_url.rstrip("/")


def client_config(ns: argparse.Namespace, max_concurrency: int | None) -> ClientConfig:
    """The client's settings from the target and sampling flags; asks the server for its
    model when ``--model`` is not given (BenchError when it cannot be reached)."""
    from epdserve.bench.client import ClientConfig, list_models

    base_url = normalized_base_url(ns.base_url)
    endpoint = ns.endpoint if ns.endpoint.startswith("/") else f"/{ns.endpoint}"
    served = asyncio.run(list_models(base_url, ns.api_key))
    model = ns.model or (served[0] if served else None)
    if model is None:
        raise BenchError(f"the server at {base_url} lists no model; pass --model NAME")
    ignore_eos = ns.ignore_eos if ns.ignore_eos is not None else ns.dataset in ("random", "trace")
    return ClientConfig(
        api_url=base_url + endpoint,
        model=model,
        is_chat=endpoint.rstrip("/").endswith("chat/completions"),
        temperature=ns.temperature,
        ignore_eos=ignore_eos,
        return_timing=getattr(ns, "return_timing", False),
        api_key=ns.api_key,
        timeout_s=ns.timeout,
        max_concurrency=max_concurrency,
    )
