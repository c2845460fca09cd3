"""``kv-exposure`` report: the rows, the seed's figures, the goal, and one plot."""

from __future__ import annotations

import statistics
from pathlib import Path

from epdserve.bench.experiments.report import (
    ExperimentRun,
    markdown_table,
    pyplot,
    save_figure,
    verdict,
)

NAME = "kv-exposure"
PLOT_NAME = "kv_exposure.png"
EXPOSED_SHARE_GOAL = 0.05  # layer-wise shm at the longest prompt: exposed <= 5 % of TTFT

SEED_LINES = [
    "Two H20 hosts, sglang + Mooncake, Qwen3-32B (KV 256 KB/token), P and D both TP2, NIC on the same NUMA node:",
    "",
    "- over RDMA the transfer exposes only 0.7–6.5 % of TTFT; over TCP TTFT is 7–33 % higher;",
    "- with long inputs most of the TCP transfer overlaps chunked prefill (32K: ~2.6 s per rank in",
    "  theory, 0.63 s exposed); with short inputs it is almost entirely exposed;",
    "- the first decode step (the second token's gap) is 12–15 ms on every path: decode does not wait",
    "  longer for the KV, but TTFT still contains the last piece of the transfer.",
]


def _label(row: dict) -> str:
    return f"{row['transport']} {'layer-wise' if row['layerwise'] else 'bulk'}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100.0 * value:.2f} %"


def goal_line(rows: list[dict]) -> str:
    shm_layerwise = [r for r in rows if r["transport"] == "shm" and r["layerwise"] and r["exposed_share_of_ttft"] is not None]
    if not shm_layerwise:
        return "- Layer-wise shm produced no successful request: goal not evaluated."
    longest = max(shm_layerwise, key=lambda r: r["prompt_len"])
    share = longest["exposed_share_of_ttft"]
    return (f"- Layer-wise shm at {longest['prompt_len']} tokens: exposed {longest['exposed_ms']:.2f} ms of a "
            f"{longest['ttft_ms']:.1f} ms TTFT = {_pct(share)} (goal ≤ {EXPOSED_SHARE_GOAL:.0%}: "
            f"{verdict(share <= EXPOSED_SHARE_GOAL)}).")


def _ttft_vs_shm(rows: list[dict]) -> dict[tuple[str, bool, int], float | None]:
    """TTFT of each row relative to layer-wise shm at the same prompt length (0.07 = 7 % more)."""
    base = {r["prompt_len"]: r["ttft_ms"] for r in rows if r["transport"] == "shm" and r["layerwise"]}
    return {
        (r["transport"], r["layerwise"], r["prompt_len"]):
            r["ttft_ms"] / base[r["prompt_len"]] - 1.0 if r["ttft_ms"] and base.get(r["prompt_len"]) else None
        for r in rows
    }


def build_report(
    rows: list[dict], rates: dict[str, float], commands: dict[str, str], veth_note: str, run: ExperimentRun,
    plot_name: str,
) -> str:
    """report.md: the table, the transports' rates, the seed's figures, the goal, why, commands."""
    vs_shm = _ttft_vs_shm(rows)
    headers = ["arm", "prompt", "KV bytes", "theory ms", "exposed ms", "TTFT ms", "exposed / TTFT",
               "TTFT vs shm l-w", "prefill ms", "TTFT − prefill ms", "2nd-token gap ms (max)"]
    table = [
        [_label(r), r["prompt_len"], r["kv_bytes"], r["theoretical_ms"], r["exposed_ms"], r["ttft_ms"],
         _pct(r["exposed_share_of_ttft"]), _pct(vs_shm[(r["transport"], r["layerwise"], r["prompt_len"])]),
         r["prefill_ms"], r["ttft_minus_prefill_ms"],
         f"{r['handoff_gap_ms']:.1f} ({r['handoff_gap_max_ms']:.1f})" if r["handoff_gap_ms"] is not None else "—"]
        for r in rows
    ]
    has_veth = any(r["transport"].startswith("tcp-veth") for r in rows)
    veth_text = (
        "tcp across a veth pair between two network namespaces created for the run, shaped with "
        "`tc qdisc ... tbf rate 10gbit`; the prefill and decode workers were started inside the namespaces "
        "(the serve command below started the router; its own workers were replaced)."
        + (f" Not every veth arm ran: {veth_note}." if veth_note else "")
        if has_veth else f"The veth arm did not run: {veth_note}."
    )
    return "\n".join([
        f"# {NAME}",
        "",
        ("One request at a time per prompt length on a 1P1D server (one core each), `max_tokens` 2. "
        "`exposed` is the server's `timing.exposed_transfer_ms`: the time from the end of the prefill's last "
        "layer to the transfer being reported done. `theory` is KV bytes over the transport's measured rate. "
         "The 2nd-token gap is measured by the client: decode starts only once the KV has landed."),
        "",
        *run.header_lines(),
        "",
        "Measured rates (one thread, GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in rates.items())
        + " (shm: memcpy into a shared-memory mapping; tcp: one loopback stream).",
        "",
        veth_text,
        "",
        markdown_table(headers, table),
        "",
        f"![exposed share of TTFT and second-token gap]({plot_name})",
        "",
        "Servers:",
        "",
        *[f"- {label}: `{command}`" for label, command in commands.items()],
        "",
        "## The seed's figures",
        "",
        *SEED_LINES,
        "",
        "## Goal",
        "",
        goal_line(rows),
        "",
        "## What matches and what does not, and why",
        "",
        *why_lines(rows, vs_shm),
        "",
    ])


