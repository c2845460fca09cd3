"""``epdserve bench experiment NAME``: experiments that start the servers they need themselves.

Each experiment module has ``NAME``, ``DESCRIPTION`` and ``run(out_dir, quick) -> str`` (the
report's markdown), and writes ``report.md``, ``results.json`` and PNGs into ``out_dir``.
``--quick`` runs tiny sizes in well under a minute: it checks that everything runs, its
numbers mean little.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from epdserve.bench import BenchError

# name -> (module, one-line description)
EXPERIMENTS = {
    "interference": ("epdserve.bench.experiments.interference",
                     "decode ITL while long prefills arrive: colocated (unchunked, chunked) vs P/D"),
    "kv-exposure": ("epdserve.bench.experiments.kv_exposure",
                    "KV hand-off time left on the critical path: shm/tcp x layer-wise/bulk by prompt length"),
    "handoff-paths": ("epdserve.bench.experiments.handoff_paths",
                      "pickle vs shared memory vs a registered slab for 37 MB / 8.4 MB bf16 tensors"),
    "epd": ("epdserve.bench.experiments.epd",
            "image TTFT: colocated vs E/P/D vs E/P/D without pipelining, one small image vs 8 per request"),
    "ratio": ("epdserve.bench.experiments.ratio",
              "goodput at SLO of every two-core topology, measured, against what epdserve plan predicted and chose"),
    "prefix-cache": ("epdserve.bench.experiments.prefix_cache",
                     "Mooncake conversations: least-prefill vs prefix-aware routing vs prefix-aware with KV tiers; "
                     "reload vs recompute by prefix length"),
    "load-shift": ("epdserve.bench.experiments.load_shift",
                   "a mix moving prefill-heavy -> decode-heavy -> back on four quota-limited workers: fixed splits vs "
                   "role switching vs colocated; queue-bound vs predictive admission under 2x overload"),
}
DEFAULT_OUT_ROOT = "out"
EXIT_BENCH_ERROR = 2


def add_experiment_parser(bench_sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``bench experiment NAME [--out DIR] [--quick]``."""
    listing = "; ".join(f"{name}: {text}" for name, (_, text) in EXPERIMENTS.items())
    p = bench_sub.add_parser("experiment", help="run a self-contained experiment (starts its own servers)",
                             description=f"Experiments: {listing}.")
    p.add_argument("name", help=", ".join(EXPERIMENTS))
    p.add_argument("--out", default=None, metavar="DIR", help=f"output directory (default {DEFAULT_OUT_ROOT}/NAME)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, well under a minute (a smoke test)")
    p.set_defaults(func=run_experiment_command)
    return p


def run_experiment(name: str, out_dir: Path, quick: bool) -> str:
    """Run experiment ``name`` into ``out_dir``; returns its report (markdown)."""
    if name not in EXPERIMENTS:
        raise BenchError(f"unknown experiment {name!r}; choose one of {', '.join(EXPERIMENTS)}")
    module = importlib.import_module(EXPERIMENTS[name][0])
    return module.run(out_dir, quick)


def run_experiment_command(ns: argparse.Namespace) -> int:
    """``bench experiment`` from parsed flags; returns the exit code (one-line error on stderr)."""
    out_dir = Path(ns.out) if ns.out else Path(DEFAULT_OUT_ROOT) / ns.name
    try:
        report = run_experiment(ns.name, out_dir, ns.quick)
    except BenchError as e:
        print(f"epdserve bench: error: {e}", file=sys.stderr)
        return EXIT_BENCH_ERROR
    except KeyboardInterrupt:
        return 130
    print(report)
    print(f"wrote {out_dir}/report.md and {out_dir}/results.json")
    return 0
