"""When a worker should change role: the controller behind ``--role-switching auto``.

Every ``interval_s`` the controller reads how close each side of a P/D cluster is to its SLO,
as a pressure (1.0: at the SLO), from the latencies of the last ``window_s`` and the queues::

    prefill pressure = max(TTFT P90 / TTFT SLO, prompt work queued per prefill worker / TTFT SLO)
    decode pressure  = max(ITL P90 / TPOT SLO, share of the decode workers' KV blocks in use / KV_FULL)

It moves workers from the side with slack to the side under pressure when

    the needy side's pressure > high                         (it is about to miss its SLO)
    and the donor side's pressure with n - 1 workers < low   (it keeps its slack; low < high)
        or the needy side's is priority_ratio times the donor's with n - 1 (both past their SLOs:
                                                              the one further past gets it; not to
                                                              undo the last round within
                                                              priority_hold_s)

has held for ``num_confirm`` decisions in a row: as many as bring the needy side's projected
pressure down to ``high``, no more than keep the donor's under ``low`` (one on a small
cluster; several at once on a large one, where one at a time would take too long). The pressure a side would have with one worker
fewer is projected from what it has now: the load-driven part of each latency grows by
n / (n - 1) (the same work on fewer workers), its fixed part does not::

    latency with n - 1 workers = base + (P90 - base) x n / (n - 1)

where ``base`` is the lowest 10th percentile any window has shown (a step's cost with little
load: a CPU decode step costs 70 ms idle, and scaling that too would keep a decode worker from
ever moving); queued work and KV in use scale whole. Hysteresis keeps it from flapping: the band between
``low`` and ``high`` (the switch cannot make the donor side need the worker back), a minimum
time in a role per worker (``min_dwell_s``), one round of switches at a time and a
``cooldown_s`` after each. The donors are their side's ready workers with the fewest requests in
hand (the quickest to drain) among those past their dwell.

Plain Python over ``WorkerInfo``: the router (core.py) and the simulator (sim/roles.py) run
this same controller, the router on measured latencies, the simulator on simulated ones.
"""

from __future__ import annotations

import argparse
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from epdserve.errors import ConfigError
from epdserve.roles import Role
from epdserve.router.workers import WorkerInfo, WorkerState
from epdserve.service import DEFAULT_CLASS, ClassSLO, parse_slo

KV_FULL = 0.9  # share of a decode worker's KV blocks in use at which decode pressure is 1.0
MAX_SAMPLES = 4096  # latencies kept per window (the newest)


@dataclass(frozen=True)
class RoleControlConfig:
    ttft_slo_s: float
    tpot_slo_s: float
    interval_s: float = 1.0  # seconds between decisions
    window_s: float = 10.0  # latencies older than this are forgotten (seconds)
    high: float = 0.9  # a side above this pressure wants a worker
    low: float = 0.7  # the donor side's pressure after the switch stays below this
    min_dwell_s: float = 30.0  # a worker keeps a role at least this long (seconds)
    cooldown_s: float = 10.0  # after a switch ends, before the next may begin (seconds)
    num_confirm: int = 3  # consecutive decisions that agree before a switch begins
    # A side this many times further past its SLO than the donor would be gets a worker even when
    # the donor has no slack left (both past their SLOs: the worse one first).
    priority_ratio: float = 3.0
    # ... but not to undo the last round within this many seconds (a transient on the side that
    # just gave workers away, such as the answers they handed over, would swing them back)
    priority_hold_s: float = 60.0
    min_samples: int = 8  # latencies a window needs before its percentile counts

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tpot_slo_s", "interval_s", "window_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ConfigError(f"role control: {name} must be a finite number > 0, got {value!r}")
        if not self.priority_ratio > 1:
            raise ConfigError(f"role control: priority_ratio must be > 1, got {self.priority_ratio}")
        if not 0 < self.low < self.high:
            raise ConfigError(f"role control: need 0 < low < high, got low={self.low}, high={self.high}")
        if self.min_dwell_s < 0 or self.cooldown_s < 0 or self.priority_hold_s < 0 or self.num_confirm < 1 or self.min_samples < 1:
            raise ConfigError("role control: dwell and cooldown must be >= 0, num_confirm and min_samples >= 1")


