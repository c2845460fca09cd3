"""benchmarks/sim_speed.py's result comparison: an output field only one revision writes is
named, not counted as a change of result; a changed value is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_speed.py"
_spec = importlib.util.spec_from_file_location("sim_speed", _PATH)
sim_speed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim_speed)


def test_fields_on_one_side_are_named_and_values_compared():
    base = {"summary": {"ttft_ms": [1.0, 2.0]}, "roles": [{"steps": 3}]}
    this = {"summary": {"ttft_ms": [1.0, 2.0]}, "roles": [{"steps": 3, "num_pulled_blocks": 0}]}
    assert sim_speed.same_result(base, this) == (True, ["/roles[0]/num_pulled_blocks"])
    changed = {"summary": {"ttft_ms": [1.0, 2.5]}, "roles": [{"steps": 3}]}
    assert sim_speed.same_result(base, changed) == (False, [])
    assert sim_speed.same_result({"a": [1, 2]}, {"a": [1]}) == (False, [])  # lengths differ
