"""keep_freed_memory in a fresh process: large freed buffers are reused (no new page faults
when the same step's allocations come again), and the switch off leaves malloc's defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys
import torch
from epdserve.engine.host_memory import keep_freed_memory
print(keep_freed_memory())
def step():
    # activations of a prefill step: large buffers allocated, written and freed each time
    for _ in range(4):
        x = torch.empty(2048, 3072, dtype=torch.bfloat16)  # 12 MiB
        x.fill_(1.0)
        del x
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(env_value: str | None) -> tuple[str, int]:
    import os

    env = dict(os.environ)
    env.pop("EPDSERVE_KEEP_FREED_MEMORY", None)
    if env_value is not None:
        env["EPDSERVE_KEEP_FREED_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc thresholds")
def test_freed_activations_are_reused_without_page_faults() -> None:
    applied, faults = _run(None)
    assert applied == "True"
    # 20 buffers of 12 MiB (3,072 pages each) touched again: with the memory kept, a few faults
    assert faults < 3072


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc thresholds")
def test_switched_off_keeps_mallocs_defaults() -> None:
    applied, faults = _run("0")
    assert applied == "False"
    assert faults >= 3072  # each 12 MiB buffer mapped afresh: its pages fault again