class LatencyWindow:
    """Latencies of the last ``window_s`` seconds (at most ``MAX_SAMPLES``), with weights."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=MAX_SAMPLES)  # (time, seconds, weight)

    def add(self, now: float, seconds: float, weight: float = 1.0) -> None:
        self.samples.append((now, seconds, weight))

    def percentile(self, now: float, q: float, min_samples: int) -> float | None:
        """The weighted ``q``-quantile (0..1) of the window; None with fewer than ``min_samples``."""
        samples = self.samples
        start = now - self.window_s
        while samples and samples[0][0] < start:
            samples.popleft()
        # (Samples may come a little out of time order: the simulator reports a fast-forwarded
        # stretch of decode steps when it ends.)
        ordered = sorted((s, w) for t, s, w in samples if t >= start)
        if len(ordered) < min_samples:
            return None
        total = sum(w for _, w in ordered)
        target, acc = q * total, 0.0
        for seconds, weight in ordered:
            acc += weight
            if acc >= target:
                return seconds
        return ordered[-1][0]


@dataclass(frozen=True)
class Pressure:
    """How close each side is to its SLO (1.0: at it), and what that came from."""

    prefill: float
    decode: float
    ttft_p90_s: float | None
    itl_p90_s: float | None
    queued_prefill_s: float  # prompt work queued per ready prefill worker
    kv_usage: float  # share of the decode workers' KV blocks in use
    ttft_base_s: float | None = None  # the lowest 10th percentiles seen: the latencies' fixed part
    itl_base_s: float | None = None
    num_prefill: int = 0  # ready workers per side
    num_decode: int = 0

    def as_json(self) -> dict:
        return {"prefill": round(self.prefill, 3), "decode": round(self.decode, 3), "ttft_p90_s": self.ttft_p90_s,
                "itl_p90_s": self.itl_p90_s, "queued_prefill_s": round(self.queued_prefill_s, 4),
                "kv_usage": round(self.kv_usage, 3)}


def _lowest(floor: float | None, value: float | None) -> float | None:
    if value is None:
        return floor
    return value if floor is None else min(floor, value)


def _grown(p90: float | None, base: float | None, factor: float) -> float:
    """A latency's P90 with its load-driven part (above ``base``) grown by ``factor``."""
    if p90 is None:
        return 0.0
    base = min(base if base is not None else 0.0, p90)
    return base + (p90 - base) * factor


def _num_to_move(num_needy: int, num_donor: int, needy_with, donor_with, config: RoleControlConfig,  # noqa: ANN001
                 may_take_priority: bool = True) -> int:
    """Workers to move from the donor side to the needy one: the fewest that bring the needy
    side's projected pressure to ``high`` (one when the projection sees no gain from more).
    The k-th may go while the donor side with k fewer stays under ``low``, or while the needy
    side (with k - 1 more) is still ``priority_ratio`` times further past its SLO than the donor
    side would be (the side furthest past its SLO gets the worker); 0: none may go."""
    num = 0
    while num + 1 < num_donor:
        donor_after = donor_with(num_donor - num - 1)
        needy_now = needy_with(num_needy + num)
        if not (donor_after < config.low
                or (may_take_priority and needy_now > config.priority_ratio * donor_after)):
            break
        num += 1
        after = needy_with(num_needy + num)
        if after <= config.high or after >= needy_now:
            break
    return num


def prefill_pressure_with(p: Pressure, config: RoleControlConfig, num_workers: int) -> float:
    """The prefill pressure with ``num_workers`` ready prefill workers instead of ``p.num_prefill``."""
    factor = p.num_prefill / num_workers if num_workers > 0 else math.inf
    return max(_grown(p.ttft_p90_s, p.ttft_base_s, factor), p.queued_prefill_s * factor) / config.ttft_slo_s


