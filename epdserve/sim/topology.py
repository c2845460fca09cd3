"""Cluster topology: how many instances of each role, parsed from ``colocated=4`` or
``encode=1,prefill=2,decode=6``."""

from __future__ import annotations

from dataclasses import dataclass

from epdserve.errors import ConfigError
from epdserve.roles import Role, parse_role_counts

ROLES = (Role.ENCODE, Role.PREFILL, Role.DECODE, Role.COLOCATED)


@dataclass(frozen=True)
class Topology:
    num_encode: int = 0
    num_prefill: int = 0
    num_decode: int = 0
    num_colocated: int = 0

    def __post_init__(self) -> None:
        for role in ROLES:
            n = self.count(role)
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ConfigError(f"topology: {role} count must be a non-negative integer, got {n!r}")
        if self.num_instances == 0:
            raise ConfigError("topology is empty: give at least one of colocated=N or prefill=N,decode=N")
        if self.num_colocated and (self.num_prefill or self.num_decode):
            raise ConfigError("topology mixes colocated with prefill/decode; use one or the other")
        if self.num_decode and not self.num_prefill:
            raise ConfigError("topology has decode without prefill")
        if self.num_prefill and not self.num_decode:
            raise ConfigError("topology has prefill without decode")
        if self.num_encode and not (self.num_prefill or self.num_colocated):
            raise ConfigError("topology has encode without a consumer (prefill or colocated)")

    def count(self, role: str) -> int:
        return getattr(self, f"num_{role}")

    @property
    def num_instances(self) -> int:
        return self.num_encode + self.num_prefill + self.num_decode + self.num_colocated

    @property
    def is_split(self) -> bool:
        """Prefill and decode run on separate instances (P/D or E/P/D)."""
        return self.num_prefill > 0

    @property
    def roles(self) -> tuple[str, ...]:
        """Roles present, in pipeline order."""
        return tuple(r for r in ROLES if self.count(r))

    @property
    def spec(self) -> str:
        return ",".join(f"{r}={self.count(r)}" for r in self.roles)

    def __str__(self) -> str:
        return self.spec


def parse_topology(spec: str) -> Topology:
    """``role=N`` pairs separated by commas; roles: encode, prefill, decode, colocated."""
    counts = parse_role_counts(spec)
    return Topology(**{f"num_{role}": n for role, n in counts.items()})
