"""keep_freed_memory in a fresh process: a large activation-sized buffer comes from malloc's heap
(not a mapping of its own) and stays there once freed, ready for the next step; switched off,
nothing is set. Checked with glibc's own accounting (mallinfo2), not page-fault counts, which
the host's memory management makes vary from run to run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, sys
import torch
from epdserve.engine.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory()
before = libc.mallinfo2()
x = torch.empty(2048, 3072, dtype=torch.bfloat16)  # 12 MiB, a prefill step's gate/up output
x.fill_(1.0)
during = libc.mallinfo2()
del x
after = libc.mallinfo2()
print(applied, during.hblkhd - before.hblkhd, after.fordblks)
"""

BUFFER = 2048 * 3072 * 2


def _run(env_value: str | None) -> tuple[str, int, int]:
    env = dict(os.environ)
    env.pop("EPDSERVE_KEEP_FREED_MEMORY", None)
    if env_value is not None:
        env["EPDSERVE_KEEP_FREED_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    applied, mapped, free_in_heap = out.stdout.split()
    return applied, int(mapped), int(free_in_heap)


glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc malloc"
)


@glibc_only
def test_freed_activation_stays_in_the_heap() -> None:
    applied, mapped, free_in_heap = _run(None)
    assert applied == "True"
    assert mapped == 0  # served from the heap, not a mapping of its own
    assert free_in_heap >= BUFFER  # freed but kept (not trimmed) for the next step


@glibc_only
def test_switched_off_sets_nothing() -> None:
    applied, mapped, _ = _run("0")
    assert applied == "False"
    # malloc's default: a buffer this large is a mapping of its own, unmapped again when freed
    assert mapped >= BUFFER