def decode_pressure_with(p: Pressure, config: RoleControlConfig, num_workers: int) -> float:
    """The decode pressure with ``num_workers`` ready decode workers instead of ``p.num_decode``."""
    factor = p.num_decode / num_workers if num_workers > 0 else math.inf
    return max(_grown(p.itl_p90_s, p.itl_base_s, factor) / config.tpot_slo_s, p.kv_usage * factor / KV_FULL)


@dataclass(frozen=True)
class Switch:
    """One worker of a decision: move ``worker_id`` to ``to_role``."""

    worker_id: str
    from_role: str
    to_role: str
    pressure: Pressure


class RoleController:
    def __init__(self, config: RoleControlConfig) -> None:
        self.config = config
        self.ttft = LatencyWindow(config.window_s)
        self.itl = LatencyWindow(config.window_s)
        self.last_switch_end = -math.inf  # when the last switch's worker took its new role
        self.last_pressure: Pressure | None = None
        # The lowest 10th percentile each window has shown: a latency's fixed part (a step's
        # cost with little load), which the projection does not scale.
        self.ttft_floor_s: float | None = None
        self.itl_floor_s: float | None = None
        self._want: tuple[str, str] | None = None  # (from role, to role) the last decisions agreed on
        self._last_round: tuple[str, str] | None = None  # (from role, to role) of the last switches begun
        self._last_round_at = -math.inf
        self._num_agreeing = 0

    # -- what it is told -----------------------------------------------------------------
    def observe_ttft(self, now: float, seconds: float) -> None:
        self.ttft.add(now, seconds)

    def observe_itl(self, now: float, seconds: float, weight: float = 1.0) -> None:
        """A gap between two tokens of a decoding request (``weight`` requests' gaps at once)."""
        self.itl.add(now, seconds, weight)

    def on_switched(self, now: float) -> None:
        """A switch ended (its worker registered in the new role): the cooldown starts."""
        self.last_switch_end = now

    # -- deciding ------------------------------------------------------------------------
    def pressure(self, now: float, workers: Iterable[WorkerInfo]) -> Pressure:
        cfg = self.config
        queued_s, num_prefill, num_decode, used, total = 0.0, 0, 0, 0, 0
        for w in workers:
            if w.state is not WorkerState.READY:
                continue
            if w.role == Role.PREFILL:
                queued_s += w.num_prefill_tokens * w.prefix_cost.per_prefill_token_s
                num_prefill += 1
            elif w.role == Role.DECODE:
                used += w.load.num_used_blocks
                total += w.load.num_used_blocks + w.load.num_free_blocks
                num_decode += 1
        queued_s /= max(num_prefill, 1)
        kv_usage = used / total if total else 0.0
        n = cfg.min_samples
        ttft, itl = self.ttft.percentile(now, 0.9, n), self.itl.percentile(now, 0.9, n)
        ttft_base = self.ttft_floor_s = _lowest(self.ttft_floor_s, self.ttft.percentile(now, 0.1, n))
        itl_base = self.itl_floor_s = _lowest(self.itl_floor_s, self.itl.percentile(now, 0.1, n))
        prefill = max(ttft if ttft is not None else 0.0, queued_s) / cfg.ttft_slo_s
        decode = max((itl if itl is not None else 0.0) / cfg.tpot_slo_s, kv_usage / KV_FULL)
        return Pressure(prefill, decode, ttft, itl, queued_s, kv_usage, ttft_base, itl_base, num_prefill, num_decode)

    def decide(self, now: float, workers: list[WorkerInfo]) -> list[Switch]:
        """The switches to begin now (none, or k workers of one side to the other; call every
        ``interval_s``): as many as bring the needy side's projected pressure to ``high``, at
        most as many as leave the donor side's under ``low``."""
        cfg = self.config
        p = self.last_pressure = self.pressure(now, workers)
        if any(w.state in (WorkerState.DRAINING, WorkerState.SWITCHING) for w in workers):
            self._agree(None)  # one round of switches at a time
            return []
        if now - self.last_switch_end < cfg.cooldown_s:
            self._agree(None)
            return []
        want, num = None, 0
        if p.prefill > cfg.high:
            num = _num_to_move(p.num_prefill, p.num_decode, lambda n: prefill_pressure_with(p, cfg, n),
                               lambda n: decode_pressure_with(p, cfg, n), cfg,
                               not self._undoes_last_round((Role.DECODE, Role.PREFILL), now))
            want = (Role.DECODE, Role.PREFILL) if num else None
        if want is None and p.decode > cfg.high:
            num = _num_to_move(p.num_decode, p.num_prefill, lambda n: decode_pressure_with(p, cfg, n),
                               lambda n: prefill_pressure_with(p, cfg, n), cfg,
                               not self._undoes_last_round((Role.PREFILL, Role.DECODE), now))
            want = (Role.PREFILL, Role.DECODE) if num else None
        if self._agree(want) is None or self._num_agreeing < cfg.num_confirm:
            return []
        donors = sorted((w for w in workers if w.state is WorkerState.READY and w.role == want[0]
                         and now - w.role_since >= cfg.min_dwell_s),
                        key=lambda w: (len(w.request_ids), w.num_prefill_tokens, w.worker_id))
        if not donors:
            return []
        self._want, self._num_agreeing = None, 0
        self._last_round, self._last_round_at = want, now
        return [Switch(w.worker_id, want[0], want[1], p) for w in donors[:num]]

    def _undoes_last_round(self, want: tuple[str, str], now: float) -> bool:
        last = self._last_round
        return (last is not None and want == (last[1], last[0])
                and now - self._last_round_at < self.config.priority_hold_s)

    def _agree(self, want: tuple[str, str] | None) -> tuple[str, str] | None:
        if want is None or want != self._want:
            self._num_agreeing = 0
        self._want = want
        if want is not None:
            self._num_agreeing += 1
        return want


