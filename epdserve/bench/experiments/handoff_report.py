"""``handoff-paths`` report: the table, the seed's figures beside it, the goals, the plot."""

from __future__ import annotations

from pathlib import Path

from epdserve.bench.experiments.report import (
    ExperimentRun,
    markdown_table,
    pyplot,
    save_figure,
    verdict,
)

NAME = "handoff-paths"
PLOT_NAME = "handoff_paths.png"
SLAB_VS_PICKLE_GOAL = 5.0  # the slab path at least this many times faster than pickle
SLAB_VS_MEMCPY_GOAL = 1.3  # and at most this many times a plain memcpy of the same bytes

SEED_TABLE = markdown_table(
    ["path (seed, 37 MB, H20 host, PCIe Gen5)", "ms", "GB/s"],
    [
        ["pickle (dumps + shm + loads + H2D)", "45–61", "0.6–0.8"],
        ["preallocated shm + memcpy + H2D, no pickle", "~7.6", "~4.9"],
        ["  (pageable copy alone; a fresh allocation each time)", "—", "13–16; ~3"],
        ["pinned memory D2H / H2D", "~0.7 each", "54"],
        ["CUDA IPC registered slab, across cards (NVLink)", "0.11", "363"],
        ["CUDA IPC registered slab, same card", "0.03", "—"],
    ],
)


def _by(rows: list[dict], size: str) -> dict[str, dict]:
    return {row["path"]: row for row in rows if row["size"] == size}


def goal_lines(rows: list[dict]) -> list[str]:
    """One bullet per size: the slab path against pickle and against memcpy."""
    lines = []
    for size in dict.fromkeys(row["size"] for row in rows):
        paths = _by(rows, size)
        slab, pickled, memcpy = paths["registered_slab"], paths["pickle_socket"], paths["memcpy"]
        speedup = pickled["ms"] / slab["ms"]
        over_memcpy = slab["ms"] / memcpy["ms"]
        lines.append(
            f"- {size}: registered slab {slab['ms']:.3f} ms is {speedup:.1f}× faster than pickle "
            f"(goal ≥ {SLAB_VS_PICKLE_GOAL:g}×: {verdict(speedup >= SLAB_VS_PICKLE_GOAL)}) and "
            f"{over_memcpy:.2f}× a plain memcpy of {memcpy['ms']:.3f} ms "
            f"(goal ≤ {SLAB_VS_MEMCPY_GOAL:g}×: {verdict(over_memcpy <= SLAB_VS_MEMCPY_GOAL)}); "
            f"with the producer writing in place only the descriptor crosses: "
            f"{paths['registered_slab_in_place']['ms']:.3f} ms."
        )
    return lines


EXPECTED_ORDER = ("pickle_socket", "fresh_shm", "prealloc_shm_memcpy", "registered_slab", "registered_slab_in_place")


def why_lines(rows: list[dict]) -> list[str]:
    """The data-dependent part of the comparison: the ordering and the slab path's overhead."""
    sizes = list(dict.fromkeys(row["size"] for row in rows))
    is_ordered = all(
        [_by(rows, size)[p]["ms"] for p in EXPECTED_ORDER] == sorted((_by(rows, size)[p]["ms"] for p in EXPECTED_ORDER),
                                                                      reverse=True)
        for size in sizes
    )
    overheads = ", ".join(
        f"{100 * (_by(rows, size)['registered_slab']['ms'] / _by(rows, size)['memcpy']['ms'] - 1):.0f} % at {size}"
        for size in sizes
    )
    in_place = ", ".join(f"{_by(rows, size)['registered_slab_in_place']['ms']:.3f} ms at {size}" for size in sizes)
    first = _by(rows, sizes[0])
    return [
        ("- The ordering the seed's figures imply holds at every size: pickle, then a fresh segment per transfer (every"
         if is_ordered else "- The ordering the seed's figures imply does not hold at every size: pickle, then a fresh segment (every"),
        "  transfer faults in new pages), then a preallocated segment (two copies, in and out), then the",
        "  registered slab (one copy, or none when the producer writes into it).",
        f"- The slab path costs one copy plus the descriptor's round trip ({in_place}, the in-place rows);",
        (f"  over a plain memcpy that is {overheads}. The round trip is fixed, so it weighs more the smaller "
         "the tensor."),
        (f"- The preallocated path takes {first['prealloc_shm_memcpy']['ms']:.1f} ms at {sizes[0]} against the "
         "seed's ~7.6 ms: the receiver copies out into newly"),
        "  allocated memory and faults its pages in each time, where the seed's copy went into GPU memory",
        "  its allocator had already mapped.",
    ]


