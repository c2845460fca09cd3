"""``epdserve plan``: argument parsing and output (the work: ``planner/planning.py``)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from epdserve.errors import ConfigError
from epdserve.planner.slo import TPOT_STEPS, TTFT_PREFILLS
from epdserve.sim.cli import add_cluster_args, add_workload_args, write_json


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="instance ratio and colocated-vs-split verdict for a workload and SLO")
    p.add_argument("--profile", required=True, help="profile.json written by epdserve profile")
    p.add_argument("--slo", required=True,
                   help="e.g. ttft_p99:2000,tpot_p99:100[,itl_p99:MS,e2el_p99:MS]; a ttft or tpot threshold 'auto' "
                        f"is sized to the profile's host: {TTFT_PREFILLS:g}x the prefill alone of the workload's prompt at "
                        f"that percentile, {TPOT_STEPS:g}x a one-sequence decode step")
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
    s = p.add_argument_group("a live server")
    s.add_argument("--from-server", default=None, metavar="URL",
                   help="plan for what this epdserve server serves: its recent arrival mix (GET /v1/traffic) is "
                        "the workload and its workers the budget; prints the role switches that take it to the "
                        "best split (instead of --workload)")
    s.add_argument("--from-server-window", type=float, default=600.0, metavar="SECONDS",
                   help="the server's traffic of the last SECONDS")
    s.add_argument("--api-key", default=None, help="the server's API key (default: $EPDSERVE_API_KEY)")
    add_workload_args(p, is_required=False)
    add_cluster_args(p)
    p.add_argument("--out", default=None, help="write the plan JSON here")
    p.set_defaults(func=run_plan)
    return p


def run_plan(ns: argparse.Namespace) -> int:
    from epdserve.planner.plan import format_plan
    from epdserve.planner.planning import make_plan

    if (ns.workload is None) == (ns.from_server is None):
        raise ConfigError("give one of --workload and --from-server")
    if ns.from_server is None:
        plan = make_plan(ns)
        print(format_plan(plan))
    else:
        plan = _plan_from_server(ns, make_plan)
    if ns.out:
        write_json(plan, ns.out)
    return 0


def _plan_from_server(ns: argparse.Namespace, make_plan) -> dict:  # noqa: ANN001 - planning.make_plan
    from epdserve.envs import get_api_key
    from epdserve.planner import from_server
    from epdserve.planner.plan import format_plan

    snapshot = from_server.fetch(ns.from_server, ns.api_key or get_api_key(), ns.from_server_window)
    with tempfile.TemporaryDirectory(prefix="epdserve-plan-") as tmp:
        trace = Path(tmp) / "traffic.jsonl"
        from_server.write_trace(snapshot.traffic, trace)
        ns.workload = ["trace", str(trace)]
        if ns.instances is None:
            ns.instances = snapshot.num_llm_workers
        plan = make_plan(ns)
    print(format_plan(plan))
    target = from_server.target_split(plan, ns.instances)
    switches = from_server.role_switches(snapshot.workers, *target) if target is not None else []
    print(from_server.format_switches(snapshot, plan, target, switches))
    plan["from_server"] = {"url": snapshot.url, "traffic": {k: v for k, v in snapshot.traffic.items() if k != "requests"},
                           "workers": snapshot.ready_counts(), "target": list(target) if target else None,
                           "switches": switches}
    return plan
