"""PNG plots of one run: TTFT CDF, ITL CDF and a per-request timeline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from epdserve.bench import BenchError
from epdserve.bench.metrics import RequestOutput

PLOT_DPI = 120


def _cdf(ax, values_ms: Sequence[float], xlabel: str, title: str) -> None:
    if len(values_ms):
        data = np.sort(np.asarray(values_ms, dtype=np.float64))
        ax.step(data, np.arange(1, len(data) + 1) / len(data), where="post")
    else:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0.0, 1.02)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)


def _timeline(ax, outputs: Sequence[RequestOutput]) -> None:
    """One row per request: waiting for the first token, then streaming; failures in red."""
    for i, out in enumerate(outputs):
        if out.success:
            ax.barh(i, out.ttft_s, left=out.start_s, height=0.8, color="tab:orange", linewidth=0)
            ax.barh(
                i,
                out.latency_s - out.ttft_s,
                left=out.start_s + out.ttft_s,
                height=0.8,
                color="tab:blue",
                linewidth=0,
            )
        else:
            ax.barh(i, out.latency_s, left=out.start_s, height=0.8, color="tab:red", linewidth=0)
    from matplotlib.patches import Patch

    handles = [
        Patch(color=color, label=label)
        for color, label in (
            ("tab:orange", "send -> first token"),
            ("tab:blue", "first token -> end"),
            ("tab:red", "failed"),
        )
    ]
    ax.legend(handles=handles, loc="upper right")
    ax.set_xlabel("time since benchmark start (s)")
    ax.set_ylabel("request (in send order)")
    ax.set_title("Per-request timeline")
    ax.invert_yaxis()


def write_plots(outputs: Sequence[RequestOutput], directory: str) -> list[Path]:
    """Write ttft_cdf.png, itl_cdf.png and timeline.png into ``directory``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = Path(directory)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"cannot create plot directory {directory}: {e.strerror}") from None
    completed = [out for out in outputs if out.success]
    ttfts_ms = [out.ttft_s * 1000.0 for out in completed]
    itls_ms = [gap * 1000.0 for out in completed for gap in out.itl_s]
    paths = []
    for name, draw in (
        ("ttft_cdf.png", lambda ax: _cdf(ax, ttfts_ms, "TTFT (ms)", "Time to first token")),
        ("itl_cdf.png", lambda ax: _cdf(ax, itls_ms, "ITL (ms)", "Inter-token latency")),
        ("timeline.png", lambda ax: _timeline(ax, outputs)),
    ):
        height = max(4.0, min(20.0, 0.05 * len(outputs))) if name == "timeline.png" else 4.0
        fig, ax = plt.subplots(figsize=(8.0, height))
        draw(ax)
        fig.tight_layout()
        path = target / name
        fig.savefig(path, dpi=PLOT_DPI)
        plt.close(fig)
        paths.append(path)
    return paths
