"""Deterministic fault injection for tests: a worker's engine misbehaves for chosen requests.

    --debug-fault KIND:SEED[:OPTION ...]      (repeatable; hidden flag of ``worker`` and ``serve``)

A fault applies to every sequence whose ``SamplingParams.seed`` is SEED (a test picks its
victim by the request's ``seed`` field; sequence i of a request with ``n > 1`` has seed
SEED + i). It fires at the first step in which the sequence already has at least AFTER output
tokens (default 0: at its first token). Kinds:

    sample-error   the Sampler raises a RuntimeError for that sequence
    detok-error    the detokenizer raises for that sequence's next token
    fatal          the step raises an error that ends the process (out of memory)
    hang-step      the step sleeps SECONDS (default 30) before running the model, once per sequence

Options: ``after=N``, ``seconds=S``, or a bare number (SECONDS for hang-step, AFTER for the
other kinds). On a prefill/decode pair the prefill worker samples the first token (the
sequence has 0 output tokens there) and the decode worker every later one, so AFTER >= 1 makes
a fault fire on the decode worker and AFTER = 0 on the prefill worker.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from epdserve.errors import ConfigError


class FaultKind(enum.Enum):
    SAMPLE_ERROR = "sample-error"
    DETOK_ERROR = "detok-error"
    FATAL = "fatal"
    HANG_STEP = "hang-step"


@dataclass(frozen=True)
class FaultSpec:
    kind: FaultKind
    seed: int
    after: int = 0  # output tokens the sequence already has when the fault fires
    seconds: float = 30.0  # hang-step: how long the step sleeps (s)

    def __post_init__(self) -> None:
        if self.after < 0:
            raise ConfigError(f"fault option after must not be negative, got {self.after}")
        if self.seconds < 0:
            raise ConfigError(f"fault option seconds must not be negative, got {self.seconds:g}")

    def matches(self, seed: int | None, num_output_tokens: int) -> bool:
        return seed == self.seed and num_output_tokens >= self.after


def parse_fault(text: str) -> FaultSpec:
    """``KIND:SEED[:OPTION ...]`` (see the module docstring) -> FaultSpec; ConfigError if bad."""
    fields = text.split(":")
    kinds = ", ".join(k.value for k in FaultKind)
    if len(fields) < 2:
        raise ConfigError(f"--debug-fault must be KIND:SEED[:OPTION ...] (KIND: {kinds}), got {text!r}")
    try:
        kind = FaultKind(fields[0])
    except ValueError:
        raise ConfigError(f"--debug-fault kind must be one of {kinds}, got {fields[0]!r}") from None
    seed = _number(fields[1], int, "seed", text)
    options: dict[str, float] = {}
    for option in fields[2:]:
        name, sep, value = option.partition("=")
        if not sep:
            name, value = ("seconds" if kind is FaultKind.HANG_STEP else "after"), option
        if name == "after":
            options["after"] = _number(value, int, name, text)
        elif name == "seconds":
            options["seconds"] = _number(value, float, name, text)
        else:
            raise ConfigError(f"--debug-fault options are after=N and seconds=S, got {option!r} in {text!r}")
    return FaultSpec(kind, seed, **options)


def _number(value: str, kind: type, name: str, text: str) -> int | float:
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"--debug-fault {name} must be a number, got {value!r} in {text!r}") from None


@dataclass(frozen=True)
class FaultPlan:
    """The faults one engine injects (at most one per kind and seed is looked up)."""

    faults: tuple[FaultSpec, ...]

    @classmethod
    def from_specs(cls, specs: Iterable[FaultSpec]) -> FaultPlan | None:
        """None without faults: the engine's hot path then checks one ``is None`` per step."""
        faults = tuple(specs)
        return cls(faults) if faults else None

    def find(self, kind: FaultKind, seed: int | None, num_output_tokens: int) -> FaultSpec | None:
        if seed is None:
            return None
        for fault in self.faults:
            if fault.kind is kind and fault.matches(seed, num_output_tokens):
                return fault
        return None

    def has(self, kind: FaultKind, seed: int | None) -> bool:
        """Whether some fault of ``kind`` can fire for a sequence with this seed."""
        return seed is not None and any(f.kind is kind and f.seed == seed for f in self.faults)
