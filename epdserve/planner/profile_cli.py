"""``epdserve profile``: measure each role's step time on this machine and write ``profile.json``.

    epdserve profile [--model M] [--roles colocated,prefill,decode,encode] [--out profile.json]
                     [--threads colocated=2,prefill=1,...] [--quick] [engine options]

The engine options are the ones the workers will serve with: the profile records their KV pool
size and batch limits, and measures only steps within those limits.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from epdserve.cli_args import add_engine_args
from epdserve.errors import ConfigError

SUMMARY_CHUNK = 512  # prefill tokens/s is reported for chunks of this many tokens at context 0
SUMMARY_DECODE = (16, 512)  # decode step time is reported for this batch size and context
BUSY_WARNING_SHARE = 0.1  # warn when other work used more CPU than this just before profiling


def add_profile_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure step times per role on this machine and fit the cost model")
    p.add_argument("--roles", default=None,
                   help="comma-separated roles: colocated, prefill, decode, encode "
                        "(default colocated,prefill,decode, plus encode when the vision encoder is available)")
    p.add_argument("--out", default="profile.json", help="where to write the profile (JSON)")
    p.add_argument("--threads", default=None, metavar="ROLE=N,...",
                   help="threads per role (default colocated=2,prefill=1,decode=1,encode=1: "
                        "one worker's cores in serve's two-core layouts)")
    p.add_argument("--busy-neighbours", action="store_true",
                   help="time each role while a busy worker runs on the cores it leaves free (as when every "
                        "core serves: the workers share memory bandwidth and cache)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling of the measured steps: 0 is greedy (bench's default); a positive value samples "
                        "every sequence from its softmax, which costs about 1 ms more per sequence per step here")
    p.add_argument("--quick", action="store_true", help="a tiny grid in seconds (checks that it runs; rough numbers)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_engine_args(p)
    p.set_defaults(func=run_profile_command)
    return p


def parse_roles(text: str | None) -> tuple[str, ...]:
    from epdserve.planner.profile import ROLES, STEP_ROLES, encoder_available

    if text is None:
        return (*STEP_ROLES, "encode") if encoder_available() else STEP_ROLES
    roles = tuple(dict.fromkeys(r.strip() for r in text.split(",") if r.strip()))
    for role in roles:
        if role not in ROLES:
            raise ConfigError(f"unknown role {role!r} in --roles; choose from {', '.join(ROLES)}")
    if not roles:
        raise ConfigError(f"--roles is empty; choose from {', '.join(ROLES)}")
    return roles


def parse_threads(text: str | None) -> dict[str, int]:
    from epdserve.planner.profile import DEFAULT_THREADS

    threads = dict(DEFAULT_THREADS)
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        role, _, value = pair.partition("=")
        role = role.strip()
        if role not in threads or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--threads takes ROLE=N pairs with N >= 1 and roles {', '.join(threads)}, got {pair!r}")
        threads[role] = int(value)
    return threads


def check_writable(path: str) -> None:
    """ConfigError unless ``path`` can be written (checked before minutes of measuring)."""
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ConfigError(f"--out {path} is a directory")
    if not parent.is_dir():
        raise ConfigError(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(target if target.exists() else parent, os.W_OK):
        raise ConfigError(f"cannot write {path}: permission denied")


def summary_rows(model) -> list[list[str]]:  # model: CostModel
    """Per role: threads, fit quality and the headline rates, from the fitted coefficients."""
    from epdserve.engine.step_shape import StepShape

    n = SUMMARY_CHUNK
    batch, context = SUMMARY_DECODE
    rows = []
    for name, role in model.roles.items():
        # A rate is shown only for the kind of step the role was measured on.
        has_prefill = any(s.get("num_prefill_tokens") for s in role.samples)
        has_decode = any(s.get("num_decode_seqs") for s in role.samples)
        prefill = n / role.step.time_s(StepShape(n, n * (n + 1) // 2, 0, 0)) if has_prefill else None
        decode = role.step.time_s(StepShape(0, 0, batch, batch * context)) * 1e3 if has_decode else None
        fit = role.fit or {}
        rows.append([name, str(role.num_threads), f"{100 * fit.get('mean_abs_rel_error', float('nan')):.1f} %",
                     f"{fit.get('r2', float('nan')):.4f}", _cell(prefill, 0), _cell(decode, 1), "—"])
    if model.encode is not None:
        tiles_per_s = 1.0 / model.encode.per_tile_s if model.encode.per_tile_s > 0 else None
        rows.append(["encode", str(model.encode.num_threads), "—", "—", "—", "—", _cell(tiles_per_s, 2)])
    return rows


def _cell(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def format_summary(model) -> str:  # model: CostModel
    batch, context = SUMMARY_DECODE
    headers = ["role", "threads", "fit error (mean |rel|)", "r2", f"prefill tok/s ({SUMMARY_CHUNK}-token chunk)",
               f"decode step ms (batch {batch}, ctx {context})", "encoder tiles/s"]
    rows = [headers, *summary_rows(model)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines + tier_lines(model))


def tier_lines(model) -> list[str]:  # model: CostModel
    """The KV tiers' media as measured, with the flag that pins a worker's reload rule to it."""
    lines = []
    for tier, entry in (model.raw.get("kv_tiers") or {}).items():
        if tier in model.kv_tiers:
            bytes_per_s, latency_s = model.kv_tiers[tier]
            lines.append(f"KV {tier} tier ({entry.get('dir', '?')}): read {bytes_per_s / 1e9:.2f} GB/s, "
                         f"{latency_s * 1e6:.1f} us per load (serve --kv-{tier}-tier-read-gbps "
                         f"{bytes_per_s / 1e9:.2f} uses it)")
        else:
            lines.append(f"KV {tier} tier: not measured ({entry.get('error', 'no result')})")
    return lines


def run_profile_command(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    from epdserve.cli_args import engine_args_from
    from epdserve.planner.profile import Profiler, ProfileTarget
    from epdserve.planner.profile_grid import FULL_GRID, QUICK_GRID

    roles = parse_roles(ns.roles)
    threads = parse_threads(ns.threads)
    check_writable(ns.out)
    target = ProfileTarget(engine_args_from(ns), roles, threads, QUICK_GRID if ns.quick else FULL_GRID,
                           ns.busy_neighbours, ns.temperature)
    profiler = Profiler(target)
    with tqdm(total=profiler.num_points, desc="profile", unit="step", disable=ns.disable_tqdm) as progress:
        model = profiler.run(lambda: progress.update(1))
    try:
        model.save(ns.out)
    except OSError as e:
        raise ConfigError(f"cannot write {ns.out}: {e.strerror}") from None
    print(format_summary(model))
    busy = model.raw.get("host", {}).get("busy_share_at_start", 0.0)
    if busy > BUSY_WARNING_SHARE:
        print(f"warning: other work kept the CPUs {100 * busy:.0f} % busy just before profiling; "
              "step times may be inflated (profile again on an idle machine)")
    print(f"wrote {ns.out}")
    return 0
