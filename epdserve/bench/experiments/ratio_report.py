"""``ratio`` report: predicted against measured goodput per two-core topology, plan's choice
against the measured best, and one bar plot."""

from __future__ import annotations

from pathlib import Path

from epdserve.bench.experiments.report import ExperimentRun, markdown_table, pyplot, save_figure, verdict

NAME = "ratio"
PLOT_NAME = "goodput_predicted_vs_measured.png"


def relative_error(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured > 0 else None


def table_rows(results: dict) -> list[list]:
    rows = []
    for topology, v in results["topologies"].items():
        err = relative_error(v["predicted_max_rate"], v["measured_max_rate"])
        levels = ", ".join(f"{lv['request_rate']:g}: {100 * lv['slo_attainment']:.0f} %"
                           for lv in v["measured"]["levels"])
        bound = "≥ " if v["measured"].get("is_lower_bound") else ""
        rows.append([topology, v["predicted_max_rate"], f"{bound}{v['measured_max_rate']:.2f}", v["measured"]["goodput"],
                     None if err is None else f"{100 * err:+.0f} %", levels])
    return rows


def build_report(results: dict, run: ExperimentRun, plot_names: list[str]) -> str:
    scale = results["scale"]
    headers = ["topology (two cores)", "predicted max rate (req/s)", "measured max rate (req/s)",
               "measured goodput there (req/s)", "prediction error", "sweep: rate: share within SLO"]
    return "\n".join([
        f"# {NAME}",
        "",
        (f"Random workload: {scale['input_len']} prompt and {scale['output_len']} output tokens "
         f"(±{100 * scale['range_ratio']:.0f} %), {scale['num_prompts']} requests per sweep level, Poisson arrivals. "
         f"SLO: TTFT ≤ {scale['slo_ttft_ms']:g} ms and TPOT ≤ {scale['slo_tpot_ms']:g} ms for ≥ 90 % of requests "
         "(plan: the same thresholds at P90 with 90 % attainment). Max rate: the highest rate meeting it — "
         "simulated by `epdserve plan` (predicted) or, measured, the highest sweep level at which it and every "
         "lower level had ≥ 90 % of requests within the SLO (≥: the highest level swept still met it). colocated=1 is one worker with 2 threads; "
         "colocated=2 two workers with one core each; prefill=1,decode=1 one core each."),
        "",
        *run.header_lines(),
        "",
        markdown_table(headers, table_rows(results)),
        "",
        *[f"![{name}]({name})" for name in plot_names],
        "",
        (f"- Plan (2 instances = 2 cores, 1-thread profile) chose: **{results['plan_choice']}** "
         f"({(results['plan_verdict'] or {}).get('reason', 'no reason given')})."),
        (f"- Highest predicted of the three: {results['predicted_best']}; measured best: "
         f"**{results['measured_best']}**."),
        f"- Plan's choice was the measured best: {verdict(results['is_plan_choice_measured_best'])}.",
        "",
        "Commands:",
        "",
        *[f"- `{c}`" for c in results.get("commands", [])],
        "",
    ])


def write_plot(results: dict, out_dir: Path) -> Path:
    plt = pyplot()
    names = list(results["topologies"])
    predicted = [results["topologies"][t]["predicted_max_rate"] for t in names]
    measured = [results["topologies"][t]["measured_max_rate"] for t in names]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], predicted, width=0.4, label="predicted (plan)")
    ax.bar([x + 0.2 for x in xs], measured, width=0.4, label="measured (sweep)")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("max rate within SLO (req/s)")
    ax.legend()
    return save_figure(fig, out_dir / PLOT_NAME)