def build_report(rows: list[dict], run: ExperimentRun, plot_name: str) -> str:
    """report.md: our table, the seed's, the goals, what matches and why, the command."""
    headers = ["size", "path", "ms (median)", "min–max ms", "GB/s", "× memcpy", "pickle ÷ path"]
    table_rows = []
    for size in dict.fromkeys(row["size"] for row in rows):
        paths = _by(rows, size)
        pickle_ms = paths["pickle_socket"]["ms"]
        for path, row in paths.items():
            table_rows.append([
                size, path, f"{row['ms']:.3f}", f"{row['ms_min']:.3f}–{row['ms_max']:.3f}", row["gbps"],
                row["vs_memcpy"], pickle_ms / row["ms"],
            ])
    big = _by(rows, rows[0]["size"])
    memcpy_gbps = big["memcpy"]["gbps"]
    return "\n".join([
        f"# {NAME}",
        "",
        "Handing one bf16 tensor (an image embedding) from one process to another, timed from the",
        "sender holding it in its own memory until the receiver holds a usable tensor with the same",
        "bytes (checked by checksum). Median of the repeats; `memcpy` is the same bytes copied once",
        "inside one process.",
        "",
        *run.header_lines(),
        "",
        markdown_table(headers, table_rows),
        "",
        f"![hand-off time per path]({plot_name})",
        "",
        "## The seed's figures (H20 GPU host)",
        "",
        SEED_TABLE,
        "",
        "## Goals",
        "",
        *goal_lines(rows),
        "",
        "## What matches and what does not, and why",
        "",
        *why_lines(rows),
        "- Absolute times do not match and should not: this host has no GPU, so every copy runs at",
        f"  CPU memcpy speed ({memcpy_gbps:.1f} GB/s measured here) instead of over NVLink",
        "  (363 GB/s) or within HBM. The seed's 0.03–0.11 ms slab figures are that one copy on GPU",
        "  memory; here the same single copy is the `registered_slab` row, and the descriptor alone",
        "  (the `registered_slab_in_place` row) is the socket round trip.",
        "- The seed's pickle and preallocated paths also include a host-to-device copy that a CPU",
        "  host does not have; their pickle went through shared memory, this one through a TCP",
        "  loopback socket, which adds the kernel's socket copies to the pickling cost.",
        "",
    ])


def write_plot(rows: list[dict], out_dir: Path) -> Path:
    """Bars of milliseconds per path (log scale), one group per size."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = list(dict.fromkeys(row["size"] for row in rows))
    paths = list(dict.fromkeys(row["path"] for row in rows))
    fig, ax = plt.subplots(figsize=(9.0, 4.5))
    width = 0.8 / len(sizes)
    for i, size in enumerate(sizes):
        by_path = _by(rows, size)
        ax.bar([p + i * width for p in range(len(paths))], [by_path[p]["ms"] for p in paths], width, label=size)
    ax.set_xticks([p + width * (len(sizes) - 1) / 2 for p in range(len(paths))])
    ax.set_xticklabels(paths, rotation=20, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms until the receiver has the tensor (median)")
    ax.set_title("Hand-off of one bf16 tensor between processes")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return save_figure(fig, out_dir / PLOT_NAME)
