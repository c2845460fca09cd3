"""``epdserve bench``: the ``serve`` flags (named as in ``vllm bench serve``) and the run itself;
the flag groups and client set-up that ``bench sweep`` (sweep.py) shares; and the registration of
``bench sweep`` and ``bench experiment`` (experiments/).

Every argument, dataset or connection problem ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from typing import TYPE_CHECKING

from epdserve.bench import BenchError
from epdserve.bench.metrics import METRIC_NAMES, SLO_NAMES

if TYPE_CHECKING:
    from epdserve.bench.client import ClientConfig
    from epdserve.bench.workloads import BenchTokenizer, Workload

EXIT_BENCH_ERROR = 2
EXIT_ALL_FAILED = 1
DEFAULT_NUM_PROMPTS = 1000  # random and sharegpt; a trace defaults to all its requests
MAX_ERRORS_SHOWN = 10


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench`` (subcommands ``serve``, ``sweep``, ``experiment``) on a parent's subparsers."""
    from epdserve.bench.experiments import add_experiment_parser
    from epdserve.bench.sweep import add_sweep_parser

    bench = subparsers.add_parser("bench", help="measure a running OpenAI-compatible server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("serve", help="send a workload to a server and report latency and throughput")
    add_target_args(p)
    p.add_argument(
        "--return-timing",
        action="store_true",
        help="ask the server for per-request timing and report the TTFT breakdown",
    )
    add_workload_args(p)
    t = p.add_argument_group("traffic")
    t.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s; inf sends all at once"
    )
    t.add_argument("--burstiness", type=float, default=1.0, help="1.0 is Poisson; gamma arrivals otherwise")
    t.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at once")
    add_sampling_args(p)
    r = p.add_argument_group("report")
    r.add_argument(
        "--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS"
    )
    r.add_argument(
        "--metric-percentiles", default="50,90,99", help="comma-separated percentiles (default 50,90,99)"
    )
    r.add_argument(
        "--percentile-metrics", default=",".join(METRIC_NAMES), help="subset of ttft,tpot,itl,e2el"
    )
    r.add_argument("--result-json", default=None, help="write the result (vLLM's key names) to this file")
    r.add_argument("--plots", default=None, metavar="DIR", help="write TTFT/ITL CDFs and a timeline as PNG")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench_serve)
    add_sweep_parser(bench_sub)
    add_experiment_parser(bench_sub)
    return p


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
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON file or JSONL trace")
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


def _bench_serve(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from epdserve.bench.client import run_benchmark
    from epdserve.bench.metrics import compute_metrics, ttft_breakdown_ms
    from epdserve.bench.report import RunInfo, build_result, format_table, write_result_json
    from epdserve.bench.workloads import arrival_offsets, load_tokenizer

    slos_ms = parse_goodput(ns.goodput)
    percentiles = parse_percentiles(ns.metric_percentiles)
    percentile_metrics = parse_percentile_metrics(ns.percentile_metrics)
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}")
    normalized_base_url(ns.base_url)
    tokenizer = load_tokenizer(ns.tokenizer)
    workload = load_workload(ns, tokenizer)
    num_requests = len(workload.requests)
    offsets_s = workload.arrival_offsets_s or arrival_offsets(
        num_requests, ns.request_rate, ns.burstiness, ns.seed
    )
    config = client_config(ns, ns.max_concurrency)
    model, is_chat = config.model, config.is_chat

    if workload.arrival_offsets_s is not None:
        print(f"Replaying the trace's timestamps (time scale {ns.trace_time_scale:g})")
    else:
        distribution = "Poisson process" if ns.burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {ns.request_rate}")
        print(f"Burstiness factor: {ns.burstiness} ({distribution})")
    print(f"Maximum request concurrency: {ns.max_concurrency}")
    with tqdm(total=num_requests, disable=ns.disable_tqdm) as progress:
        run = asyncio.run(run_benchmark(config, workload.requests, offsets_s, progress))

    metrics = compute_metrics(run.outputs, run.duration_s, percentiles, slos_ms, tokenizer.count)
    failures = [out.error for out in run.outputs if not out.success]
    if failures:
        print(f"Failed requests during benchmark run detected (capping to {MAX_ERRORS_SHOWN}):")
        for i, error in enumerate(failures[:MAX_ERRORS_SHOWN]):
            print(f"Error {i}: {error}")
    info = RunInfo(
        backend="openai-chat" if is_chat else "openai",
        model_id=model,
        tokenizer_id=tokenizer.source,
        num_prompts=num_requests,
        request_rate=ns.request_rate,
        burstiness=ns.burstiness,
        max_concurrency=ns.max_concurrency,
    )
    result = build_result(
        info, run.outputs, run.duration_s, metrics, percentile_metrics, ttft_breakdown_ms(run.outputs)
    )
    print(format_table(result, percentile_metrics))
    if ns.result_json:
        write_result_json(result, ns.result_json)
    if ns.plots:
        from epdserve.bench.plots import write_plots

        write_plots(run.outputs, ns.plots)
    if metrics.completed == 0:
        print(
            f"epdserve bench: error: all {num_requests} requests failed; first error: {failures[0]}",
            file=sys.stderr,
        )
        return EXIT_ALL_FAILED
    return 0


def run_bench_serve(ns: argparse.Namespace) -> int:
    """Run ``bench serve`` from parsed flags; returns the process exit code."""
    try:
        return _bench_serve(ns)
    except BenchError as e:
        print(f"epdserve bench: error: {e}", file=sys.stderr)
        return EXIT_BENCH_ERROR
    except KeyboardInterrupt:
        return 130
