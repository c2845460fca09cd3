"""``epdserve plan``: argument parsing and output (the work: ``planner/planning.py``)."""

from __future__ import annotations

import argparse

from epdserve.sim.cli import add_cluster_args, add_workload_args, write_json


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="instance ratio and colocated-vs-split verdict for a workload and SLO")
    p.add_argument("--profile", required=True, help="profile.json written by epdserve profile")
    p.add_argument("--slo", required=True, help="e.g. ttft_p99:2000,tpot_p99:100[,itl_p99:MS,e2el_p99:MS]")
    p.add_argument("--instances", type=int, default=None, help="instance budget (default 8 for the search)")
    p.add_argument("--prefix-hit-rate", type=float, default=None,
                   help="fraction of prompt tokens served by the prefix cache (default: from the trace's hash ids)")
    p.add_argument("--attainment", type=float, default=0.9, help="SLO attainment a rate must reach (DistServe: 0.9)")
    p.add_argument("--search-requests", type=int, default=200, help="fewest requests in one search simulation")
    p.add_argument("--search-max-requests", type=int, default=3000, help="most requests in one search simulation")
    p.add_argument("--seqs-choices", default=None, metavar="N,N,...",
                   help="max_num_seqs values tried for decode / colocated (0: the profile's; default 0,64)")
    p.add_argument("--workers", type=int, default=None, help="processes for the search (default: CPU count)")
    p.add_argument("--time-budget-s", type=float, default=60.0,
                   help="simulate no new candidate after this many seconds (0: no limit)")
    add_workload_args(p)
    add_cluster_args(p)
    p.add_argument("--out", default=None, help="write the plan JSON here")
    p.set_defaults(func=run_plan)
    return p


def run_plan(ns: argparse.Namespace) -> int:
    from epdserve.planner.plan import format_plan
    from epdserve.planner.planning import make_plan

    plan = make_plan(ns)
    print(format_plan(plan))
    if ns.out:
        write_json(plan, ns.out)
    return 0