def _span(values: list[float | None], unit: str, scale: float = 1.0, digits: int = 1, signed: bool = False) -> str:
    """``"2.15–2.85 ms"``: the range of the values that are known, scaled."""
    known = [v * scale for v in values if v is not None]
    if not known:
        return "—"
    sign = "+" if signed else ""
    return f"from {min(known):{sign}.{digits}f} to {max(known):{sign}.{digits}f}{unit}"


def why_lines(rows: list[dict], vs_shm: dict) -> list[str]:
    """The comparison with the seed, with this run's numbers in it."""
    ok = [r for r in rows if r["exposed_ms"] is not None]
    layerwise = [r for r in ok if r["layerwise"]]
    bulk = [r for r in ok if not r["layerwise"]]
    longest = max((r["prompt_len"] for r in ok), default=0)
    slowest = min((r for r in ok if r["prompt_len"] == longest), key=lambda r: r["bandwidth_gbps"], default=None)
    per_token_ms = [r["prefill_ms"] / r["prompt_len"] for r in layerwise if r["prefill_ms"]]
    per_token_kb = [r["kv_bytes"] / r["prompt_len"] / 1e3 for r in ok if r["kv_bytes"]]
    lines = [
        (f"- Layer-wise, the exposed part is {_span([r['exposed_ms'] for r in layerwise], ' ms', digits=2)} on every "
         f"transport and prompt length, {_span([r['exposed_share_of_ttft'] for r in layerwise], ' %', 100.0, 2)} "
         "of TTFT (the seed: 0.7–6.5 % over RDMA)."),
        "  It does not grow with the KV bytes: it is the worker loop's delay in reporting the transfer,",
        "  not data in flight. The share is far below the seed's because prefill on a CPU core costs",
        (f"  {_span(per_token_ms, ' ms', digits=2)} per prompt token while a token's KV "
         f"({statistics.median(per_token_kb) if per_token_kb else 0.0:.1f} KB) moves in microseconds; on GPUs "
         "prefill is orders of"),
        "  magnitude faster per token and KV per token ~10× larger (256 KB for the seed's model).",
    ]
    if slowest is not None:
        same = [r for r in ok if r["transport"] == slowest["transport"] and r["prompt_len"] == longest]
        by_mode = {r["layerwise"]: r for r in same}
        if True in by_mode and False in by_mode:
            bulk_row, layerwise_row = by_mode[False], by_mode[True]
            is_exposed = bulk_row["handoff_gap_ms"] > layerwise_row["handoff_gap_ms"]
            lines += [
                (f"- Bulk transfer over the slowest link ({slowest['transport']}) exposes "
                 f"{bulk_row['exposed_ms']:.1f} ms at {longest} tokens against "
                 f"{bulk_row['theoretical_ms']:.1f} ms in theory; the second token waits "
                 f"{bulk_row['handoff_gap_ms']:.1f} ms, layer-wise {layerwise_row['handoff_gap_ms']:.1f} ms."),
                "  Without overlap the transfer is on the critical path, as the seed finds for short inputs."
                if is_exposed else "  At this size the difference is below the run-to-run noise.",
            ]
    lines += [
        (f"- Bulk exposure across all links: {_span([r['exposed_ms'] for r in bulk], ' ms', digits=2)}. What "
         "`exposed` counts: with shm the copy into the decode worker's pages runs inside the"),
        "  prefill worker's step (it lengthens `prefill_ms`, bulk mode included), so `exposed` is only",
        "  the reporting delay; with tcp the sender reports done once the last frame is in the kernel's",
        "  socket buffer, before the decode worker has read it. The 2nd-token gap shows the remainder.",
        (f"- TTFT relative to layer-wise shm ranges {_span(list(vs_shm.values()), ' %', 100.0, signed=True)}, "
         "but TTFT less the prefill time is"),
        (f"  {_span([r['ttft_minus_prefill_ms'] for r in ok], ' ms')} in every arm: the differences are in the "
         "prefill compute (run-to-run variation), not in the transfer,"),
        "  unlike the seed's 7–33 % for TCP. The prefill worker samples and streams the first token itself,",
        "  so a transfer still in flight delays the second token, never the first. Every link here is on",
        "  one host (loopback TCP, and a veth pair shaped to 10 Gbit/s where it ran), standing in for the",
        "  seed's two hosts and NICs.",
    ]
    return lines


def write_plot(rows: list[dict], out_dir: Path) -> Path:
    """Exposed share of TTFT (left) and the second-token gap (right) against prompt length."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11.0, 4.0))
    for label in dict.fromkeys(_label(r) for r in rows):
        mine = [r for r in rows if _label(r) == label and r["ttft_ms"] is not None]
        lens = [r["prompt_len"] for r in mine]
        left.plot(lens, [100.0 * r["exposed_share_of_ttft"] for r in mine], marker="o", label=label)
        right.plot(lens, [r["handoff_gap_ms"] for r in mine], marker="o", label=label)
    left.axhline(100.0 * EXPOSED_SHARE_GOAL, color="gray", linestyle="--", linewidth=1)
    left.set_ylabel("exposed transfer / TTFT (%)")
    right.set_ylabel("gap between 1st and 2nd token (ms)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, out_dir / PLOT_NAME)