# -- command line (epdserve serve, simulate, plan) ---------------------------------------------
def add_role_switching_args(group: argparse._ArgumentGroup, modes: tuple[str, ...]) -> None:
    """``--role-switching MODE`` and the controller's settings; ``modes``: what the command takes."""
    group.add_argument("--role-switching", choices=modes, default="off",
                       help="move prefill and decode workers between roles at run time, in their own processes"
                            + (": manual (POST /v1/workers/{id}/role), or auto (also " if "manual" in modes
                               else ": auto (") + "a controller that moves one worker at a time from the side with "
                                                  "slack to the side near its SLO)")
    group.add_argument("--role-switching-slo", default=None, metavar="ttft:MS,tpot:MS",
                       help="auto: the SLO the controller keeps (default: the interactive class's "
                            "--service-class-slo)")
    group.add_argument("--role-switching-dwell", type=float, default=30.0, metavar="SECONDS",
                       help="auto: a worker keeps a role at least this long")
    group.add_argument("--role-switching-cooldown", type=float, default=10.0, metavar="SECONDS",
                       help="auto: after a switch ends, before the next one may begin")
    group.add_argument("--role-switching-interval", type=float, default=1.0, metavar="SECONDS",
                       help="auto: seconds between the controller's decisions")
    group.add_argument("--role-switching-window", type=float, default=10.0, metavar="SECONDS",
                       help="auto: the latencies the controller reads are those of the last SECONDS")


def role_control_config(ns: argparse.Namespace, class_slos: dict[str, ClassSLO]) -> RoleControlConfig | None:
    """``--role-switching auto``'s controller settings (None for off and manual)."""
    if ns.role_switching != "auto":
        return None
    slo = (parse_slo(ns.role_switching_slo, "--role-switching-slo") if ns.role_switching_slo
           else class_slos.get(DEFAULT_CLASS))
    if slo is None or slo.ttft_s is None or slo.tpot_s is None:
        raise ConfigError("--role-switching auto needs a TTFT and a TPOT target: --role-switching-slo "
                          "ttft:MS,tpot:MS (or --service-class-slo interactive=ttft:MS,tpot:MS)")
    return RoleControlConfig(slo.ttft_s, slo.tpot_s, interval_s=ns.role_switching_interval,
                             window_s=ns.role_switching_window, min_dwell_s=ns.role_switching_dwell,
                             cooldown_s=ns.role_switching_cooldown)
