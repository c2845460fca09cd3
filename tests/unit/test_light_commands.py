"""The commands that model a cluster (simulate, plan) and every subcommand's --help run without
torch: it costs two to three seconds to import, a large part of a small simulation's time,
paid again by each such command a benchmark or planner script runs. Each check is a fresh
interpreter that builds the parser (all subcommands, as --help does), runs the command and then
looks at its own modules."""

import json
import subprocess
import sys
from pathlib import Path

from sim_profiles import profile_dict

TESTS = Path(__file__).resolve().parent.parent

CHECK = """\
import sys
sys.path.insert(0, {tests!r})
from epdserve.cli import build_parser, main
build_parser()
code = main({argv!r})
assert code == 0, code
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, "torch was imported: " + ", ".join(loaded[:5])
"""


def run_without_torch(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", CHECK.format(tests=str(TESTS), argv=argv)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_simulate_and_plan_never_import_torch(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_dict()))
    run_without_torch(["simulate", "--profile", str(profile), "--topology", "prefill=1,decode=1",
                       "--workload", "random", "--random-input-len", "64", "--random-output-len", "4",
                       "--rate", "2", "--num-requests", "8", "--out", str(tmp_path / "sim.json")])
    run_without_torch(["plan", "--profile", str(profile), "--slo", "ttft_p90:1000,tpot_p90:60", "--workload",
                       "random", "--random-input-len", "64", "--random-output-len", "8", "--instances", "2",
                       "--rate", "2", "--search-requests", "20", "--search-max-requests", "40",
                       "--workers", "1", "--out", str(tmp_path / "plan.json")])
    assert json.loads((tmp_path / "sim.json").read_text())["completed"] == 8
