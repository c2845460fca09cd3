"""``prefix-cache`` report: per topology, arm and rate the goodput, TTFT and where prompt tokens
came from; the goals against least-prefill without tiers; the reload/recompute crossover."""

from __future__ import annotations

import statistics
from pathlib import Path

from epdserve.bench.experiments.report import ExperimentRun, markdown_table, pyplot, save_figure, verdict

NAME = "prefix-cache"
BASELINE, BEST = "least-prefill", "prefix-aware+tiers"
BEFORE = "least-prefill-no-decode-cache"  # P/D as it was before decode workers kept a prefix cache
GOAL_GOODPUT_RATIO = 1.5
GOAL_TTFT_P99_CUT = 0.30


def pct(share: float) -> str:
    return f"{100 * share:.0f} %"


def trace_rows(levels_by_arm: dict[str, list[dict]]) -> list[list]:
    rows = []
    for arm, levels in levels_by_arm.items():
        for lv in levels:
            hits = lv["hit_share"]
            rows.append([arm, lv["request_rate"], lv["request_goodput"], pct(lv["goodput_share"]),
                         lv["ttft_p50_ms"], lv["ttft_p99_ms"], lv["tpot_p99_ms"], pct(hits["pool"]),
                         pct(hits["host"]), pct(hits["disk"]), lv["failed"]])
    return rows


def pd_rows(levels_by_arm: dict[str, list[dict]]) -> list[list]:
    """Where the P/D arms' prompts came from and what moved prefill -> decode."""
    return [[arm, lv["request_rate"], lv["request_goodput"], lv["ttft_p50_ms"], lv["ttft_p99_ms"],
             pct(lv["hit_share"]["pool"]), pct(lv["hit_share"]["host"] + lv["hit_share"]["disk"]),
             pct(lv["decode_cached_share"]), f"{lv['kv_bytes_p_to_d'] / 2**20:.0f}",
             f"{lv['kv_bytes_not_sent'] / 2**20:.0f}"]
            for arm, levels in levels_by_arm.items() for lv in levels]


def goals(levels_by_arm: dict[str, list[dict]], baseline: str = BASELINE) -> list[dict]:
    """Per rate: goodput ratio and TTFT P99 cut of the best arm against ``baseline`` (none when
    that arm did not run)."""
    out = []
    for base, best in zip(levels_by_arm.get(baseline, []), levels_by_arm.get(BEST, [])):
        ratio = best["request_goodput"] / base["request_goodput"] if base["request_goodput"] else None
        cut = (1 - best["ttft_p99_ms"] / base["ttft_p99_ms"]) if base["ttft_p99_ms"] and best["ttft_p99_ms"] else None
        out.append({"request_rate": base["request_rate"], "goodput_ratio": ratio, "ttft_p99_cut": cut,
                    "is_goodput_met": ratio is not None and ratio >= GOAL_GOODPUT_RATIO,
                    "is_ttft_met": cut is not None and cut >= GOAL_TTFT_P99_CUT})
    return out


def crossover_table(crossover: dict[str, list[dict]]) -> tuple[list[str], list[list]]:
    """Median TTFT per prefix length per arm, and the rule's choice per tier."""
    lengths = sorted({p["prefix_tokens"] for points in crossover.values() for p in points})
    headers = ["prefix tokens", *[f"{name} TTFT (ms)" for name in crossover if "rule" not in name],
               *[f"{name}: choice (predicted load / compute ms)" for name in crossover if "rule" in name]]
    rows = []
    for length in lengths:
        row: list = [length]
        for name, points in crossover.items():
            at = [p for p in points if p["prefix_tokens"] == length]
            if "rule" not in name:
                row.append(statistics.median(p["ttft_ms"] for p in at) if at else None)
            elif at:
                p = at[-1]
                choice = "load" if p["num_chosen_tokens"] else ("recompute" if p["num_found_tokens"] else "miss")
                row.append(f"{choice} ({p['predicted_load_ms']:.1f} / {p['predicted_compute_ms']:.1f})")
            else:
                row.append(None)
        rows.append(row)
    return headers, rows


def round_lines(results: dict) -> list[str]:
    """With several rounds: the tables above are the rounds' means; each round's own goodput
    ratio and TTFT P99 cut per rate, so a reader sees the spread."""
    by_round = results.get("goals_by_round") or []
    if len(by_round) < 2:
        return []
    headers = ["rate (req/s)", *[f"round {k + 1}: goodput ratio / TTFT P99 cut" for k in range(len(by_round))]]
    rows = []
    for i, g in enumerate(results["goals"]):
        cells = []
        for goals_of_round in by_round:
            r = goals_of_round[i]
            ratio = "-" if r["goodput_ratio"] is None else f"{r['goodput_ratio']:.2f}"
            cut = "-" if r["ttft_p99_cut"] is None else pct(r["ttft_p99_cut"])
            cells.append(f"{ratio} / {cut}")
        rows.append([g["request_rate"], *cells])
    return [f"Every number above is the mean of {len(by_round)} rounds (each arm and rate on a fresh server "
            "per round, the arms' order rotated); per round:", "", markdown_table(headers, rows), ""]


