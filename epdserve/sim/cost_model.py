"""Step-time cost model: the profile file (``profile.json``) and the functions it feeds.

One engine step of a role takes (seconds)::

    t = base_s + per_prefill_token_s * P + per_prefill_attn_pair_s * A
               + per_decode_seq_s * D + per_decode_context_token_s * C

over the step's scheduled entries: an entry with more than one new token, or one still inside
its prompt, is prefill (P = its new tokens, A = query-key pairs of causal attention over them);
the others are decode (D = their count, C = their context length, start_pos + 1). A decode-only
step (P = 0) is then multiplied by ``decode_factors``, a factor per batch size D interpolated
linearly between knots (none in an offline profile; ``epdserve calibrate`` fits them from served
steps: a CPU's matmul kernels are not linear in their row count, e.g. 12 rows slower than 16).
An encoder batch of images takes ``base_s + per_tile_s * total_tiles``.

``epdserve profile`` writes the file; ``simulate`` and ``plan`` read it.
"""

from __future__ import annotations

import bisect
import copy
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from epdserve.engine.kv_cache import KVCacheGroupSpec
from epdserve.engine.step_shape import StepShape
from epdserve.errors import ConfigError
from epdserve.roles import LLM_ROLES
from epdserve.sim.nnls import nnls

PROFILE_VERSION = 1
STEP_ROLES = LLM_ROLES
ENCODE_ROLE = "encode"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_coefficient(name: str, value: Any) -> None:
    _require(_is_number(value), f"{name} must be a number, got {value!r}")
    _require(math.isfinite(value), f"{name} must be finite, got {value!r}")
    _require(value >= 0, f"{name} must be >= 0, got {value!r}")


def _check_count(name: str, value: Any, minimum: int) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{name} must be an integer >= {minimum}, got {value!r}",
    )


COEFFICIENTS = ("base_s", "per_prefill_token_s", "per_prefill_attn_pair_s", "per_decode_seq_s",
                "per_decode_context_token_s")


