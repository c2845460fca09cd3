"""``load-shift`` report: goodput and SLO attainment per arm and phase, the workers' roles over
time, the goals (role switching against the best fixed split; predictive admission against
the queue bound under overload), and the simulator's run of the same trace."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from epdserve.bench.experiments.report import ExperimentRun, markdown_table, pyplot, save_figure, verdict

NAME = "load-shift"
SWITCHING = "role switching"
GOAL_RATIO = 1.3
GOAL_ADMITTED = 0.9
GOAL_QUEUE_BELOW = 0.5


def is_met(r: dict, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """A request met the SLO: it completed, its TTFT and its TPOT (one token: none) within."""
    return (r["ok"] and r["ttft_s"] * 1e3 <= slo_ttft_ms
            and (r["tpot_s"] is None or r["tpot_s"] * 1e3 <= slo_tpot_ms))


def attainment(requests: list[dict], slo_ttft_ms: float, slo_tpot_ms: float) -> float | None:
    return sum(is_met(r, slo_ttft_ms, slo_tpot_ms) for r in requests) / len(requests) if requests else None


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values else None


def phase_summary(requests: list[dict], duration_s: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    ok = [r for r in requests if r["ok"]]
    ttfts = [r["ttft_s"] for r in ok]
    tpots = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    met = sum(is_met(r, slo_ttft_ms, slo_tpot_ms) for r in requests)
    return {"num_requests": len(requests), "num_failed": len(requests) - len(ok), "num_met": met,
            "goodput": met / duration_s, "attainment": met / len(requests) if requests else None,
            "ttft_p50_ms": _pct(ttfts, 50), "ttft_p99_ms": _pct(ttfts, 99),
            "tpot_p50_ms": _pct(tpots, 50), "tpot_p99_ms": _pct(tpots, 99)}


def arm_summary(requests: list[dict], phase_names: list[str], scale) -> dict:  # noqa: ANN001 - load_shift.Scale
    """Per phase and over the whole trace."""
    out = {}
    for phase in scale.phases:
        mine = [r for r, name in zip(requests, phase_names) if name == phase.name]
        out[phase.name] = phase_summary(mine, phase.duration_s, scale.slo_ttft_ms, scale.slo_tpot_ms)
    out["all"] = phase_summary(requests, sum(p.duration_s for p in scale.phases), scale.slo_ttft_ms,
                               scale.slo_tpot_ms)
    return out


def goals(arms: dict[str, dict], phase_names: list[str], scale) -> dict:  # noqa: ANN001
    """Per arm its summary; the best fixed split over the trace and per phase; the ratio."""
    summaries = {arm: arm_summary(a["requests"], phase_names, scale) for arm, a in arms.items()}
    splits = [arm for arm in summaries if "prefill=" in arm]
    best = max(splits, key=lambda arm: summaries[arm]["all"]["goodput"]) if splits else None
    by_phase = {p.name: max(splits, key=lambda arm: summaries[arm][p.name]["goodput"]) for p in scale.phases} if splits else {}
    ratio = None
    if best is not None and SWITCHING in summaries and summaries[best]["all"]["goodput"] > 0:
        ratio = summaries[SWITCHING]["all"]["goodput"] / summaries[best]["all"]["goodput"]
    return {"summaries": summaries, "best_split": best, "best_split_by_phase": by_phase,
            "switching_vs_best_split": ratio, "is_switching_met": ratio is not None and ratio >= GOAL_RATIO}


def goals_overload(policies: dict[str, dict], slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """Attainment of the admitted requests per admission policy."""
    out = {}
    for policy, arm in policies.items():
        requests = arm["requests"]
        admitted = [r for r in requests if r["status"] != "429"]
        out[policy] = {"num_requests": len(requests), "num_refused": len(requests) - len(admitted),
                       "attainment_of_admitted": attainment(admitted, slo_ttft_ms, slo_tpot_ms),
                       "goodput_requests": sum(is_met(r, slo_ttft_ms, slo_tpot_ms) for r in admitted)}
    queue, predictive = out.get("queue", {}), out.get("predictive", {})
    met = ((predictive.get("attainment_of_admitted") or 0) >= GOAL_ADMITTED
           and (queue.get("attainment_of_admitted") or 1) < GOAL_QUEUE_BELOW)
    return {"overload": out, "is_overload_met": met}


# ---------------------------------------------------------------- plots


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    plt = pyplot()
    scale = results["scale"]
    phases = scale["phases"]
    bounds = np.cumsum([p["duration_s"] for p in phases])
    summaries = results["goals"]["summaries"]
    arms = list(summaries)
    paths = []

    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        values = [summaries[arm][p["name"]]["goodput"] for p in phases] + [summaries[arm]["all"]["goodput"]]
        ax.bar(np.arange(len(phases) + 1) + i * width, values, width, label=arm)
    ax.set_xticks(np.arange(len(phases) + 1) + 0.4 - width / 2)
    ax.set_xticklabels([f"{p['name']} ({p['mix']})" for p in phases] + ["whole trace"])
    ax.set_ylabel("goodput (requests/s within the SLO)")
    ax.legend(fontsize=8)
    ax.set_title("Goodput per phase")
    paths.append(save_figure(fig, out_dir / "goodput_per_phase.png"))

    arrivals = results.get("arrival_s")
    if arrivals:
        for metric, label, slo in (("ttft_s", "TTFT (s)", scale["slo_ttft_ms"] / 1e3),
                                   ("tpot_s", "TPOT (s)", scale["slo_tpot_ms"] / 1e3)):
            fig, ax = plt.subplots(figsize=(9, 4))
            for arm in arms:
                reqs = results["arms"][arm]["requests"]
                t = [a for a, r in zip(arrivals, reqs) if r["ok"] and r[metric] is not None]
                v = [r[metric] for r in reqs if r["ok"] and r[metric] is not None]
                ax.plot(t, _rolling(v), label=arm, lw=1)
            ax.axhline(slo, color="k", ls=":", lw=1, label="SLO")
            for b in bounds[:-1]:
                ax.axvline(b, color="grey", lw=0.8)
            ax.set_yscale("log")
            ax.set_xlabel("arrival (s)")
            ax.set_ylabel(f"{label}, rolling median of 9")
            ax.legend(fontsize=8)
            paths.append(save_figure(fig, out_dir / f"{metric.removesuffix('_s')}_over_time.png"))

    switching = results["arms"].get(SWITCHING)
    if switching and switching["roles"]:
        fig, ax = plt.subplots(figsize=(9, 3))
        t = [s["t"] for s in switching["roles"]]
        for role in ("prefill", "decode"):
            ax.step(t, [s["counts"].get(role, 0) for s in switching["roles"]], where="post", label=f"{role} (served)")
        sim = results.get("simulated", {}).get(SWITCHING)
        if sim:
            for s in sim["switches"]:
                ax.axvline(s["began_s"], color="tab:red", ls="--", lw=0.8)
        for b in bounds[:-1]:
            ax.axvline(b, color="grey", lw=0.8)
        ax.set_xlabel("time since the run began (s); dashed: the simulator's switches")
        ax.set_ylabel("workers")
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir / "roles_over_time.png"))
    return paths


def _rolling(values: list[float], k: int = 9) -> list[float]:
    if len(values) < k:
        return values
    half = k // 2
    return [float(np.median(values[max(0, i - half):i + half + 1])) for i in range(len(values))]


# ---------------------------------------------------------------- report


def build_report(results: dict, experiment: ExperimentRun, plots: list[str]) -> str:
    scale, g = results["scale"], results["goals"]
    phases = scale["phases"]
    lines = [f"# {NAME}", "", *experiment.header_lines(), "",
             f"Four workers of {scale['cpu_share']:g} core each (a CFS quota per worker process); SLO TTFT "
             f"{scale['slo_ttft_ms']:g} ms and TPOT {scale['slo_tpot_ms']:g} ms; prompt lengths x"
             f"{scale['input_scale']:g}, answer lengths x{scale['output_scales'][0]:g} (prefill-heavy) and "
             f"x{scale['output_scales'][1]:g} (decode-heavy) of the Azure conversation trace.",
             "", "## The trace", "",
             markdown_table(["phase", "mix", "requests", "seconds", "req/s", "mean prompt", "mean answer"],
                            [[name, t["mix"], t["num_requests"], t["duration_s"], t["rate"], t["mean_input_len"],
                              t["mean_output_len"]] for name, t in results["trace"].items()]),
             "", "## Goodput per arm and phase", ""]
    headers = ["arm", *[f"{p['name']} goodput (att.)" for p in phases], "whole trace goodput (att.)",
               "TTFT P99 ms", "TPOT P99 ms", "failed"]
    rows = []
    for arm, s in g["summaries"].items():
        rows.append([arm, *[f"{s[p['name']]['goodput']:.2f} ({100 * (s[p['name']]['attainment'] or 0):.0f} %)"
                            for p in phases],
                     f"{s['all']['goodput']:.2f} ({100 * (s['all']['attainment'] or 0):.0f} %)",
                     s["all"]["ttft_p99_ms"], s["all"]["tpot_p99_ms"], s["all"]["num_failed"]])
    lines += [markdown_table(headers, rows), ""]
    ratio = g.get("switching_vs_best_split")
    lines += [f"Best fixed split over the trace: {g['best_split']}. Role switching / best fixed split: "
              f"{ratio:.2f}x (goal >= {GOAL_RATIO}x): **{verdict(g['is_switching_met'])}**." if ratio is not None
              else "Role switching / best fixed split: not measured.", ""]
    switching = results["arms"].get(SWITCHING)
    if switching:
        lines += ["## Switches (role switching arm)", ""]
        lines += [markdown_table(["t (s)", "worker", "from", "to", "why"],
                                 [[s["t"], s["worker"], s["from_role"], s["to_role"], s["reason"]]
                                  for s in switching["switches"]]) if switching["switches"] else "none", ""]
    sim = results.get("simulated") or {}
    if sim:
        lines += ["## The simulator on the same trace", "",
                  "The same trace through `epdserve simulate` with this host's profile taken under the same "
                  "quota and calibrated with the prefill=2,decode=2 arm's step traces (the controller of "
                  "`--role-switching auto` for the switching arm).", ""]
        lines += [markdown_table(["arm", "whole trace goodput (simulated)", "measured", "switches (simulated)"],
                                 [[arm, arm_sim["goodput"], g["summaries"].get(arm, {}).get("all", {}).get("goodput"),
                                   ", ".join(f"{s['began_s']:.0f} s {s['worker']} {s['from_role']}->{s['to_role']}"
                                             for s in arm_sim["switches"]) or "-"]
                                  for arm, arm_sim in g.get("simulated", {}).items()]), ""]
    over = g.get("overload")
    if over:
        lines += ["## Overload: queue bound vs predictive admission", "",
                  f"The prefill-heavy mix at {scale['overload']['rate']:g} req/s on "
                  f"{results['overload']['split']}.", "",
                  markdown_table(["admission", "requests", "refused (429)", "SLO attainment of admitted",
                                  "requests within the SLO"],
                                 [[p, o["num_requests"], o["num_refused"],
                                   f"{100 * (o['attainment_of_admitted'] or 0):.0f} %", o["goodput_requests"]]
                                  for p, o in over.items()]), "",
                  f"Goal: predictive >= {100 * GOAL_ADMITTED:.0f} % where the queue bound < "
                  f"{100 * GOAL_QUEUE_BELOW:.0f} %: **{verdict(g['is_overload_met'])}**.", ""]
    lines += ["## Plots", "", *[f"![{p}]({p})" for p in plots], "", "## Commands", "",
              *[f"    {c}" for c in results["commands"]], ""]
    return "\n".join(lines)