def knee_lines(results: dict) -> list[str]:
    """How the rates were set: the baseline's probes and the knee found on them."""
    knee = results.get("knee")
    if not knee:
        return []
    rows = [[lv["request_rate"], lv["request_goodput"], pct(lv["goodput_share"]), lv["ttft_p50_ms"],
             lv["ttft_p99_ms"], lv["tpot_p99_ms"]] for lv in knee["probes"]]
    where = (f"below the ladder: no rate kept them, and the arms run at multiples of its first, {knee['rate']:.2f} "
             "req/s" if knee["is_below_ladder"] else f"{knee['rate']:.2f} req/s")
    multiples = ", ".join(f"{m:g}" for m in knee["rate_multiples"])
    misses = knee.get("misses", 1)
    until = "one" if misses == 1 else f"{misses} in a row"
    entry = knee.get("entry_rate")
    predicted_rate = (results.get("plan") or {}).get("predicted_max_rate")
    predicted = "max rate" if predicted_rate is None else f"max rate, {predicted_rate:.2f} req/s"
    how = (f"{BASELINE} without tiers replayed at rising rates until {until} kept fewer than "
           f"{pct(knee['share'])} of its requests within the SLO" if entry is None else
           f"{BASELINE} without tiers replayed on a ladder of rates entered at {entry:.2f} req/s (its highest rung "
           f"not above the plan's predicted {predicted}): up while it kept {pct(knee['share'])} of its requests within the SLO (until {until} did "
           "not), down until it did when the first rate missed")
    return [f"Rates: {how} (one run each); the knee, the highest rate that kept them, is {where}. Every arm runs "
            f"at {multiples} × the knee (at or below it no arm can have {GOAL_GOODPUT_RATIO:g}× the baseline's goodput).",
            "", markdown_table(["rate (req/s)", "goodput (req/s)", "within SLO", "TTFT P50 (ms)", "TTFT P99 (ms)",
                                "TPOT P99 (ms)"], rows), ""]


def plan_lines(results: dict) -> list[str]:
    """Where the arms ran: the configuration ``epdserve plan`` chose for the trace, and why."""
    split = results.get("plan")
    if not split:
        return []
    rows = [[c["topology"], c.get("max_rate"), c.get("goodput"), c.get("goodput_per_instance")]
            for c in split.get("candidates", [])]
    return [f"Topology: `epdserve plan` on this host's profile, {split['instances']} instances (one per core), SLO "
            f"`{split['slo']}` with the baseline's routing, chose **{split['topology']}** ({split['reason']}).",
            "", markdown_table(["candidate", "predicted max rate (req/s)", "goodput (req/s)", "per instance"], rows), ""]


def before_lines(results: dict) -> list[str]:
    """P/D: the same goals against the baseline as P/D ran before decode kept a prefix cache
    (part of what the cache-aware build adds); the goals above count that cache in the baseline."""
    rows = results.get("goals_before") or []
    if not rows:
        return []
    return [f"The same goals against *{BEFORE}* (least-prefill without tiers, decode workers keeping no prefix "
            "cache: every request's whole prompt KV reserved on decode and sent, as P/D ran before the decode-side "
            "cache):", "",
            markdown_table(["rate (req/s)", "goodput ratio", "TTFT P99 cut", "goodput goal", "TTFT goal"],
                           [[g["request_rate"], g["goodput_ratio"],
                             None if g["ttft_p99_cut"] is None else pct(g["ttft_p99_cut"]),
                             verdict(g["is_goodput_met"]), verdict(g["is_ttft_met"])] for g in rows]), ""]


def describe_machines(results: dict) -> str:
    """What each worker ran on: per role a share of a core on given cores, one share for all
    (earlier results), or serve's own pinning."""
    per_role = results.get("machines")
    if per_role:
        return "; ".join(f"each {role} worker held to {m['share']:g} of a core on core "
                         f"{', '.join(map(str, m['cores']))}" for role, m in per_role.items()) + " (CPU quotas and pinning)"
    share = results.get("cpu_share")
    if share:
        return f"each worker held to {share:.2f} of a core by a CPU quota (a machine of that size)"
    if results.get("quota_wanted", True):
        return "no CPU quota (the cgroup controller was not writable here): the workers share the cores"
    return "one core per worker"


