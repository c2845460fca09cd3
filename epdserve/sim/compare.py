"""A simulated run beside a real one: ``epdserve simulate ... --compare-to RESULT.json``.

Both sides write bench's result keys (``bench/report.py`` ``build_result``; the simulator's
``sim/results.py``), so the comparison is key by key: throughputs, goodput, and the mean,
median and percentiles of TTFT, TPOT, ITL and E2E latency that both carry. The error is
(simulated - real) / real. Goodput compares only when both runs scored the same SLOs (each
result says which in ``goodput_slos_ms``; a run without them has no goodput). Beside them, not
in the mean error, the mean of each TTFT part (``ttft_breakdown_ms``: queue, encode, prefill,
exposed transfer, first token, with the server's meanings) where both results carry it: which
part of the TTFT the simulation gets wrong.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from epdserve.errors import ConfigError

SCALARS = ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput")
LATENCY_KEY = re.compile(r"^(mean|median|p\d+(?:\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")
_LATENCY_ORDER = ("ttft", "tpot", "itl", "e2el")


def load_result(path: str) -> dict[str, Any]:
    """A result file of ``bench serve`` (or ``simulate --out``); ConfigError when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--compare-to: cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"--compare-to: {path} is not JSON: {e}") from None
    if not isinstance(data, dict) or "request_throughput" not in data:
        raise ConfigError(f"--compare-to: {path} is not a bench result (no request_throughput)")
    return data


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _order(key: str) -> tuple:
    if key in SCALARS:
        return (0, SCALARS.index(key), "")
    stat, name = LATENCY_KEY.match(key).groups()  # type: ignore[union-attr]
    rank = {"mean": -2.0, "median": -1.0}.get(stat)
    return (1 + _LATENCY_ORDER.index(name), rank if rank is not None else float(stat[1:]), stat)


def compare_results(simulated: dict[str, Any], real: dict[str, Any]) -> list[dict[str, Any]]:
    """Per metric both results carry: real, simulated and the relative error (None where the
    real value is 0). Goodput is left out unless both runs scored the same SLOs."""
    keys = [k for k in real if k in SCALARS or LATENCY_KEY.match(k)]
    same_slos = simulated.get("goodput_slos_ms") == real.get("goodput_slos_ms")
    rows = []
    for key in sorted((k for k in keys if k in simulated), key=_order):
        if key == "request_goodput" and not same_slos:
            continue
        r, s = _number(real[key]), _number(simulated[key])
        if r is None or s is None:
            continue
        rows.append({"metric": key, "real": r, "simulated": s, "error": (s - r) / r if r else None})
    return rows


def compare_ttft_parts(simulated: dict[str, Any], real: dict[str, Any]) -> list[dict[str, Any]]:
    """Per TTFT part both results' ``ttft_breakdown_ms`` carry: the real and simulated mean
    (ms) and their difference in ms (a part may be 0 on one side: no relative error)."""
    sim_parts, real_parts = simulated.get("ttft_breakdown_ms"), real.get("ttft_breakdown_ms")
    if not isinstance(sim_parts, dict) or not isinstance(real_parts, dict):  # absent or not bench's shape
        return []
    rows = []
    for part, values in real_parts.items():
        r = _number(values.get("mean")) if isinstance(values, dict) else None
        other = sim_parts.get(part)
        s = _number(other.get("mean")) if isinstance(other, dict) else None
        if r is not None and s is not None:
            rows.append({"part": part, "real": r, "simulated": s, "difference_ms": s - r})
    return rows


def mean_abs_error(rows: list[dict[str, Any]]) -> float | None:
    errors = [abs(row["error"]) for row in rows if row["error"] is not None]
    return sum(errors) / len(errors) if errors else None


def format_comparison(rows: list[dict[str, Any]], real_path: str, parts: list[dict[str, Any]] = ()) -> str:
    lines = [f"{' against ' + real_path + ' ':=^66}", f"{'metric':<28}{'real':>12}{'simulated':>12}{'error':>12}"]
    for row in rows:
        error = "-" if row["error"] is None else f"{100 * row['error']:+.1f} %"
        lines.append(f"{row['metric']:<28}{row['real']:>12.2f}{row['simulated']:>12.2f}{error:>12}")
    mae = mean_abs_error(rows)
    if mae is not None:
        lines.append(f"{'mean absolute error':<52}{100 * mae:>11.1f} %")
    if parts:
        lines.append(f"{'TTFT part, mean ms':<28}{'real':>12}{'simulated':>12}{'difference':>12}")
        for row in parts:
            lines.append(f"{row['part']:<28}{row['real']:>12.2f}{row['simulated']:>12.2f}"
                         f"{row['difference_ms']:>+12.2f}")
    lines.append("=" * 66)
    return "\n".join(lines)
