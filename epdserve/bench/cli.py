"""``epdserve bench``: the ``serve`` subcommand and the run itself, and the registration of
``bench sweep`` (sweep.py) and ``bench experiment`` (experiments/). The flag groups both share
are in args.py.

Every argument, dataset or connection problem ends as one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace

from epdserve.bench import BenchError
from epdserve.bench.args import (
    add_sampling_args,
    add_target_args,
    add_workload_args,
    client_config,
    load_workload,
    normalized_base_url,
    parse_goodput,
    parse_percentile_metrics,
    parse_percentiles,
)
from epdserve.bench.metrics import METRIC_NAMES
from epdserve.errors import ConfigError
from epdserve.service import TIER_OF_CLASS, draw_classes, parse_class_mix, parse_class_slos

EXIT_BENCH_ERROR = 2
EXIT_ALL_FAILED = 1
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
    t.add_argument("--service-class-mix", default=None, metavar="CLASS=SHARE,...",
                   help="each request's service class drawn with these shares (realtime, interactive, batch; "
                        "sent as service_tier priority, default, flex); attainment per class in the result")
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
    r.add_argument("--service-class-slo", action="append", default=None, metavar="CLASS=ttft:MS[,tpot:MS]",
                   help="a service class's SLO: the result counts the requests of each class that met it")
    r.add_argument("--result-json", default=None, help="write the result (vLLM's key names) to this file")
    r.add_argument("--plots", default=None, metavar="DIR", help="write TTFT/ITL CDFs and a timeline as PNG")
    r.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_bench_serve)
    add_sweep_parser(bench_sub)
    add_experiment_parser(bench_sub)
    return p


def _bench_serve(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from epdserve.bench.client import run_benchmark
    from epdserve.bench.metrics import class_attainment, compute_metrics, ttft_breakdown_ms
    from epdserve.bench.report import RunInfo, build_result, format_table, write_result_json
    from epdserve.bench.workloads import arrival_offsets, load_tokenizer

    slos_ms = parse_goodput(ns.goodput)
    percentiles = parse_percentiles(ns.metric_percentiles)
    percentile_metrics = parse_percentile_metrics(ns.percentile_metrics)
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {ns.max_concurrency}")
    normalized_base_url(ns.base_url)
    try:
        class_mix = parse_class_mix(ns.service_class_mix)
        class_slos = parse_class_slos(ns.service_class_slo)
    except ConfigError as e:
        raise BenchError(str(e)) from None
    tokenizer = load_tokenizer(ns.tokenizer)
    workload = load_workload(ns, tokenizer)
    num_requests = len(workload.requests)
    classes = draw_classes(class_mix, num_requests, ns.seed)
    requests = workload.requests
    if class_mix:
        requests = tuple(replace(r, service_tier=TIER_OF_CLASS[c]) for r, c in zip(requests, classes))
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
        run = asyncio.run(run_benchmark(config, requests, offsets_s, progress))

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
    per_class = (class_attainment(run.outputs, classes, class_slos, tokenizer.count)
                 if class_mix or class_slos else None)
    result = build_result(
        info, run.outputs, run.duration_s, metrics, percentile_metrics, ttft_breakdown_ms(run.outputs),
        per_class, classes, slos_ms,
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