@dataclass(frozen=True)
class StepCost:
    """Seconds per step and per unit of each ``StepShape`` term; all >= 0."""

    base_s: float
    per_prefill_token_s: float
    per_prefill_attn_pair_s: float
    per_decode_seq_s: float
    per_decode_context_token_s: float
    # (batch size D, factor) knots, D increasing: a decode-only step of D sequences takes the
    # terms' time times the factor interpolated at D (the end knots' beyond them); () = 1.
    decode_factors: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            _check_coefficient(name, getattr(self, name))
        knots = self.decode_factors
        _require(isinstance(knots, tuple) and all(isinstance(k, tuple) and len(k) == 2 for k in knots),
                 f"decode_factors must be (batch size, factor) pairs, got {knots!r}")
        for d, f in knots:
            _check_count("decode_factors batch size", d, 1)
            _require(_is_number(f) and math.isfinite(f) and f > 0, f"a decode factor must be > 0, got {f!r}")
        _require(all(a[0] < b[0] for a, b in zip(knots, knots[1:])),
                 f"decode_factors' batch sizes must increase, got {[d for d, _ in knots]}")

    def time_s(self, shape: StepShape) -> float:
        # The prefill terms are written out rather than calling prefill_s: this runs for every
        # simulated step.
        t = (
            self.base_s
            + self.per_prefill_token_s * shape.num_prefill_tokens
            + self.per_prefill_attn_pair_s * shape.prefill_attn_pairs
            + self.per_decode_seq_s * shape.num_decode_seqs
            + self.per_decode_context_token_s * shape.decode_context_tokens
        )
        if self.decode_factors and not shape.num_prefill_tokens:
            t *= self.decode_factor(shape.num_decode_seqs)
        return t

    def decode_factor(self, num_seqs: int) -> float:
        """The factor of a decode-only step of ``num_seqs`` sequences (1 without knots)."""
        knots = self.decode_factors
        if not knots:
            return 1.0
        i = bisect.bisect_left(knots, (num_seqs, -math.inf))
        if i == 0:
            return knots[0][1]
        if i == len(knots):
            return knots[-1][1]
        (d0, f0), (d1, f1) = knots[i - 1], knots[i]
        return f0 + (f1 - f0) * (num_seqs - d0) / (d1 - d0)

    def decode_times_s(self, num_seqs: int, context: int, num_steps: int) -> list[float]:
        """``time_s`` of ``num_steps`` decode-only steps of ``num_seqs`` sequences whose context
        starts at ``context`` tokens and grows by ``num_seqs`` per step: the same floats (the
        prefill terms add 0.0 to the base, exactly), without a shape per step."""
        first = self.base_s + self.per_decode_seq_s * num_seqs
        per_context = self.per_decode_context_token_s
        if self.decode_factors:
            f = self.decode_factor(num_seqs)
            return [(first + per_context * (context + j * num_seqs)) * f for j in range(num_steps)]
        return [first + per_context * (context + j * num_seqs) for j in range(num_steps)]

    def prefill_s(self, shape: StepShape) -> float:
        """The prefill terms' part of ``time_s``."""
        return (self.per_prefill_token_s * shape.num_prefill_tokens
                + self.per_prefill_attn_pair_s * shape.prefill_attn_pairs)

    def scaled(self, factor: float, prefill_factor: float | None = None, decode_factor: float | None = None) -> StepCost:
        """Every coefficient times ``factor``; the prefill terms' times ``prefill_factor`` and the
        decode terms' times ``decode_factor`` where given."""
        prefill = factor if prefill_factor is None else prefill_factor
        decode = factor if decode_factor is None else decode_factor
        return StepCost(self.base_s * factor, self.per_prefill_token_s * prefill,
                        self.per_prefill_attn_pair_s * prefill, self.per_decode_seq_s * decode,
                        self.per_decode_context_token_s * decode, self.decode_factors)

    def with_decode_factors(self, knots: Sequence[tuple[int, float]]) -> StepCost:
        return replace(self, decode_factors=tuple((int(d), float(f)) for d, f in knots))

    def parts_s(self, shape: StepShape) -> tuple[float, float, float]:
        """``time_s`` as (base, prefill terms, decode terms), a decode-only step's times its factor."""
        prefill = self.prefill_s(shape)
        decode = self.per_decode_seq_s * shape.num_decode_seqs + self.per_decode_context_token_s * shape.decode_context_tokens
        if self.decode_factors and not shape.num_prefill_tokens:
            f = self.decode_factor(shape.num_decode_seqs)
            return self.base_s * f, prefill, decode * f
        return self.base_s, prefill, decode

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in COEFFICIENTS}
        if self.decode_factors:
            d["decode_factors"] = [list(k) for k in self.decode_factors]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> StepCost:
        _require(isinstance(d, dict), f"step must be an object, got {type(d).__name__}")
        for name in COEFFICIENTS:
            _require(name in d, f"step is missing {name!r}")
        knots = d.get("decode_factors") or []
        _require(isinstance(knots, list) and all(isinstance(k, list) and len(k) == 2 for k in knots),
                 f"step decode_factors must be a list of [batch size, factor] pairs, got {knots!r}")
        return cls(**{name: d[name] for name in COEFFICIENTS}, decode_factors=tuple(tuple(k) for k in knots))

    @staticmethod
    def fit(samples: Sequence[tuple[StepShape, float]]) -> tuple[StepCost, dict]:
        """Non-negative least squares of measured step times on the shape terms, in relative
        terms: each sample's residual is divided by its time, so a 15 ms decode step counts as
        much as a 3 s prefill (absolute residuals would fit the long steps only), and a sample
        slowed by other work on the machine weighs at most 1.

        Returns the coefficients and ``{"r2", "mean_abs_rel_error", "num_samples"}``.
        """
        _require(len(samples) >= 1, "cannot fit a step cost to zero samples")
        x = np.array([shape.features() for shape, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        weights = 1.0 / np.where(y > 0, y, 1.0)
        xw, yw = x * weights[:, None], y * weights
        # Columns span ~10 orders of magnitude (1 vs attention pairs): solve on unit columns.
        scale = np.linalg.norm(xw, axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(xw / scale, yw) / scale
        cost = StepCost(*(float(c) for c in coef))
        pred = x @ coef
        ss_res = float(np.sum((y - pred) ** 2))
        ss_tot = float(np.sum((y - y.mean()) ** 2))
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
        positive = y > 0
        rel = np.abs(pred[positive] - y[positive]) / y[positive]
        mean_rel = float(rel.mean()) if rel.size else 0.0
        return cost, {"r2": r2, "mean_abs_rel_error": mean_rel, "num_samples": len(samples)}


@dataclass(frozen=True)
class RoleProfile:
    """One step role (colocated, prefill or decode) as profiled on its cores."""

    name: str
    num_threads: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    step: StepCost
    fit: dict | None = field(default=None, compare=False)  # {"r2", "mean_abs_rel_error", "num_samples"}
    samples: tuple[dict, ...] = field(default=(), compare=False)  # StepShape fields + "time_s"
    # Extra seconds per unit of each term while every other instance on the host is mid-step: a
    # step takes ``step`` plus the share of its neighbours that are mid-step times this. Set by
    # ``epdserve calibrate``; None in an offline profile.
    neighbour_step: StepCost | None = None

    def __post_init__(self) -> None:
        _require(self.name in STEP_ROLES, f"unknown role {self.name!r} (roles: {', '.join(STEP_ROLES + (ENCODE_ROLE,))})")
        _check_count(f"{self.name}.num_threads", self.num_threads, 1)
        _check_count(f"{self.name}.num_kv_blocks", self.num_kv_blocks, 2)
        _check_count(f"{self.name}.max_num_seqs", self.max_num_seqs, 1)
        _check_count(f"{self.name}.max_num_batched_tokens", self.max_num_batched_tokens, 1)

    def step_samples(self) -> list[tuple[StepShape, float]]:
        return [(StepShape.from_dict(s), float(s["time_s"])) for s in self.samples]

    def to_dict(self) -> dict:
        d = {
            "num_threads": self.num_threads,
            "num_kv_blocks": self.num_kv_blocks,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "step": self.step.to_dict(),
        }
        if self.neighbour_step is not None:
            d["neighbour_step"] = self.neighbour_step.to_dict()
        if self.fit is not None:
            d["fit"] = dict(self.fit)
        if self.samples:
            d["samples"] = [dict(s) for s in self.samples]
        return d

    @classmethod
    def from_dict(cls, name: str, d: dict) -> RoleProfile:
        _require(isinstance(d, dict), f"role {name!r} must be an object")
        for key in ("num_threads", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "step"):
            _require(key in d, f"role {name!r} is missing {key!r}")
        try:
            step = StepCost.from_dict(d["step"])
            neighbour_step = StepCost.from_dict(d["neighbour_step"]) if d.get("neighbour_step") is not None else None
        except ConfigError as e:
            raise ConfigError(f"role {name!r}: {e}") from None
        slowdown = d.get("neighbour_slowdown")  # profiles calibrated before neighbour_step: one factor
        if slowdown is not None and neighbour_step is None:
            _check_coefficient(f"{name}.neighbour_slowdown", slowdown)
            neighbour_step = step.scaled(slowdown) if slowdown else None
        samples = d.get("samples") or []
        _require(isinstance(samples, list) and all(isinstance(s, dict) and "time_s" in s for s in samples),
                 f"role {name!r}: samples must be a list of objects with time_s")
        return cls(
            name=name,
            num_threads=d["num_threads"],
            num_kv_blocks=d["num_kv_blocks"],
            max_num_seqs=d["max_num_seqs"],
            max_num_batched_tokens=d["max_num_batched_tokens"],
            step=step,
            fit=d.get("fit"),
            samples=tuple(samples),
            neighbour_step=neighbour_step,
        )


@dataclass(frozen=True)
class EncodeCost:
    """Vision encoder: seconds for one batch of images, by total tiles."""

    num_threads: int
    tokens_per_tile: int  # embedding rows one tile produces
    base_s: float
    per_tile_s: float
    samples: tuple[dict, ...] = field(default=(), compare=False)  # {"num_tiles", "time_s"}

    def __post_init__(self) -> None:
        _check_count("encode.num_threads", self.num_threads, 1)
        _check_count("encode.tokens_per_tile", self.tokens_per_tile, 1)
        _check_coefficient("encode.image.base_s", self.base_s)
        _check_coefficient("encode.image.per_tile_s", self.per_tile_s)

    def time_s(self, num_tiles: int) -> float:
        return self.base_s + self.per_tile_s * num_tiles

    def to_dict(self) -> dict:
        d = {
            "num_threads": self.num_threads,
            "tokens_per_tile": self.tokens_per_tile,
            "image": {"base_s": self.base_s, "per_tile_s": self.per_tile_s},
        }
        if self.samples:
            d["samples"] = [dict(s) for s in self.samples]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> EncodeCost:
        _require(isinstance(d, dict), "role 'encode' must be an object")
        for key in ("num_threads", "tokens_per_tile", "image"):
            _require(key in d, f"role 'encode' is missing {key!r}")
        image = d["image"]
        _require(isinstance(image, dict), "encode.image must be an object")
        for key in ("base_s", "per_tile_s"):
            _require(key in image, f"encode.image is missing {key!r}")
        return cls(d["num_threads"], d["tokens_per_tile"], image["base_s"], image["per_tile_s"], tuple(d.get("samples") or ()))


def _parse_kv_tiers(d: Any) -> dict[str, tuple[float, float]]:
    """A profile's ``kv_tiers``: per tier ``{"bytes_per_s", "latency_s"}``; a tier the profile
    could not measure (``{"error": ...}``) is left out."""
    if d is None:
        return {}
    _require(isinstance(d, dict), "profile 'kv_tiers' must be an object")
    tiers = {}
    for tier, entry in d.items():
        _require(isinstance(entry, dict), f"kv_tiers.{tier} must be an object")
        if "error" in entry and "bytes_per_s" not in entry:
            continue
        for key in ("bytes_per_s", "latency_s"):
            _require(key in entry, f"kv_tiers.{tier} is missing {key!r}")
        tiers[tier] = (entry["bytes_per_s"], entry["latency_s"])
    return tiers


def _parse_kv_groups(d: object) -> tuple[tuple[int | None, int], ...]:
    if d is None:
        return ()
    _require(isinstance(d, list), "profile 'kv_groups' must be a list")
    groups = []
    for entry in d:
        _require(isinstance(entry, dict) and "bytes_per_token" in entry,
                 "kv_groups entries must be objects with 'window' and 'bytes_per_token'")
        groups.append((entry.get("window"), entry["bytes_per_token"]))
    return tuple(groups)


@dataclass(frozen=True)
class CostModel:
    model: str
    dtype: str
    block_size: int  # tokens per KV block
    kv_bytes_per_token: int  # K and V of every layer for one token
    embed_bytes_per_token: int | None  # one encoder output row; None without an encoder profile
    num_layers: int
    roles: dict[str, RoleProfile]
    encode: EncodeCost | None = None
    raw: dict = field(default_factory=dict, compare=False)  # the file as read (host, device, ...)
    # The KV tiers' media, measured: tier ("host", "disk") -> (read bytes per second, seconds
    # per load); the reload rule's load side (engine/reload_rule.py). Empty: not measured.
    kv_tiers: dict[str, tuple[float, float]] = field(default_factory=dict)
    # KV cache groups: (sliding window in tokens or None for full attention, K and V bytes of
    # one token over the group's layers). Empty: one full-attention group of kv_bytes_per_token.
    kv_groups: tuple[tuple[int | None, int], ...] = ()

    def __post_init__(self) -> None:
        _check_count("block_size", self.block_size, 1)
        for window, per_token in self.kv_groups:
            _require(window is None or (isinstance(window, int) and window > 0),
                     f"kv_groups: a window must be a positive integer or null, got {window!r}")
            _check_count("kv_groups bytes_per_token", per_token, 1)
        _check_count("kv_bytes_per_token", self.kv_bytes_per_token, 1)
        _check_count("num_layers", self.num_layers, 1)
        if self.embed_bytes_per_token is not None:
            _check_count("embed_bytes_per_token", self.embed_bytes_per_token, 1)
        for name, role in self.roles.items():
            _require(name == role.name, f"role key {name!r} holds a profile named {role.name!r}")
        _require(bool(self.roles) or self.encode is not None, "profile has no roles")
        for tier, (bytes_per_s, latency_s) in self.kv_tiers.items():
            _require(tier in ("host", "disk"), f"kv_tiers: unknown tier {tier!r} (host, disk)")
            _require(_is_number(bytes_per_s) and math.isfinite(bytes_per_s) and bytes_per_s > 0,
                     f"kv_tiers.{tier}.bytes_per_s must be a finite number > 0, got {bytes_per_s!r}")
            _require(_is_number(latency_s) and math.isfinite(latency_s) and latency_s >= 0,
                     f"kv_tiers.{tier}.latency_s must be a finite number >= 0, got {latency_s!r}")

    def bytes_per_block(self) -> int:
        """KV bytes of one block, every layer."""
        return self.kv_bytes_per_token * self.block_size

    @functools.cached_property
    def _group_specs(self) -> list[tuple[KVCacheGroupSpec, int]]:
        groups = self.kv_groups or ((None, self.kv_bytes_per_token),)
        return [(KVCacheGroupSpec(i, "full" if window is None else "sliding", (), 0, 0, window), per_token)
                for i, (window, per_token) in enumerate(groups)]

    def kv_bytes_sent(self, start: int, end: int, num_prompt_tokens: int) -> int:
        """KV bytes a prefill worker sends for prompt positions ``start .. end - 1``: a decode
        worker's reservation holds a sliding group only from the block its first query (at
        the prompt's end) can see (``KVCacheGroupSpec.first_kept_block``, the engine's rule)."""
        total = 0
        for group, per_token in self._group_specs:
            kept = group.first_kept_block(num_prompt_tokens, self.block_size) * self.block_size
            total += per_token * max(0, end - max(start, kept))
        return total

    def role(self, name: str) -> RoleProfile:
        if name == ENCODE_ROLE:
            raise ConfigError("the encode role has no step cost; use CostModel.encoder()")
        profile = self.roles.get(name)
        if profile is None:
            raise ConfigError(f"profile has no {name!r} role; rerun epdserve profile --roles {name}")
        return profile

    def encoder(self) -> EncodeCost:
        if self.encode is None or self.embed_bytes_per_token is None:
            raise ConfigError("profile has no 'encode' role; rerun epdserve profile --roles encode")
        return self.encode

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        _require(isinstance(d, dict), f"profile must be a JSON object, got {type(d).__name__}")
        _require("version" in d, "profile is missing 'version'")
        _require(d["version"] == PROFILE_VERSION, f"profile version {d['version']!r} is not supported (expected {PROFILE_VERSION})")
        for key in ("model", "dtype", "block_size", "kv_bytes_per_token", "num_layers", "roles"):
            _require(key in d, f"profile is missing {key!r}")
        roles_in = d["roles"]
        _require(isinstance(roles_in, dict), "profile 'roles' must be an object")
        roles: dict[str, RoleProfile] = {}
        encode = None
        for name, role in roles_in.items():
            if name == ENCODE_ROLE:
                encode = EncodeCost.from_dict(role)
            elif name in STEP_ROLES:
                roles[name] = RoleProfile.from_dict(name, role)
            else:
                raise ConfigError(f"unknown role {name!r} (roles: {', '.join(STEP_ROLES + (ENCODE_ROLE,))})")
        return cls(
            model=str(d["model"]),
            dtype=str(d["dtype"]),
            block_size=d["block_size"],
            kv_bytes_per_token=d["kv_bytes_per_token"],
            embed_bytes_per_token=d.get("embed_bytes_per_token"),
            num_layers=d["num_layers"],
            roles=roles,
            encode=encode,
            raw=copy.deepcopy(d),
            kv_tiers=_parse_kv_tiers(d.get("kv_tiers")),
            kv_groups=_parse_kv_groups(d.get("kv_groups")),
        )

    def to_dict(self) -> dict:
        d = copy.deepcopy(self.raw)
        d.update(
            version=PROFILE_VERSION,
            model=self.model,
            dtype=self.dtype,
            block_size=self.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
            embed_bytes_per_token=self.embed_bytes_per_token,
            num_layers=self.num_layers,
        )
        old_roles = d.get("roles") if isinstance(d.get("roles"), dict) else {}
        roles = {}
        for name, role in self.roles.items():
            roles[name] = {**old_roles.get(name, {}), **role.to_dict()}
        if self.encode is not None:
            roles[ENCODE_ROLE] = {**old_roles.get(ENCODE_ROLE, {}), **self.encode.to_dict()}
        d["roles"] = roles
        if self.kv_tiers:
            old_tiers = d.get("kv_tiers") if isinstance(d.get("kv_tiers"), dict) else {}
            d["kv_tiers"] = {tier: {**(old_tiers.get(tier) or {}), "bytes_per_s": bps, "latency_s": lat}
                             for tier, (bps, lat) in self.kv_tiers.items()}
        if self.kv_groups:
            d["kv_groups"] = [{"window": window, "bytes_per_token": per_token} for window, per_token in self.kv_groups]
        return d

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read profile {path}: {e.strerror}") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"profile {path} is not JSON: {e.msg} at line {e.lineno}") from None
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"profile {path}: {e}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"profile {path}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
