"""``epdserve bench sweep``: the bench client at a series of request rates or concurrencies.

Each level is one ``bench serve`` run (same client, same metric definitions) with a fresh
sample of the dataset (seed + level index, so a prefix cache never sees a prompt twice). The
sweep reports, per level, throughput, goodput and the fraction of requests that met every SLO,
and the highest level the server sustains: the largest level such that it and every lower
level had at least 90 % of requests within every SLO (a level that passes after a lower one
failed is noise, not capacity).

    DIR/sweep.json          one entry per level, and max_level_at_90pct_slo
    DIR/goodput.png         throughput, goodput and SLO attainment per level
    DIR/levels/LEVEL.json   the full ``bench serve`` result of each level
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from epdserve.bench import BenchError

if TYPE_CHECKING:
    from epdserve.bench.client import ClientConfig
    from epdserve.bench.workloads import BenchTokenizer

SLO_ATTAINMENT_TARGET = 0.9
PERCENTILES = (50.0, 99.0)
EXIT_BENCH_ERROR = 2


def add_sweep_parser(bench_sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench sweep`` with the target, workload and sampling flags of ``bench serve``."""
    from epdserve.bench.args import add_sampling_args, add_target_args, add_workload_args

    p = bench_sub.add_parser("sweep", help="run the bench client at several request rates or concurrencies")
    add_target_args(p)
    add_workload_args(p)
    levels = p.add_mutually_exclusive_group(required=True)
    levels.add_argument("--request-rates", default=None, help="comma-separated requests/s, e.g. 1,2,4 (inf allowed)")
    levels.add_argument("--concurrencies", default=None, help="comma-separated max concurrencies, e.g. 1,4,16")
    p.add_argument("--burstiness", type=float, default=1.0, help="1.0 is Poisson; gamma arrivals otherwise")
    add_sampling_args(p)
    p.add_argument("--goodput", nargs="+", required=True, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--out", required=True, metavar="DIR", help="write sweep.json, goodput.png and levels/ here")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_sweep_command)
    return p


def parse_levels(text: str, is_rate: bool) -> list[float]:
    """``"1,2,4"`` -> ``[1.0, 2.0, 4.0]``, ascending; rates may be ``inf``, concurrencies are ints."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"levels must be comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 or math.isnan(v) for v in values):
        raise BenchError(f"levels must be > 0, got {text!r}")
    if not is_rate and any(math.isinf(v) or v != int(v) for v in values):
        raise BenchError(f"--concurrencies takes whole numbers, got {text!r}")
    if len(set(values)) != len(values):
        raise BenchError(f"levels must not repeat, got {text!r}")
    return sorted(values)


def max_level_meeting_slo(
    levels: Sequence[float], attainments: Sequence[float], target: float = SLO_ATTAINMENT_TARGET
) -> float | None:
    """The highest level such that it and every lower level met ``target``; None if the lowest
    level already missed it. ``levels`` ascending, ``attainments`` fractions in [0, 1]."""
    best = None
    for level, attainment in zip(levels, attainments):
        if attainment < target:
            break
        best = level
    return best


def _json_level(level: float) -> float | str | int:
    if math.isinf(level):
        return "inf"
    return int(level) if level == int(level) else level


@dataclasses.dataclass(frozen=True)
class _Setup:
    config: ClientConfig  # max_concurrency is set per level
    tokenizer: BenchTokenizer
    slos_ms: dict[str, float]
    is_rate: bool

    @property
    def key(self) -> str:
        """The level's name in sweep.json."""
        return "request_rate" if self.is_rate else "max_concurrency"


def _run_level(ns: argparse.Namespace, setup: _Setup, index: int, level: float) -> dict:
    """One ``bench serve`` run at ``level``; its summary row (milliseconds, requests/s)."""
    from tqdm import tqdm

    from epdserve.bench.args import load_workload
    from epdserve.bench.client import run_benchmark
    from epdserve.bench.metrics import compute_metrics
    from epdserve.bench.report import RunInfo, build_result, write_result_json
    from epdserve.bench.workloads import arrival_offsets

    seed = ns.seed + index
    workload = load_workload(argparse.Namespace(**{**vars(ns), "seed": seed}), setup.tokenizer)
    num_requests = len(workload.requests)
    concurrency = None if setup.is_rate else int(level)
    rate = level if setup.is_rate else math.inf
    offsets_s = arrival_offsets(num_requests, rate, ns.burstiness, seed)
    config = dataclasses.replace(setup.config, max_concurrency=concurrency)
    label = _json_level(level)
    with tqdm(total=num_requests, disable=ns.disable_tqdm, desc=f"{setup.key} {label}") as progress:
        run = asyncio.run(run_benchmark(config, workload.requests, offsets_s, progress))
    metrics = compute_metrics(run.outputs, run.duration_s, PERCENTILES, setup.slos_ms, setup.tokenizer.count)
    info = RunInfo("openai-chat" if config.is_chat else "openai", config.model, setup.tokenizer.source,
                   num_requests, rate, ns.burstiness, concurrency)
    write_result_json(build_result(info, run.outputs, run.duration_s, metrics, goodput_slos_ms=setup.slos_ms),
                      str(Path(ns.out) / "levels" / f"{setup.key}_{label}.json"))
    num_good = round((metrics.request_goodput or 0.0) * run.duration_s)
    pct = {name: dict(summary.percentiles_ms) for name, summary in metrics.summaries.items()}
    return {
        setup.key: label,
        "num_requests": num_requests,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "duration_s": run.duration_s,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "slo_attainment": num_good / num_requests,
        "ttft_p50_ms": pct["ttft"][50.0],
        "ttft_p99_ms": pct["ttft"][99.0],
        "tpot_p50_ms": pct["tpot"][50.0],
        "tpot_p99_ms": pct["tpot"][99.0],
        "e2el_p99_ms": pct["e2el"][99.0],
    }


def run_sweep(ns: argparse.Namespace) -> dict:
    """Every level in ascending order; returns (and writes) the sweep.json contents."""
    from epdserve.bench.args import client_config, parse_goodput
    from epdserve.bench.report import write_result_json
    from epdserve.bench.workloads import load_tokenizer

    is_rate = ns.request_rates is not None
    levels = parse_levels(ns.request_rates if is_rate else ns.concurrencies, is_rate)
    slos_ms = parse_goodput(ns.goodput)
    if ns.dataset == "trace":
        raise BenchError("bench sweep sets the arrival times itself; use --dataset random or sharegpt")
    tokenizer = load_tokenizer(ns.tokenizer)
    setup = _Setup(client_config(ns, None), tokenizer, slos_ms, is_rate)
    rows = []
    for index, level in enumerate(levels):
        rows.append(_run_level(ns, setup, index, level))
        row = rows[-1]
        print(f"{setup.key} {row[setup.key]}: {row['request_throughput']:.3f} req/s, goodput "
              f"{row['request_goodput']:.3f} req/s, {100 * row['slo_attainment']:.1f} % within SLO, "
              f"TTFT p99 {row['ttft_p99_ms']:.1f} ms, TPOT p99 {row['tpot_p99_ms']:.1f} ms", flush=True)
    best = max_level_meeting_slo(levels, [row["slo_attainment"] for row in rows])
    result = {
        "sweep": setup.key,
        "model": setup.config.model,
        "slos_ms": slos_ms,
        "slo_attainment_target": SLO_ATTAINMENT_TARGET,
        "levels": rows,
        "max_level_at_90pct_slo": None if best is None else _json_level(best),
        f"max_{'rate' if is_rate else 'concurrency'}_at_90pct_slo": None if best is None else _json_level(best),
    }
    write_result_json(result, str(Path(ns.out) / "sweep.json"))
    write_goodput_plot(result, Path(ns.out) / "goodput.png")
    return result


def write_goodput_plot(result: dict, path: Path) -> Path:
    """Throughput and goodput (left axis) and SLO attainment (right axis) per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from epdserve.bench.plots import PLOT_DPI

    key, rows = result["sweep"], result["levels"]
    positions = range(len(rows))
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    ax.plot(positions, [r["request_throughput"] for r in rows], marker="o", label="throughput")
    ax.plot(positions, [r["request_goodput"] for r in rows], marker="s", label="goodput (all SLOs met)")
    ax.set_xticks(list(positions))
    ax.set_xticklabels([str(r[key]) for r in rows])
    ax.set_xlabel("request rate (req/s)" if key == "request_rate" else "max concurrency")
    ax.set_ylabel("requests / s")
    ax.grid(True, alpha=0.3)
    share = ax.twinx()
    share.plot(positions, [r["slo_attainment"] for r in rows], color="tab:green", linestyle="--", marker="^",
               label="fraction within SLO")
    share.axhline(result["slo_attainment_target"], color="gray", linewidth=1)
    share.set_ylim(0.0, 1.05)
    share.set_ylabel("fraction of requests within every SLO")
    lines = ax.get_legend_handles_labels()
    more = share.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower left", fontsize=8)
    ax.set_title(f"highest level with >= 90 % of requests within SLO: {result['max_level_at_90pct_slo']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
    return path


def run_sweep_command(ns: argparse.Namespace) -> int:
    """``bench sweep`` from parsed flags; returns the exit code (one-line error on stderr)."""
    try:
        result = run_sweep(ns)
    except BenchError as e:
        print(f"epdserve bench: error: {e}", file=sys.stderr)
        return EXIT_BENCH_ERROR
    except KeyboardInterrupt:
        return 130
    what = "request rate" if result["sweep"] == "request_rate" else "concurrency"
    print(f"highest {what} with >= 90 % of requests within every SLO: {result['max_level_at_90pct_slo']}")
    return 0
