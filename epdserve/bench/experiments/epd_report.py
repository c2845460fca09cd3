"""``epd`` report: TTFT per arm and workload, bytes per hop, the seed's figures, the goal,
why, and two plots (stacked TTFT decomposition, one multi-image request's timeline)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from epdserve.bench import BenchError
from epdserve.bench.experiments.report import ExperimentRun, markdown_table, pyplot, save_figure, verdict

NAME = "epd"
PIPELINE_GOAL = 0.7  # pipelined E/P/D TTFT P50 for the multi-image load at most this x unpipelined
CHUNKED_ARM = "epd_no_pipeline_chunk256"

SEED_TABLE = markdown_table(
    ["seed: H20, Qwen3.5-397B-FP8 TP8; E/P/D adds 4 encoder GPUs on another machine (RDMA)",
     "E/P/D vs colocated TTFT"],
    [["8 images per request, idle", "−31 %"], ["8 images per request, under load", "−40 to −61 %"],
     ["one image per request", "+10 to +68 % (the extra hop)"]],
)
# (label, key in the server's timing means, colour); the rest of the client's TTFT is "other".
SEGMENTS = (("queue", "queue_ms", "tab:gray"), ("encode span", "encode_ms", "tab:orange"),
            ("prefill after last embedding", "prefill_ms", "tab:blue"),
            ("KV blocking", "kv_blocking_ms", "tab:red"), ("first token out", "first_token_ms", "tab:green"))



# The run's scale, which the experiment runs (epd.py defines FULL and QUICK) and this report describes.
@dataclass(frozen=True)
class ImageLoad:
    """One workload: ``num_images`` distinct ``width`` x ``height`` JPEGs per request."""

    name: str
    num_images: int
    width: int  # pixels
    height: int

    def __post_init__(self) -> None:
        if self.num_images < 1 or min(self.width, self.height) < 1:
            raise BenchError(f"workload {self.name!r} needs at least one image of at least 1x1 pixels")


@dataclass(frozen=True)
class Scale:
    loads: tuple[ImageLoad, ...]
    num_requests: int  # measured requests per (arm, workload)
    num_warmup: int  # requests per (arm, workload) sent first and discarded
    prompt_len: int  # random text tokens per request, besides the images
    output_len: int  # max_tokens, with ignore_eos
    max_model_len: int
    kv_cache_gib: float
    request_timeout_s: float
    has_extra_arms: bool  # also epd_no_pipeline_chunk256, e_colocated and epd_batch2

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_warmup < 0 or self.output_len < 1:
            raise BenchError("an epd scale needs >= 1 measured request, >= 0 warm-up and >= 1 output token")


def arm_names(results: dict, scale: Scale) -> list[str]:
    return [k for k, v in results.items() if isinstance(v, dict) and scale.loads[0].name in v]


def _bd(results: dict, arm: str, load: str, key: str) -> float:
    """A mean of the server's timing (ms); 0.0 when the arm or value is missing."""
    value = results.get(arm, {}).get(load, {}).get("breakdown_mean_ms", {}).get(key)
    return float(value) if value is not None else 0.0


def _p50(results: dict, arm: str, load: str) -> float:
    return float(results.get(arm, {}).get(load, {}).get("ttft_p50_ms") or 0.0)


def _div(top: float, bottom: float) -> float | None:
    return top / bottom if bottom else None


def _x(ratio: float | None, digits: int = 2) -> str:
    return "—" if ratio is None else f"{ratio:.{digits}f}"


def _pct(ratio: float | None) -> str:
    """A TTFT ratio as a change: 0.7 -> "−30 %"; None -> "—"."""
    if ratio is None:
        return "—"
    change = 100 * (ratio - 1)
    return f"{'+' if change >= 0 else '−'}{abs(change):.0f} %"


