"""Service classes: which urgency a request names, the order workers take it in, and its SLO.

A request names its class with OpenAI's ``service_tier`` or vLLM's ``priority`` (an integer,
lower first); the mapping, checked once at the edge (``resolve``)::

    service_tier      priority      class         scheduled
    "priority"        any           realtime      first
    "default"/"auto"  any           interactive   (the default)
    "flex"            any           batch         last
    (not given)       < 0           realtime
    (not given)       0 / not given interactive
    (not given)       > 0           batch

Within a class, ``priority`` orders as vLLM's does (lower first), then arrival. Workers see one
integer (``SamplingParams.priority``, ``schedule_key``): the class's rank dominates it.
Each class may have its own TTFT and TPOT SLO (``parse_class_slos``, ``epdserve serve
--service-class-slo``); the router counts attainment per class.

Plain Python: the router, the workers' scheduler and the simulator read it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from epdserve.errors import ConfigError

SERVICE_CLASSES = ("realtime", "interactive", "batch")  # scheduled in this order
DEFAULT_CLASS = "interactive"
SERVICE_TIERS = {"priority": "realtime", "default": "interactive", "auto": "interactive", "flex": "batch"}
TIER_OF_CLASS = {"realtime": "priority", "interactive": "default", "batch": "flex"}  # what a client sends
# ``priority`` in [-MAX_PRIORITY, MAX_PRIORITY]; a class's rank is worth more than any of it.
MAX_PRIORITY = 1_000_000
_RANK_SPAN = 2 * MAX_PRIORITY + 1
_DEFAULT_RANK = SERVICE_CLASSES.index(DEFAULT_CLASS)  # its key 0 is an interactive request of priority 0


def resolve(service_tier: str | None, priority: int | None) -> tuple[str, int]:
    """(class, scheduling key) of a request's ``service_tier`` and ``priority`` (None: not
    given), already checked (``validate.check_service``)."""
    if service_tier is not None:
        name = SERVICE_TIERS[service_tier]
    elif priority is None or priority == 0:
        name = DEFAULT_CLASS
    else:
        name = "realtime" if priority < 0 else "batch"
    return name, schedule_key(name, priority or 0)


def schedule_key(service_class: str, priority: int = 0) -> int:
    """The one integer a worker orders its queue by (lower first)."""
    return (SERVICE_CLASSES.index(service_class) - _DEFAULT_RANK) * _RANK_SPAN + priority


# The range of scheduling keys: the first class at the lowest priority to the last at the highest.
MIN_SCHEDULE_KEY = schedule_key(SERVICE_CLASSES[0], -MAX_PRIORITY)
MAX_SCHEDULE_KEY = schedule_key(SERVICE_CLASSES[-1], MAX_PRIORITY)


def class_of_key(key: int) -> str:
    """The class a scheduling key belongs to (the inverse of ``schedule_key``'s rank)."""
    rank = min(max((key + MAX_PRIORITY) // _RANK_SPAN + _DEFAULT_RANK, 0), len(SERVICE_CLASSES) - 1)
    return SERVICE_CLASSES[rank]


DEFAULT_KEY = schedule_key(DEFAULT_CLASS)


@dataclass(frozen=True)
class ClassSLO:
    """A class's targets in seconds (None: none)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def is_met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s


def parse_class_slos(specs: list[str] | None) -> dict[str, ClassSLO]:
    """``CLASS=ttft:MS[,tpot:MS]`` entries (``--service-class-slo``) -> SLO per class."""
    slos: dict[str, ClassSLO] = {}
    for spec in specs or []:
        name, sep, rest = spec.partition("=")
        if not sep or name not in SERVICE_CLASSES:
            raise ConfigError(f"--service-class-slo takes CLASS=ttft:MS[,tpot:MS] with CLASS one of "
                              f"{', '.join(SERVICE_CLASSES)}, got {spec!r}")
        if name in slos:
            raise ConfigError(f"--service-class-slo names {name} twice")
        slos[name] = parse_slo(rest, f"--service-class-slo {spec!r}")
    return slos


def parse_slo(spec: str, flag: str = "an SLO") -> ClassSLO:
    """``ttft:MS[,tpot:MS]`` (either or both, milliseconds) -> targets in seconds."""
    values: dict[str, float] = {}
    for part in spec.split(","):
        key, sep, ms = part.partition(":")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if not sep or key not in ("ttft", "tpot") or key in values or not 0 < value < float("inf"):
            raise ConfigError(f"{flag}: each target is ttft:MS or tpot:MS, MS > 0")
        values[key] = value / 1e3
    return ClassSLO(values.get("ttft"), values.get("tpot"))


def parse_class_mix(spec: str | None) -> dict[str, float]:
    """``CLASS=SHARE,...`` (``--class-mix``, ``--service-class-mix``) -> share per class."""
    mix: dict[str, float] = {}
    for part in (spec or "").split(","):
        if not part:
            continue
        name, sep, share = part.partition("=")
        try:
            value = float(share)
        except ValueError:
            value = -1.0
        if not sep or name not in SERVICE_CLASSES or name in mix or not 0 <= value < math.inf:
            raise ConfigError(f"a class mix is CLASS=SHARE,... with CLASS one of {', '.join(SERVICE_CLASSES)} "
                              f"and shares >= 0, got {spec!r}")
        mix[name] = value
    if mix and not sum(mix.values()) > 0:
        raise ConfigError(f"a class mix needs a share > 0, got {spec!r}")
    return mix


def draw_classes(mix: dict[str, float], n: int, seed: int) -> list[str]:
    """Each of ``n`` requests' class, drawn with the shares of ``mix`` (empty: all the default)."""
    if not mix:
        return [DEFAULT_CLASS] * n
    names = [c for c in SERVICE_CLASSES if mix.get(c, 0.0) > 0]
    return random.Random(seed).choices(names, weights=[mix[c] for c in names], k=n)
