"""``ratio``: measured goodput at the SLO of every topology that fits two cores, against what
``epdserve plan`` predicted and chose.

    topology      serve flags                                   cores
    colocated=1   --colocated-workers 1 --cores-per-worker 2    one worker, 2 threads
    colocated=2   --colocated-workers 2 --cores-per-worker 1    two workers, 1 thread each
    prefill=1,decode=1  --prefill-workers 1 --decode-workers 1  one core each

1. Profile this machine twice (``epdserve profile``): every role at 1 thread, and the colocated
   role at 2 threads (the one-worker layout).
2. Plan (``epdserve plan``, same workload and SLO): with the 1-thread profile and a budget of
   2 instances (an instance is a core: colocated=2 against prefill=1,decode=1), and with the
   2-thread profile and 1 instance (colocated=1 on both cores). Each candidate's predicted
   goodput is its highest rate meeting the SLO.
3. Measure: for each topology a fresh server and ``epdserve bench sweep`` at rates around its
   prediction; the measured goodput is the highest rate at which it and every lower rate had
   >= 90 % of requests within the SLO.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from epdserve.bench.experiments.launch import epdserve_cmd, run_command, start_server, stop_server
from epdserve.bench.experiments.ratio_report import NAME, build_report, write_plot
from epdserve.bench.experiments.report import begin, write_outputs

SINGLE_THREAD, TWO_THREADS = "profile_1thread", "profile_colocated_2threads"
# topology -> (serve flags, profile it is planned with, plan budget in instances)
TOPOLOGIES = {
    "colocated=1": (["--colocated-workers", "1", "--cores-per-worker", "2"], TWO_THREADS, 1),
    "colocated=2": (["--colocated-workers", "2", "--cores-per-worker", "1"], SINGLE_THREAD, 2),
    "prefill=1,decode=1": (["--prefill-workers", "1", "--decode-workers", "1", "--cores-per-worker", "1"],
                           SINGLE_THREAD, 2),
}
FALLBACK_RATE = 1.0  # requests/s to center the sweep on when plan found no rate meeting the SLO


@dataclass(frozen=True)
class Scale:
    num_prompts: int  # per sweep level
    input_len: int
    output_len: int
    range_ratio: float
    slo_ttft_ms: float  # per request; the plan's SLO is the same threshold at P90 with 90 % attainment
    slo_tpot_ms: float
    level_factors: tuple[float, ...]  # sweep rates = prediction x these
    kv_cache_gib: float
    max_model_len: int
    is_quick_profile: bool
    plan_search_requests: int


FULL = Scale(100, 256, 96, 0.25, 1000.0, 80.0, (0.5, 0.7, 0.85, 1.0, 1.15, 1.35), 1.0, 1024, False, 100)
QUICK = Scale(4, 32, 8, 0.25, 5000.0, 500.0, (0.5, 1.0), 0.1, 256, True, 10)


def engine_flags(scale: Scale) -> list[str]:
    return ["--kv-cache-memory", f"{scale.kv_cache_gib:g}", "--max-model-len", str(scale.max_model_len)]


def workload_flags(scale: Scale) -> list[str]:
    return ["--random-input-len", str(scale.input_len), "--random-output-len", str(scale.output_len),
            "--random-range-ratio", f"{scale.range_ratio:g}"]


def profile(out_dir: Path, scale: Scale, commands: list[str]) -> dict[str, Path]:
    paths = {SINGLE_THREAD: out_dir / f"{SINGLE_THREAD}.json", TWO_THREADS: out_dir / f"{TWO_THREADS}.json"}
    quick = ["--quick"] if scale.is_quick_profile else []
    run_command(epdserve_cmd("profile", "--roles", "colocated,prefill,decode", "--threads", "colocated=1",
                             *engine_flags(scale), "--out", str(paths[SINGLE_THREAD]), "--disable-tqdm", *quick),
                commands)
    run_command(epdserve_cmd("profile", "--roles", "colocated", "--threads", "colocated=2", *engine_flags(scale),
                             "--out", str(paths[TWO_THREADS]), "--disable-tqdm", *quick), commands)
    return paths


def plan(profile_path: Path, num_instances: int, scale: Scale, out: Path, commands: list[str]) -> dict:
    slo = f"ttft_p90:{scale.slo_ttft_ms:g},tpot_p90:{scale.slo_tpot_ms:g}"
    run_command(epdserve_cmd("plan", "--profile", str(profile_path), "--slo", slo, "--attainment", "0.9",
                             "--instances", str(num_instances), "--workload", "random", *workload_flags(scale),
                             "--seed", "0", "--search-requests", str(scale.plan_search_requests),
                             "--seqs-choices", "0",  # the profile's max_num_seqs: what the servers run with
                             "--max-model-len", str(scale.max_model_len), "--out", str(out)), commands)
    return json.loads(out.read_text(encoding="utf-8"))


def predicted(plan_result: dict, topology: str) -> dict | None:
    """The plan's candidate for ``topology`` without max_num_seqs overrides (the served default),
    else its best one; None when the plan did not simulate it."""
    found = [c for c in plan_result.get("candidates", []) if c.get("topology") == topology]
    plain = [c for c in found if not c.get("max_num_seqs")]
    pool = plain or found
    return max(pool, key=lambda c: c.get("max_rate", 0.0)) if pool else None


def sweep(topology: str, center_rate: float, scale: Scale, out_dir: Path, commands: list[str]) -> dict:
    """A fresh server for ``topology`` and ``bench sweep`` at rates around ``center_rate``."""
    flags = TOPOLOGIES[topology][0]
    name = topology.replace("=", "").replace(",", "_")
    server = start_server([*flags, *engine_flags(scale)], out_dir / "logs" / name)
    commands.append(server.command)
    rates = sorted({round(center_rate * f, 3) for f in scale.level_factors if center_rate * f > 0})
    try:
        run_command(epdserve_cmd("bench", "sweep", "--base-url", server.url, "--dataset", "random",
                                 "--num-prompts", str(scale.num_prompts), *workload_flags(scale), "--seed", "0",
                                 "--request-rates", ",".join(f"{r:g}" for r in rates),
                                 "--goodput", f"ttft:{scale.slo_ttft_ms:g}", f"tpot:{scale.slo_tpot_ms:g}",
                                 "--out", str(out_dir / f"sweep_{name}"), "--disable-tqdm"), commands)
    finally:
        stop_server(server)
    return json.loads((out_dir / f"sweep_{name}" / "sweep.json").read_text(encoding="utf-8"))


def measured(sweep_result: dict) -> dict:
    """Highest sustained rate (>= 90 % within SLO there and below) and the goodput measured at it."""
    best = sweep_result.get("max_level_at_90pct_slo")
    row = next((r for r in sweep_result["levels"] if r.get("request_rate") == best), None)
    top = max(r["request_rate"] for r in sweep_result["levels"])
    return {
        "max_rate": float(best) if best is not None else 0.0,
        "is_lower_bound": best == top,  # the highest level swept still met the SLO
        "goodput": row["request_goodput"] if row else 0.0,
        "levels": [{k: r[k] for k in ("request_rate", "slo_attainment", "request_goodput", "ttft_p99_ms",
                                      "tpot_p99_ms")} for r in sweep_result["levels"]],
    }


def run(out_dir: Path, quick: bool) -> str:
    """Profile, plan, measure every two-core topology; write results.json, report.md, a plot."""
    experiment = begin(NAME, out_dir, quick)
    scale = QUICK if quick else FULL
    out_dir.mkdir(parents=True, exist_ok=True)
    commands: list[str] = []
    profiles = profile(out_dir, scale, commands)
    plans = {
        2: plan(profiles[SINGLE_THREAD], 2, scale, out_dir / "plan_2_instances.json", commands),
        1: plan(profiles[TWO_THREADS], 1, scale, out_dir / "plan_colocated_2threads.json", commands),
    }
    topologies: dict[str, dict] = {}
    for topology, (_, _, num_instances) in TOPOLOGIES.items():
        candidate = predicted(plans[num_instances], topology)
        predicted_rate = candidate["max_rate"] if candidate else 0.0
        result = measured(sweep(topology, predicted_rate or FALLBACK_RATE, scale, out_dir, commands))
        topologies[topology] = {"predicted": candidate, "predicted_max_rate": predicted_rate,
                                "measured": result, "measured_max_rate": result["max_rate"]}
        print(f"{topology}: predicted {predicted_rate:.2f} req/s, measured {result['max_rate']:.2f} req/s",
              flush=True)
    results = {"scale": asdict(scale), **summarize(topologies, plans[2]), "commands": commands}
    plots = [write_plot(results, out_dir)]
    report = build_report(results, experiment, [p.name for p in plots])
    write_outputs(out_dir, results, report)
    return report


def summarize(topologies: dict[str, dict], plan_2: dict) -> dict:
    """Which topology plan chose, which the prediction ranks first, and which measured best."""
    def best(key: str) -> str | None:
        rates = {t: v[key] for t, v in topologies.items() if v[key] > 0}
        return max(rates, key=rates.get) if rates else None

    verdict = plan_2.get("verdict") or {}
    choice = (verdict.get("configuration") or {}).get("topology")
    # A budget of two instances on two cores: a colocated choice is deployed as colocated=2.
    plan_choice = "colocated=2" if verdict.get("choice") == "colocated" else choice
    measured_best = best("measured_max_rate")
    return {
        "topologies": topologies,
        "plan_verdict": verdict,
        "plan_choice": plan_choice,
        "predicted_best": best("predicted_max_rate"),
        "measured_best": measured_best,
        "is_plan_choice_measured_best": plan_choice is not None and plan_choice == measured_best,
    }
