"""What every experiment writes: ``results.json``, ``report.md`` and the machine it ran on."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epdserve.bench import BenchError


@dataclass(frozen=True)
class ExperimentRun:
    """One invocation of an experiment: what its report's header states."""

    name: str
    out_dir: Path
    is_quick: bool
    busy_at_start: float  # share of CPU time other work used just before it started

    @property
    def command(self) -> str:
        """The command that reproduces the experiment's files."""
        return f"epdserve bench experiment {self.name} --out {self.out_dir}" + (" --quick" if self.is_quick else "")

    def header_lines(self) -> list[str]:
        """The report's command and machine lines."""
        return [f"Command: `{self.command}`  ", f"Machine: {machine_summary(self.busy_at_start)}"]


def begin(name: str, out_dir: Path, is_quick: bool) -> ExperimentRun:
    """Note the start of an experiment (and how busy the machine is: that skews every timing)."""
    return ExperimentRun(name, out_dir, is_quick, cpu_busy_share())


CPU_SAMPLE_S = 1.0  # how long cpu_busy_share watches the machine


def machine_ticks() -> tuple[int, int]:
    """(all, busy) CPU time of every CPU since boot, in clock ticks (/proc/stat)."""
    with open("/proc/stat", encoding="utf-8") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return sum(fields), sum(fields) - fields[3] - fields[4]  # idle and iowait are not busy


def process_ticks(pids: list[int]) -> int:
    """CPU time (user + system, clock ticks) that these processes have used; one that has
    exited counts 0, so other work computed from it is overstated, never hidden."""
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            ticks += int(stat[11]) + int(stat[12])  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            pass
    return ticks


def cpu_busy_share(sample_s: float = CPU_SAMPLE_S) -> float:
    """Fraction of all CPU time spent busy over the next ``sample_s`` seconds (from /proc/stat).
    Taken before an experiment starts anything, it is other work on the machine, which skews
    every timing."""
    try:
        total_before, busy_before = machine_ticks()
        time.sleep(sample_s)
        total_after, busy_after = machine_ticks()
    except (OSError, ValueError, IndexError):
        return float("nan")
    total = total_after - total_before
    return (busy_after - busy_before) / total if total > 0 else 0.0


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return model


def machine_summary(busy_at_start: float | None = None) -> str:
    """One line: CPU model, cores this process may use, memory, OS, and (when given) the share
    of CPU time other work used just before the experiment started."""
    model = cpu_model()
    try:
        num_mem_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory = f"{num_mem_bytes / 2**30:.0f} GiB RAM"
    except (ValueError, OSError):
        memory = "unknown RAM"
    summary = f"{model}; {len(os.sched_getaffinity(0))} cores usable; {memory}; {platform.system()} {platform.release()}"
    if busy_at_start is not None:
        summary += f"; CPU busy with other work just before the start: {100 * busy_at_start:.0f} %"
    return summary


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: floats rounded, None as an em dash."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; cells go through ``fmt``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(is_met: bool) -> str:
    return "met" if is_met else "not met"


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON, creating the parent directory."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e.strerror}") from None


def write_outputs(out_dir: Path, results: Any, report_md: str) -> None:
    """Write ``results.json`` and ``report.md`` into ``out_dir`` (created if missing)."""
    write_json(out_dir / "results.json", results)
    try:
        (out_dir / "report.md").write_text(report_md, encoding="utf-8")
    except OSError as e:
        raise BenchError(f"cannot write {out_dir / 'report.md'}: {e.strerror}") from None


def save_figure(fig: Any, path: Path) -> Path:
    """Save a matplotlib figure as PNG and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