def build_report(results: dict, run: ExperimentRun, plot_names: list[str]) -> str:
    scale, work = results["scale"], results["workload"]
    topology = results["topology"]
    levels = results["trace"][topology]
    machines = describe_machines(results)
    goal_rows = results["goals"]
    headers, rows = crossover_table(results["crossover"])
    sized = (" (sized to this host by `epdserve plan --slo ttft_p90:auto` from the 90th-percentile prompt's "
             "prefill alone on its profile)" if results.get("slo_ttft_sized") else "")
    lines = [
        f"# {NAME}",
        "",
        (f"Workload: the first {work['num_conversations']} conversations of the Mooncake conversation trace with "
         f"≥ {scale['min_turns']} turns and every prompt ≤ {scale['max_input_len']} trace tokens: "
         f"{work['num_requests']} requests in the trace's arrival order, lengths × {scale['length_scale']:g} "
         f"(mean prompt {work['mean_prompt_tokens']:.0f}, output {work['mean_output_tokens']:.0f} tokens), "
         f"the trace's {work['span_s']:.0f} s compressed to each replay duration (the rate). "
         f"{pct(work['reusable_prompt_share'])} of prompt tokens repeat an earlier request's prefix (the ceiling "
         f"of any cache's hit rate). Pool: {scale['num_kv_blocks']} blocks of 16 tokens per worker (a few "
         f"conversations), {scale.get('decode_num_kv_blocks', scale['num_kv_blocks'])} per decode worker (the "
         f"running sequences' contexts; a full one queues new requests); tiers: host {scale['host_tier_gib']:g} GiB (shared memory, every worker of the host), disk "
         f"{scale['disk_tier_gib']:g} GiB. SLO per request: TTFT ≤ {scale['slo_ttft_ms']:g} ms{sized} and TPOT ≤ "
         f"{scale['slo_tpot_ms']:g} ms; goodput = requests/s within it. A fresh server per arm and rate."),
        "",
        *run.header_lines(),
        "",
        f"## {topology}: {machines}",
        "",
        *plan_lines(results),
        *knee_lines(results),
        markdown_table(["arm", "rate (req/s)", "goodput (req/s)", "within SLO", "TTFT P50 (ms)", "TTFT P99 (ms)",
                        "TPOT P99 (ms)", "prompt from pool", "from host tier", "from disk tier", "failed"],
                       trace_rows(levels)),
        "",
        f"Goals (prefix-aware with tiers against least-prefill without, same rate): goodput ≥ "
        f"{GOAL_GOODPUT_RATIO:g}×, TTFT P99 ≥ {100 * GOAL_TTFT_P99_CUT:.0f} % lower.",
        "",
        markdown_table(["rate (req/s)", "goodput ratio", "TTFT P99 cut", "goodput goal", "TTFT goal"],
                       [[g["request_rate"], g["goodput_ratio"],
                         None if g["ttft_p99_cut"] is None else pct(g["ttft_p99_cut"]),
                         verdict(g["is_goodput_met"]), verdict(g["is_ttft_met"])] for g in goal_rows]),
        "",
        *round_lines(results),
        *before_lines(results),
        "Prefill → decode (every arm and rate):",
        "",
        markdown_table(["arm", "rate (req/s)", "goodput (req/s)", "TTFT P50 (ms)", "TTFT P99 (ms)",
                        "prefill: from pool", "prefill: from tiers", "decode held", "KV P→D (MiB)",
                        "KV not sent (MiB)"], pd_rows(levels)),
        "",
        "## Reload or recompute",
        "",
        ("One worker, one core, a pool that holds one prompt: a prefix computed once, pushed out of the pool, "
         "requested again with a new 16-token suffix (one output token; TTFT measured by the client, median of "
         f"{scale['crossover_reps']}). *load* arms pin the rule to load; *rule* arms use the read bandwidth the "
         "worker measured at start and show what the rule chose, with its two predictions."),
        "",
        markdown_table(headers, rows),
        "",
        *[f"![{name}]({name})" for name in plot_names],
        "",
        "Commands:",
        "",
        *[f"- `{c}`" for c in results.get("commands", [])],
        "",
    ]
    return "\n".join(lines)


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    plt = pyplot()
    paths = []
    topology = results["topology"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm, levels in results["trace"][topology].items():
        rates = [lv["request_rate"] for lv in levels]
        ax1.plot(rates, [lv["request_goodput"] for lv in levels], marker="o", label=arm)
        ax2.plot(rates, [lv["ttft_p99_ms"] or 0 for lv in levels], marker="o", label=arm)
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("goodput (req/s)")
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("TTFT P99 (ms)")
    ax2.set_yscale("log")
    ax1.legend()
    ax1.set_title(f"Mooncake conversations, {topology}")
    paths.append(save_figure(fig, out_dir / "trace_goodput_ttft.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, points in results["crossover"].items():
        lengths = sorted({p["prefix_tokens"] for p in points})
        medians = [statistics.median(p["ttft_ms"] for p in points if p["prefix_tokens"] == n) for n in lengths]
        if "rule" not in name:
            ax.plot(lengths, medians, marker="o", label=name)
            continue
        last = {p["prefix_tokens"]: p for p in points}
        loads = [(n, m) for n, m in zip(lengths, medians) if last[n]["num_chosen_tokens"]]
        computes = [(n, m) for n, m in zip(lengths, medians) if not last[n]["num_chosen_tokens"]]
        if loads:
            ax.scatter(*zip(*loads), marker="^", s=70, facecolors="none", edgecolors="k",
                       label=f"{name}: chose load")
        if computes:
            ax.scatter(*zip(*computes), marker="x", s=70, color="k", label=f"{name}: chose recompute")
    ax.set_xlabel("cached prefix (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("reload or recompute, one core")
    ax.legend(fontsize=8)
    paths.append(save_figure(fig, out_dir / "reload_vs_recompute.png"))
    return paths
