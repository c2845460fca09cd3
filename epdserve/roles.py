"""What a worker process does; the one list of roles every floor (router, workers, planner,
simulator) uses. A ``StrEnum``: a role is its own name in messages, metrics and logs."""

from __future__ import annotations

from enum import StrEnum

from epdserve.errors import ConfigError


class Role(StrEnum):
    COLOCATED = "colocated"  # prefill and decode of a request in one engine
    PREFILL = "prefill"  # prompt only; the KV goes to a decode worker
    DECODE = "decode"  # reserves pages, receives KV, generates
    ENCODE = "encode"  # vision encoder only; embeddings go to a consumer's slab


# Roles that run the language model (an engine with a KV cache and a step loop).
LLM_ROLES = (Role.COLOCATED, Role.PREFILL, Role.DECODE)


def parse_role_counts(spec: str) -> dict[str, int]:
    """A topology's ``role=N`` pairs separated by commas (``colocated=4``,
    ``encode=1,prefill=2,decode=6``): role -> positive count, in the order given. Which mixes
    of roles make a topology is the caller's rule (``sim/topology.py``)."""
    text = (spec or "").strip()
    if not text:
        raise ConfigError("topology is empty: give e.g. colocated=4 or prefill=2,decode=6")
    counts: dict[str, int] = {}
    for part in text.split(","):
        role, sep, value = part.strip().partition("=")
        role = role.strip()
        if not sep:
            raise ConfigError(f"topology entry {part.strip()!r} is not role=N")
        if role not in tuple(Role):
            raise ConfigError(f"topology: unknown role {role!r} (roles: {', '.join(Role)})")
        if role in counts:
            raise ConfigError(f"topology: role {role!r} given twice")
        try:
            n = int(value.strip())
        except ValueError:
            raise ConfigError(f"topology: {role} count {value.strip()!r} is not an integer") from None
        if n <= 0:
            raise ConfigError(f"topology: {role} count must be positive, got {n}")
        counts[role] = n
    return counts