def _bytes(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def ttft_table(results: dict, scale: Scale) -> str:
    headers = ["arm", "load", "TTFT P50", "TTFT P99", "E2E P50", "queue", "encode span", "prefill overlap (span)",
               "prefill after last embedding", "KV blocking", "first token", "client − server", "other work CPU %",
               "errors"]
    rows = []
    for arm in arm_names(results, scale):
        for load in scale.loads:
            c = results[arm][load.name]
            b = c["breakdown_mean_ms"]
            rows.append([arm, load.name, c["ttft_p50_ms"], c["ttft_p99_ms"], c["e2e_p50_ms"], b["queue_ms"],
                         b["encode_ms"], b["prefill_overlap_ms"], b["prefill_ms"], b["kv_blocking_ms"],
                         b["first_token_ms"], c["client_minus_server_ms"], 100 * c["other_cpu_share"],
                         c["num_errors"]])
    return markdown_table(headers, rows)


def _dtype_bytes(expected: dict) -> int:
    """Bytes per element of the dtype the servers ran in (results before it was recorded: bf16)."""
    return 4 if expected.get("dtype") == "float32" else 2


def bytes_table(results: dict, scale: Scale) -> str:
    expected = results["expected"]
    dtype_bytes = _dtype_bytes(expected)
    headers = ["arm", "load", "E→P B/image (measured)", f"tokens × hidden × {dtype_bytes} B", "P→D KV B/request",
               "E→P : P→D"]
    rows = []
    for arm in arm_names(results, scale):
        for load in scale.loads:
            c, e = results[arm][load.name], expected["loads"][load.name]
            tokens, hidden = e["num_image_tokens"], expected["hidden_size"]
            formula = f"{tokens} × {hidden} × {dtype_bytes} = {e['embedding_bytes_per_image']:,}"
            rows.append([arm, load.name, _bytes(c["embedding_bytes_per_image"]), formula,
                         _bytes(c["kv_bytes_per_request"]), _x(c["e_to_p_over_p_to_d"], 3)])
    return markdown_table(headers, rows)


def pipeline_bound(results: dict, multi: str, num_images: int, prefill_ms: float) -> float | None:
    """The best pipelined / unpipelined ratio from the unpipelined arm's means: encode E and
    prefill P (``prefill_ms``) overlap except one image's share of the shorter stage,
    (max(E, P) + min(E, P) / n + rest) / (E + P_unpipelined + rest)."""
    encode, prefill = _bd(results, "epd_no_pipeline", multi, "encode_ms"), _bd(results, "epd_no_pipeline", multi,
                                                                               "prefill_ms")
    total = _p50(results, "epd_no_pipeline", multi)
    if not total or not encode or not prefill_ms:
        return None
    rest = max(0.0, total - encode - prefill)
    return (max(encode, prefill_ms) + min(encode, prefill_ms) / num_images + rest) / total


def build_report(results: dict, scale: Scale, commands: dict[str, str], run: ExperimentRun,
                 plot_names: list[str]) -> str:
    """report.md: the tables, the seed's figures, the goal, why, the commands."""
    small, multi = scale.loads[0], scale.loads[-1]
    return "\n".join([
        f"# {NAME}",
        "",
        (f"Requests one at a time (concurrency 1), chat API, {scale.prompt_len} random text tokens plus images, "
         f"{scale.output_len} output tokens with `ignore_eos`; {scale.num_warmup} warm-up then "
         f"{scale.num_requests} measured requests per cell. `{small.name}`: {small.num_images} image of "
         f"{small.width}x{small.height} per request; `{multi.name}`: {multi.num_images} images of "
         f"{multi.width}x{multi.height}. Every image is distinct (no encoder-cache hits); every arm gets the same "
         "requests on a fresh server and the same two cores. TTFT is client-measured (ms); the other columns are "
         "means of the server's `timing` (ms). Encode span: first image's encode start to last embedding in the "
         "consumer. Prefill overlap (span): first prefill chunk to last embedding, waits for embeddings included "
         "(a wall span, not compute). Other work CPU %: the share of the machine's CPU time that processes outside "
         "this experiment used during the cell's measured requests (other work skews every timing)."),
        "",
        *run.header_lines(),
        "",
        ttft_table(results, scale),
        "",
        bytes_table(results, scale),
        "",
        *[f"![{name}]({name})" for name in plot_names],
        "",
        "## Against colocated, and the seed",
        "",
        (f"- E/P/D / colocated TTFT P50, `{small.name}`: {_x(results['epd_over_colocated_small'])} "
         f"({_pct(results['epd_over_colocated_small'])}; the seed for one image: +10 to +68 %)."),
        (f"- E/P/D / colocated TTFT P50, `{multi.name}`: {_x(results['epd_over_colocated_multi'])} "
         f"({_pct(results['epd_over_colocated_multi'])}; the seed for 8 images: −31 % idle, "
         "−40 to −61 % loaded)."),
        "",
        SEED_TABLE,
        "",
        "## Goal",
        "",
        goal_line(results, scale),
        "",
        "## Why",
        "",
        *why_lines(results, scale),
        "",
        "Server per arm:",
        "",
        *[f"- `{arm}`: `{command}`" for arm, command in commands.items()],
        "",
    ])


def goal_line(results: dict, scale: Scale) -> str:
    ratio = results["pipelined_over_unpipelined_multi"]
    multi = scale.loads[-1]
    prefill = _bd(results, CHUNKED_ARM, multi.name, "prefill_ms") or _bd(results, "epd_no_pipeline", multi.name,
                                                                         "prefill_ms")
    bound = pipeline_bound(results, multi.name, multi.num_images, prefill)
    return (f"- Pipelined / unpipelined E/P/D TTFT P50, `{multi.name}`: {_x(ratio)} "
            f"(goal ≤ {PIPELINE_GOAL:g}: {verdict(ratio is not None and ratio <= PIPELINE_GOAL)}); the best "
            f"pipelining can do with these stage times is {_x(bound)} (see below).")


def why_lines(results: dict, scale: Scale) -> list[str]:
    """The explanation, with this run's numbers in it."""
    expected = results["expected"]
    dtype_bytes = _dtype_bytes(expected)
    small, multi, n = scale.loads[0].name, scale.loads[-1].name, scale.loads[-1].num_images
    enc1, enc2 = _bd(results, "epd", small, "encode_ms"), _bd(results, "colocated", small, "encode_ms")
    pre1, pre2 = _bd(results, "epd_no_pipeline", small, "prefill_ms"), _bd(results, "colocated", small, "prefill_ms")
    enc_np, pre_np = _bd(results, "epd_no_pipeline", multi, "encode_ms"), _bd(results, "epd_no_pipeline", multi,
                                                                               "prefill_ms")
    enc_p, after = _bd(results, "epd", multi, "encode_ms"), _bd(results, "epd", multi, "prefill_ms")
    pre_chunked = _bd(results, CHUNKED_ARM, multi, "prefill_ms") or pre_np
    idle = max(0.0, enc_p - (pre_chunked - after))  # prefill worker's time without work in the encode span
    waits = ("after the first image it never waited for an embedding" if idle <= 1.1 * enc_np / n
             else "it also waited for later embeddings")
    col_small, col_multi = _p50(results, "colocated", small), _p50(results, "colocated", multi)
    epd_small, epd_multi = _p50(results, "epd", small), _p50(results, "epd", multi)
    small_ratio, ratio = _div(epd_small, col_small), results["pipelined_over_unpipelined_multi"]
    lines = [
        (f"- Threads: one tile encodes in {enc1:.0f} ms on an encode worker's one core and in {enc2:.0f} ms on the "
         f"colocated worker's two threads ({_x(_div(enc1, enc2))}×); the small request's prefill takes {pre1:.0f} "
         f"vs {pre2:.0f} ms ({_x(_div(pre1, pre2))}×). E/P/D runs each stage on one core; colocated runs each stage "
         "on both, one after the other. On the same cores a split wins only where overlapping the stages gains "
         "more than the second thread did."),
        (f"- `{small}`: nothing overlaps (only the short text before the image can prefill while it encodes), so "
         f"E/P/D is one-core encode + one-core prefill: {epd_small:.0f} vs {col_small:.0f} ms colocated "
         f"({_pct(small_ratio)}; the seed: +10 to +68 %). The hop itself is small: writing the embedding into the "
         f"prefill worker's slab takes {_bd(results, 'epd', small, 'embed_transfer_ms'):.1f} ms, the rest of it is "
         "two messages through the router."),
        (f"- `{multi}` unpipelined: encode span {enc_np:.0f} ms ({enc_np / n:.0f} per image), then prefill "
         f"{pre_np:.0f} ms ({pre_np / n:.0f} per image; {pre1:.0f} ms for the small request's one image: later "
         "images attend over all earlier tokens). Prefill is the longer stage, and pipelining can hide at most "
         f"the shorter one less one image's share: bound {_x(pipeline_bound(results, multi, n, pre_np))} from "
         "these means."),
    ]
    if CHUNKED_ARM in results:
        lines.append(
            f"- Pipelined prefill runs image-sized chunks. Cut into 256-token chunks the same unpipelined prefill "
            f"takes {pre_chunked:.0f} ms ({_pct(_div(pre_chunked, pre_np))} over one 2048-token chunk; a later chunk "
            "copies the earlier tokens' KV out of the paged cache in every layer, and every step has fixed costs), "
            "which moves the bound to "
            f"{_x(pipeline_bound(results, multi, n, pre_chunked))}.")
    lines += [
        (f"- `{multi}` pipelined: encode span {enc_p:.0f} ms (unpipelined {enc_np:.0f}), then {after:.0f} ms of "
         f"prefill after the last embedding; so about {max(0.0, pre_chunked - after):.0f} ms of the "
         f"{pre_chunked:.0f} ms chunked prefill ran inside the encode span and the prefill worker sat idle for "
         f"about {idle:.0f} ms of it, against {enc_np / n:.0f} ms to encode the first image: "
         f"{waits}. Measured ratio {_x(ratio)}."),
        (f"- Against colocated, `{multi}`: {epd_multi:.0f} vs {col_multi:.0f} ms "
         f"({_pct(_div(epd_multi, col_multi))}). Pipelined E/P/D costs about one image's encode plus the whole "
         "prefill on one core; colocated costs encode plus prefill at two threads. With two threads worth about "
         f"{_x(_div(pre1, pre2), 1)}×, the split wins only when the longer stage is under about "
         f"{_x(_div(100.0, _div(pre1, pre2) or 1.0), 0)} % of the sum; prefill here is "
         f"{_x(_div(100 * pre_np, pre_np + enc_np), 0)} %. The seed's gain came with four extra encoder GPUs, "
         "not from splitting the same hardware."),
        (f"- Bytes: an image token's embedding is {expected['hidden_size']} × {dtype_bytes} = "
         f"{expected['hidden_size'] * dtype_bytes:,} B ({expected.get('dtype', 'bfloat16')}) "
         f"and its KV {expected['kv_bytes_per_token']:,} B (2 × layers × KV heads × head dim × {dtype_bytes} B), so "
         f"E→P is 1/{_x(_div(expected['kv_bytes_per_token'], expected['hidden_size'] * dtype_bytes), 0)} of P→D "
         "per image token "
         "and P→D also carries the text's KV. Both hops are shared-memory copies on one machine here."),
    ]
    busiest = max(((100 * results[a][load.name]["other_cpu_share"], f"{a}/{load.name}")
                   for a in arm_names(results, scale) for load in scale.loads), default=(0.0, "—"))
    if busiest[0] < 1.0:
        lines.append("- Other work on the machine used under 1 % of its CPU time in every cell.")
    else:
        lines.append(f"- Other work on the machine took up to {busiest[0]:.0f} % of its CPU time during a cell "
                     f"({busiest[1]}); a cell with more than a few percent is slower than this machine alone "
                     "would be, the colocated arm most (its two threads wait for each other).")
    if "e_colocated" in results:
        lines.append(
            f"- `e_colocated` (encode worker on one core, a colocated worker on the other, no P→D hop): "
            f"`{small}` {_p50(results, 'e_colocated', small):.0f} ms, `{multi}` "
            f"{_p50(results, 'e_colocated', multi):.0f} ms.")
    if "epd_batch2" in results:
        lines.append(
            f"- Two images per encoder pass (`epd_batch2`): `{multi}` {_p50(results, 'epd_batch2', multi):.0f} ms vs "
            f"{epd_multi:.0f} ms with one; embeddings arrive in pairs, so prefill starts later.")
    return lines


def write_plots(results: dict, scale: Scale, out_dir: Path) -> list[Path]:
    """ttft_breakdown.png (stacked means per cell, P50 marked) and timeline.png (the median
    multi-image request per arm: encode span, prefill span, first token)."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = arm_names(results, scale)
    fig, axes = plt.subplots(1, len(scale.loads), figsize=(5.0 * len(scale.loads) + 2.0, 4.4), squeeze=False)
    for ax, load in zip(axes[0], scale.loads):
        for x, arm in enumerate(arms):
            cell = results[arm][load.name]
            bottom = 0.0
            for label, key, colour in SEGMENTS:
                height = cell["breakdown_mean_ms"].get(key) or 0.0
                ax.bar(x, height, bottom=bottom, color=colour, label=label if x == 0 else None)
                bottom += height
            other = max(0.0, (cell["ttft_mean_ms"] or 0.0) - bottom)
            ax.bar(x, other, bottom=bottom, color="tab:purple", label="HTTP / router / other" if x == 0 else None)
            if cell["ttft_p50_ms"] is not None:
                ax.plot(x, cell["ttft_p50_ms"], "k_", markersize=18, label="TTFT P50" if x == 0 else None)
        ax.set_xticks(range(len(arms)), arms, rotation=25, ha="right", fontsize=7)
        ax.set_ylabel("ms (mean TTFT, stacked)")
        ax.set_title(f"{load.name}: {load.num_images} × {load.width}x{load.height}", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0, -1].legend(*axes[0, 0].get_legend_handles_labels(), fontsize=7, loc="upper left",
                       bbox_to_anchor=(1.0, 1.0))
    paths = [save_figure(fig, out_dir / "ttft_breakdown.png")]

    multi = scale.loads[-1].name
    fig, ax = plt.subplots(figsize=(10.0, 1.0 + 0.6 * len(arms)))
    for y, arm in enumerate(arms):
        t = results[arm][multi]["timeline"] or {}
        for key, offset, colour, label in (("encode", 0.15, "tab:orange", "encode span"),
                                           ("prefill", -0.15, "tab:blue", "prefill span")):
            start, end = t.get(f"{key}_start"), t.get(f"{key}_end")
            if start is not None and end is not None:
                ax.barh(y + offset, end - start, left=start, height=0.28, color=colour,
                        label=label if y == 0 else None)
        if t.get("first_token") is not None:
            ax.plot(t["first_token"], y, "k|", markersize=16, label="first token (server)" if y == 0 else None)
    ax.set_yticks(range(len(arms)), arms, fontsize=8)
    ax.set_xlabel(f"ms since the request arrived (the median-TTFT `{multi}` request of each arm)")
    ax.set_xlim(left=0.0)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    paths.append(save_figure(fig, out_dir / "timeline.png"))
    return paths
