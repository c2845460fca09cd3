"""Service-level objectives: ``ttft_p99:2000,tpot_p99:100[,itl_p99:MS,e2el_p99:MS]``, and how
a set of simulated requests meets them.

A TTFT or TPOT threshold may be ``auto``: sized to the host from its profile (``ttft_slo_ms``,
``tpot_slo_ms``). A fixed SLO set on one host means something else on another: a CPU without a
fast bf16 matmul prefills about five times slower, and a TTFT bound that leaves room for
queueing on one host is missed there by the prompts' own prefill at any load.

A request attains the SLO when its TTFT, TPOT and E2E latency are each within their
thresholds (a failed request never does). A run meets the SLO when every named percentile
is within its threshold (nearest rank, failed requests counted as infinitely slow) and the
fraction of requests attaining it reaches the target (DistServe uses 90 %).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from epdserve.engine.step_shape import StepShape
from epdserve.errors import ConfigError
from epdserve.sim.cost_model import StepCost

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
REQUIRED_METRICS = ("ttft", "tpot")
AUTO = "auto"
AUTO_METRICS = ("ttft", "tpot")
TTFT_PREFILLS = 4.0  # an auto TTFT: this many times the prompt's prefill alone
TPOT_STEPS = 5.0  # an auto TPOT: this many times a decode step of one sequence alone


@dataclass(frozen=True)
class SLOTarget:
    metric: str
    percentile: float  # 0 < p <= 100
    threshold_ms: float

    @property
    def key(self) -> str:
        p = int(self.percentile) if self.percentile == int(self.percentile) else self.percentile
        return f"{self.metric}_p{p}"


@dataclass(frozen=True)
class SLO:
    targets: tuple[SLOTarget, ...]

    def __post_init__(self) -> None:
        names = [t.metric for t in self.targets]
        for metric in REQUIRED_METRICS:
            if metric not in names:
                raise ConfigError(f"SLO needs a {metric} target, e.g. {metric}_p99:MS")
        if len(set(names)) != len(names):
            raise ConfigError("SLO names a metric twice")

    def target(self, metric: str) -> SLOTarget | None:
        for t in self.targets:
            if t.metric == metric:
                return t
        return None

    def threshold_s(self, metric: str) -> float:
        t = self.target(metric)
        return math.inf if t is None else t.threshold_ms / 1000.0

    @property
    def spec(self) -> str:
        return ",".join(f"{t.key}:{t.threshold_ms:g}" for t in self.targets)


def parse_slo(text: str, auto: Callable[[str, float], float] | None = None) -> SLO:
    """``metric_pP:MS`` pairs separated by commas; metrics ttft, tpot, itl, e2el. A ttft or tpot
    threshold ``auto`` is ``auto(metric, percentile)`` ms (``None``: not accepted here)."""
    if not text or not text.strip():
        raise ConfigError("SLO is empty: give e.g. ttft_p99:2000,tpot_p99:100")
    targets = []
    for part in text.split(","):
        key, sep, value = part.strip().partition(":")
        metric, _, pct = key.strip().partition("_p")
        if not sep or not pct:
            raise ConfigError(f"SLO entry {part.strip()!r} is not metric_pP:MS (e.g. ttft_p99:2000)")
        if metric not in SLO_METRICS:
            raise ConfigError(f"SLO metric must be one of {', '.join(SLO_METRICS)}, got {metric!r}")
        try:
            percentile = float(pct)
        except ValueError:
            raise ConfigError(f"SLO entry {part.strip()!r}: percentile and milliseconds must be numbers") from None
        if not 0 < percentile <= 100:
            raise ConfigError(f"SLO percentile must be in (0, 100], got {pct!r}")
        if value.strip() == AUTO:
            if auto is None or metric not in AUTO_METRICS:
                where = "here" if auto is None else f"for {metric} (only {' and '.join(AUTO_METRICS)})"
                raise ConfigError(f"SLO entry {part.strip()!r}: 'auto' is not accepted {where}")
            threshold = auto(metric, percentile)
        else:
            try:
                threshold = float(value)
            except ValueError:
                raise ConfigError(f"SLO entry {part.strip()!r}: percentile and milliseconds must be numbers") from None
        if not math.isfinite(threshold) or threshold <= 0:
            raise ConfigError(f"SLO threshold must be a positive number of ms, got {value!r}")
        targets.append(SLOTarget(metric, percentile, threshold))
    return SLO(tuple(targets))


def _ms(seconds: float) -> float:
    """Milliseconds rounded to 10 ms (at least 10)."""
    return max(10.0, round(seconds * 100) * 10.0)


def ttft_slo_ms(step: StepCost, prompt_tokens: int, extra_s: float = 0.0) -> float:
    """An SLO sized to the host: ``TTFT_PREFILLS`` times one prompt of ``prompt_tokens``
    prefilled alone in one step on ``step`` (no cached prefix, nothing batched with it), plus
    ``extra_s`` per request before its prefill (its images' encode), in ms rounded to 10 ms."""
    n = prompt_tokens
    return _ms(TTFT_PREFILLS * (step.time_s(StepShape(n, n * (n + 1) // 2, 0, 0)) + extra_s))


def tpot_slo_ms(step: StepCost, context_tokens: int) -> float:
    """An SLO sized to the host: ``TPOT_STEPS`` times a decode step of one sequence of
    ``context_tokens`` on ``step``, in ms rounded to 10 ms."""
    return _ms(TPOT_STEPS * step.time_s(StepShape(0, 0, 1, context_tokens)))


@dataclass(frozen=True)
class SLOReport:
    attainment: float  # fraction of requests meeting every per-request threshold
    percentiles_ms: dict[str, float]  # target key -> observed value (inf: failures reach it)
    is_within_percentiles: bool

    def is_met(self, attainment_target: float) -> bool:
        return self.is_within_percentiles and self.attainment >= attainment_target


def nearest_rank(values: np.ndarray, percentile: float) -> float:
    if len(values) == 0:
        return math.inf
    k = max(1, math.ceil(percentile / 100.0 * len(values)))
    return float(np.partition(values, k - 1)[k - 1])


def evaluate(slo: SLO, is_ok: np.ndarray, ttft_s: np.ndarray, latency_s: np.ndarray, output_lens: np.ndarray,
             itl_s: np.ndarray | None = None) -> SLOReport:
    """Per-request arrays (failed requests have ``is_ok`` False); ``itl_s``: pooled gaps."""
    inf = np.inf
    ttft = np.where(is_ok, ttft_s, inf)
    steps = np.maximum(output_lens - 1, 1)
    tpot = np.where(is_ok, np.where(output_lens > 1, (latency_s - ttft_s) / steps, 0.0), inf)
    e2el = np.where(is_ok, latency_s, inf)
    per_request = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    good = np.ones(len(ttft), dtype=bool)
    for metric, values in per_request.items():
        good &= values <= slo.threshold_s(metric)
    observed = {}
    within = True
    for t in slo.targets:
        values = per_request.get(t.metric) if t.metric != "itl" else (itl_s if itl_s is not None else np.zeros(0))
        value_ms = nearest_rank(values, t.percentile) * 1000.0
        observed[t.key] = value_ms
        within &= value_ms <= t.threshold_ms
    attainment = float(good.mean()) if len(good) else 0.0
    return SLOReport(attainment, observed, bool(within))
