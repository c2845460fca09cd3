"""``epdserve profile``: the file it writes loads as a cost model, the fit recovers known
coefficients, the probe builds steps of the intended shape and gives every block back, and bad
input is one line with exit code 2. Never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from epdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from epdserve.engine.step_shape import StepShape
from epdserve.errors import ConfigError
from epdserve.planner import profile
from epdserve.planner.profile import fit_line, worst_fitted
from epdserve.planner.profile_grid import FULL_GRID, QUICK_GRID, StepPoint
from epdserve.planner.step_probe import median_time_s
from epdserve.request import Request
from epdserve.sampling import SamplingParams
from epdserve.sim.cost_model import CostModel, StepCost

CLI_TIMEOUT_S = 300


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epdserve.cli", "profile", *args], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S, check=False)


def shape_of(point: StepPoint) -> StepShape:
    """The cost model's shape of a grid point, through a scheduler output like the probe's."""
    params = SamplingParams()
    entries = []
    for start, num_new in point.prefills:
        entries.append(ScheduledRequest(Request("p", [1] * (start + num_new), params), start, num_new, [], True))
    for _ in range(point.num_decode_seqs):
        request = Request("d", [1] * (point.decode_context - 1), params)
        request.output_token_ids.append(1)
        entries.append(ScheduledRequest(request, point.decode_context - 1, 1, [], True))
    return StepShape.from_scheduler_output(SchedulerOutput(entries))


def test_quick_decode_profile_loads_as_cost_model(tmp_path):
    out = tmp_path / "profile.json"
    host_dir, disk_dir = tmp_path / "host", tmp_path / "disk"
    proc = run_cli("--quick", "--roles", "decode", "--out", str(out), "--disable-tqdm",
                   "--kv-host-tier-dir", str(host_dir), "--kv-disk-tier-dir", str(disk_dir))
    assert proc.returncode == 0, proc.stderr
    model = CostModel.load(out)
    assert set(model.roles) == {"decode"}
    # The KV tiers' media, measured in scratch tiers under the given directories, left empty.
    assert set(model.kv_tiers) == {"host", "disk"}
    assert all(bps > 0 and lat >= 0 for bps, lat in model.kv_tiers.values())
    assert list(host_dir.iterdir()) == [] and list(disk_dir.iterdir()) == []
    assert "KV host tier" in proc.stdout and "--kv-disk-tier-read-gbps" in proc.stdout
    decode = model.role("decode")
    assert decode.num_threads == 1
    assert all(v >= 0 for v in decode.step.to_dict().values())
    assert decode.fit is not None and "mean_abs_rel_error" in decode.fit and "r2" in decode.fit
    assert decode.fit["num_samples"] == len(decode.samples) > 0
    # A decode worker's steps only decode: every sample has decode sequences and no prefill.
    assert all(s["num_decode_seqs"] > 0 and s["num_prefill_tokens"] == 0 for s in decode.samples)
    raw = json.loads(out.read_text())
    assert raw["version"] == 1 and raw["kv_bytes_per_token"] > 0 and raw["num_layers"] > 0
    assert "decode" in proc.stdout and "wrote" in proc.stdout


@pytest.mark.parametrize("grid", [FULL_GRID, QUICK_GRID], ids=["full", "quick"])
def test_fit_recovers_known_coefficients(grid):
    truth = StepCost(base_s=0.012, per_prefill_token_s=4e-4, per_prefill_attn_pair_s=4e-7,
                     per_decode_seq_s=1.2e-3, per_decode_context_token_s=1e-6)
    points = grid.points("colocated", 2048, 256, 4096)
    samples = [(shape_of(p), truth.time_s(shape_of(p))) for p in points]
    cost, fit = StepCost.fit(samples)
    for name, value in truth.to_dict().items():
        assert cost.to_dict()[name] == pytest.approx(value, rel=1e-6), name
    assert fit["mean_abs_rel_error"] < 1e-9
    assert fit["num_samples"] == len(points)


def test_grid_points_respect_role_limits():
    points = FULL_GRID.points("colocated", max_num_batched_tokens=256, max_num_seqs=16, max_model_len=1024)
    assert points
    assert all(p.num_tokens <= 256 and p.num_seqs <= 16 and p.max_len < 1024 for p in points)
    assert all(p.prefills and not p.num_decode_seqs for p in FULL_GRID.points("prefill", 2048, 256, 4096))
    assert all(p.num_decode_seqs and not p.prefills for p in FULL_GRID.points("decode", 2048, 256, 4096))
    colocated = FULL_GRID.points("colocated", 2048, 256, 4096)
    assert any(p.prefills and p.num_decode_seqs for p in colocated)  # mixed steps


@pytest.mark.parametrize("step_s,expected_runs", [
    (0.01, 7),  # short: repeated until min_time_s (0.3 s) or max_repeats
    (0.2, 3),  # min_repeats
    (1.2, 3),  # three runs take 3.6 s: the third starts at 2.4 s, under max_point_s
    (2.0, 2),  # past max_point_s (3 s) after two
    (3.0, 0),  # the first call took max_point_s: it is the measurement, no warm-up
    (5.0, 0),
])
def test_repeats_follow_step_length(monkeypatch, step_s: float, expected_runs: int):
    clock = [0.0]
    monkeypatch.setattr(profile.time, "perf_counter", lambda: clock[0])
    calls = []

    def run() -> None:
        calls.append(1)
        clock[0] += step_s

    assert median_time_s(run, FULL_GRID) == pytest.approx(step_s)
    assert len(calls) == 1 + expected_runs  # the warm-up call is not timed


def test_grid_needs_a_positive_point_budget():
    with pytest.raises(ConfigError, match="max_point_s"):
        replace(FULL_GRID, max_point_s=0.0)


def test_worst_fitted_picks_the_outliers():
    cost = StepCost(0.01, 1e-3, 0.0, 0.0, 0.0)
    shapes = [StepShape(n, 0, 0, 0) for n in (10, 20, 30, 40)]
    samples = [(s, cost.time_s(s)) for s in shapes]
    samples[2] = (shapes[2], 3 * samples[2][1])
    samples[0] = (shapes[0], 1.5 * samples[0][1])
    assert worst_fitted(samples, cost, 4) == [2, 0]
    assert worst_fitted(samples, cost, 1) == [2]


def test_fit_line_keeps_terms_non_negative():
    assert fit_line([(1, 0.3), (2, 0.5), (4, 0.9)]) == pytest.approx((0.1, 0.2))
    base, slope = fit_line([(1, 0.1), (2, 0.3), (3, 0.5)])  # the line crosses below zero
    assert base == 0.0 and slope > 0
    assert fit_line([(1, 0.5), (2, 0.4)]) == pytest.approx((0.45, 0.0))


def test_probe_builds_the_intended_steps_and_frees_every_block():
    from epdserve.config import EngineArgs
    from epdserve.engine.engine import LLMEngine
    from epdserve.planner.step_probe import StepProbe

    engine = LLMEngine(EngineArgs(num_kv_blocks=256, enable_prefix_caching=False))
    probe = StepProbe(engine)
    for point in (StepPoint(((0, 40), (24, 8))), StepPoint((), 3, 50), StepPoint(((0, 16),), 2, 33)):
        plan = probe.build(point)
        assert StepShape.from_scheduler_output(plan) == shape_of(point)
        engine.runner.execute(plan)
        probe.release(plan)
        assert engine.kv_cache.is_all_free()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--roles", "decode,verify"], "unknown role 'verify'"),
        (["--roles", "decode", "--threads", "decode=0"], "--threads"),
        (["--roles", "decode", "--out", "/nonexistent-dir/p.json"], "does not exist"),
        (["--roles", "decode", "--model", "/nonexistent/model.gguf"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, message, tmp_path):
    if "--out" not in args:
        args = [*args, "--out", str(tmp_path / "p.json")]
    proc = run_cli("--quick", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "p.json").exists()


def test_prefill_probe_pushes_its_kv_into_the_peer_pool():
    from epdserve.config import EngineArgs
    from epdserve.engine.engine import LLMEngine
    from epdserve.planner.profile import pushing_kv
    from epdserve.planner.step_probe import StepProbe

    engine = LLMEngine(EngineArgs(num_kv_blocks=64, enable_prefix_caching=False))
    probe = StepProbe(engine)
    with pushing_kv(probe) as peer:
        plan = probe.build(StepPoint(((0, 40), (16, 20))))
        engine.runner.execute(plan)
        for entry in plan.scheduled:
            blocks = entry.block_tables[0][entry.start_pos // 16 : -(-(entry.start_pos + entry.num_new_tokens) // 16)]
            for layer in (0, len(peer.layers) - 1):
                local = engine.runner.kv_caches[layer][:, blocks]
                assert torch.equal(peer.layers[layer][:, blocks], local) and local.abs().sum() > 0
        engine.runner.pusher.poll()
        probe.release(plan)
    assert engine.runner.pusher is None and probe.kv_target is None
    assert engine.kv_cache.is_all_free()


def test_busy_neighbour_runs_on_the_given_cores_and_stops():
    import multiprocessing
    import os

    from epdserve.config import EngineArgs
    from epdserve.planner.profile_neighbour import busy_neighbour

    core = max(os.sched_getaffinity(0))
    with busy_neighbour(EngineArgs(max_model_len=1024), (core,)):
        (child,) = multiprocessing.active_children()
        assert os.sched_getaffinity(child.pid) == {core}
    assert not multiprocessing.active_children()
    with busy_neighbour(EngineArgs(), ()):  # no free core: no neighbour
        assert not multiprocessing.active_children()
