"""epdserve calibrate: a profile's step costs scaled to traced step times in service."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from sim_profiles import profile_dict

from epdserve.cli import main
from epdserve.engine.step_shape import StepShape
from epdserve.errors import ConfigError
from epdserve.planner.calibrate import MIN_KNOT_STEPS, MIN_STEPS, calibrate, refresh, window_weights
from epdserve.sim.cost_model import CostModel


def write_trace(directory, worker_id, role, steps, t0=0.0):
    """Steps back to back from ``t0`` (give workers apart in time different ``t0``)."""
    directory.mkdir(exist_ok=True)
    lines = [json.dumps({"worker_id": worker_id, "role": role, "num_threads": 1, "pid": 1})]
    t = t0
    for shape, wall in steps:
        lines.append(json.dumps({"t": t, "wall_s": wall, **shape.to_dict()}))
        t += wall
    (directory / f"{worker_id}.jsonl").write_text("\n".join(lines) + "\n")


def test_each_role_scaled_by_served_over_predicted(tmp_path):
    cost = CostModel.from_dict(profile_dict())
    prefill = StepShape(256, 256 * 257 // 2, 0, 0)
    decode = StepShape(0, 0, 4, 4 * 300)
    # prefill steps took 1.25x the prediction, decode steps 1.1x; two decode workers; no worker
    # mid-step while another is (the steps alone are calibrated)
    write_trace(tmp_path, "prefill-0", "prefill",
                [(prefill, 1.25 * cost.role("prefill").step.time_s(prefill))] * 12)
    for k, w in enumerate(("decode-0", "decode-1")):
        write_trace(tmp_path, w, "decode", [(decode, 1.1 * cost.role("decode").step.time_s(decode))] * 30,
                    t0=100.0 * (k + 1))
    calibrated, result = calibrate(cost, tmp_path)
    assert result["prefill"].factor == pytest.approx(1.25)
    assert result["decode"].factor == pytest.approx(1.1)
    assert result["decode"].num_steps == 60
    # The ridge that holds each term group's factor at the profile's moves a fit this exact by
    # well under 1 %.
    assert calibrated.role("prefill").step.time_s(prefill) == pytest.approx(
        1.25 * cost.role("prefill").step.time_s(prefill), rel=1e-2)
    assert calibrated.role("prefill").neighbour_step is None and calibrated.role("decode").neighbour_step is None
    assert calibrated.role("colocated") == cost.role("colocated")  # not traced: unchanged
    # Written and read back like any profile, with the record of what it was calibrated on.
    path = tmp_path / "calibrated.json"
    calibrated.save(path)
    again = CostModel.load(path)
    assert again.role("decode").step.time_s(decode) == pytest.approx(
        calibrated.role("decode").step.time_s(decode))
    assert again.role("decode").step.time_s(decode) == pytest.approx(1.1 * cost.role("decode").step.time_s(decode), rel=1e-2)
    assert again.raw["calibration"]["roles"]["prefill"]["factor"] == pytest.approx(1.25)


def test_neighbour_slowdown_fitted_from_overlapping_steps(tmp_path):
    """Worker A's steps take 1.1x the prediction while B is idle and 1.1 x 1.2 while B is
    mid-step; B steps in the second half of the trace only."""
    cost = CostModel.from_dict(profile_dict())
    shape = StepShape(0, 0, 4, 1200)
    pred = cost.role("decode").step.time_s(shape)
    lines_a, t = [], 0.0
    for i in range(40):
        wall = 1.1 * pred * (1.2 if i >= 20 else 1.0)
        lines_a.append((t, wall))
        t += wall
    b_start = lines_a[20][0]
    lines_b = [(b_start + k * 0.01, 0.01) for k in range(int((t - b_start) / 0.01) + 5)]  # busy throughout

    def write(name, role, rows, shape):
        lines = [json.dumps({"worker_id": name, "role": role})]
        lines += [json.dumps({"t": t0, "wall_s": w, **shape.to_dict()}) for t0, w in rows]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")

    write("decode-0", "decode", lines_a, shape)
    write("colocated-0", "colocated", lines_b, StepShape(0, 0, 1, 100))
    calibrated, result = calibrate(cost, tmp_path)
    role = calibrated.role("decode")
    assert role.step.time_s(shape) == pytest.approx(1.1 * pred, rel=1e-2)  # alone
    assert role.step.time_s(shape) + role.neighbour_step.time_s(shape) == pytest.approx(1.1 * 1.2 * pred, rel=1e-2)
    assert sum(result["decode"].busy) > 0
    # From the neighbour's start on only: its steps are all next to a busy worker, so the
    # steps alone keep the profile's time and the neighbour step carries the rest.
    since = b_start
    calibrated, result = calibrate(cost, tmp_path, since=since)
    assert result["decode"].num_steps == 20
    role = calibrated.role("decode")
    assert role.step.time_s(shape) + role.neighbour_step.time_s(shape) == pytest.approx(1.1 * 1.2 * pred, rel=1e-2)
    assert role.step.time_s(shape) == pytest.approx(pred, rel=0.05)
    with pytest.raises(ConfigError, match="since"):
        calibrate(cost, tmp_path, since=t + 1.0)
    # Windows: steps 0-9 and 30-39 only (a step belongs to the window it begins in).
    windows = [(lines_a[0][0], lines_a[10][0]), (lines_a[30][0], t)]
    calibrated, result = calibrate(cost, tmp_path, windows=windows)
    assert result["decode"].num_steps == 20
    assert calibrated.raw["calibration"]["windows"] == windows
    # Alone in the first window, next to the busy worker in the second: both times recovered.
    role = calibrated.role("decode")
    assert role.step.time_s(shape) == pytest.approx(1.1 * pred, rel=1e-2)
    assert role.step.time_s(shape) + role.neighbour_step.time_s(shape) == pytest.approx(1.1 * 1.2 * pred, rel=1e-2)
    with pytest.raises(ConfigError, match="1:2"):
        calibrate(cost, tmp_path, windows=[(1.0, 2.0)])
    with pytest.raises(ConfigError, match="must end after"):
        calibrate(cost, tmp_path, windows=[(5.0, 5.0)])


def test_encoder_batches_count_as_a_busy_neighbour(tmp_path):
    """An encode worker's trace (its batches, no step shape) is a neighbour's busy time: the
    decode steps that overlap its batches carry the neighbour term; no encode cost is fitted."""
    cost = CostModel.from_dict(profile_dict())
    shape = StepShape(0, 0, 4, 1200)
    pred = cost.role("decode").step.time_s(shape)
    rows, t = [], 0.0
    for i in range(40):
        wall = pred * (2.0 if i >= 20 else 1.0)  # the encoder takes half the core from step 20 on
        rows.append((t, wall))
        t += wall
    write_trace(tmp_path, "decode-0", "decode", [(shape, w) for _, w in rows])
    busy_from = rows[20][0]
    batches = [json.dumps({"t": busy_from + k * 0.05, "wall_s": 0.05, "cpu_s": 0.025, "num_images": 1})
               for k in range(int((t - busy_from) / 0.05) + 2)]
    (tmp_path / "encode-0.jsonl").write_text("\n".join(
        [json.dumps({"worker_id": "encode-0", "role": "encode", "num_threads": 1}), *batches]) + "\n")
    calibrated, result = calibrate(cost, tmp_path)
    assert set(result) == {"decode"}
    role = calibrated.role("decode")
    assert role.step.time_s(shape) == pytest.approx(pred, rel=1e-2)
    assert role.step.time_s(shape) + role.neighbour_step.time_s(shape) == pytest.approx(2.0 * pred, rel=1e-2)
    # The headers name the cores, and the two share core 0: the doubled steps are time-sharing,
    # taken out before the fit (the simulator puts it back with --cores-per-host); no neighbour term.
    for name in ("decode-0", "encode-0"):
        path = tmp_path / f"{name}.jsonl"
        lines = path.read_text().splitlines()
        lines[0] = json.dumps({**json.loads(lines[0]), "cores": [0]})
        path.write_text("\n".join(lines) + "\n")
    calibrated, result = calibrate(cost, tmp_path)
    role = calibrated.role("decode")
    assert role.step.time_s(shape) == pytest.approx(pred, rel=1e-2) and role.neighbour_step is None
    # A third worker on core 1, idle while decode steps (its steps come after): a neighbour, not a sharer.
    prefill = StepShape(64, 64 * 65 // 2, 0, 0)
    write_trace(tmp_path, "prefill-0", "prefill", [(prefill, 1.1 * cost.role("prefill").step.time_s(prefill))] * 12,
                t0=t + 1.0)
    path = tmp_path / "prefill-0.jsonl"
    lines = path.read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "cores": [1]})
    path.write_text("\n".join(lines) + "\n")
    # And the same encoder's trace of a later round (merged directories hold one per round, the
    # same worker id): traces are told apart by identity, not by their contents.
    later = [json.dumps({"t": t + 100.0 + k, "wall_s": 0.5, "num_images": 1}) for k in range(3)]
    (tmp_path / "r2_encode-0.jsonl").write_text("\n".join(
        [json.dumps({"worker_id": "encode-0", "role": "encode", "num_threads": 1, "cores": [0]}), *later]) + "\n")
    calibrated, result = calibrate(cost, tmp_path)
    assert set(result) == {"decode", "prefill"}
    assert calibrated.role("decode").step.time_s(shape) == pytest.approx(pred, rel=1e-2)
    path.unlink()
    (tmp_path / "r2_encode-0.jsonl").unlink()
    # On cores of their own: a neighbour again.
    path = tmp_path / "encode-0.jsonl"
    lines = path.read_text().splitlines()
    lines[0] = json.dumps({**json.loads(lines[0]), "cores": [1]})
    path.write_text("\n".join(lines) + "\n")
    role = calibrate(cost, tmp_path)[0].role("decode")
    assert role.step.time_s(shape) + role.neighbour_step.time_s(shape) == pytest.approx(2.0 * pred, rel=1e-2)


def test_time_sharing_taken_out_as_a_fairly_shared_core(tmp_path):
    """An encoder on the decode worker's core runs a batch as long as a decode step alone at the
    start of every step: the step gets half the core for that long and then all of it, so its
    wall is 1.5x its time alone. The time alone is the integral of 1 / (1 + sharers mid-step)
    over the step; dividing the wall by 1 + the encoder's busy share (2/3) would find 0.9x."""
    cost = CostModel.from_dict(profile_dict())
    shape = StepShape(0, 0, 4, 1200)
    pred = cost.role("decode").step.time_s(shape)
    write_trace(tmp_path, "decode-0", "decode", [(shape, 1.5 * pred)] * 30)
    batches = [json.dumps({"t": i * 1.5 * pred, "wall_s": pred, "num_images": 1}) for i in range(30)]
    for name, lines in (("decode-0", None), ("encode-0", batches)):
        path = tmp_path / f"{name}.jsonl"
        if lines is None:
            lines = path.read_text().splitlines()
            header, lines = json.loads(lines[0]), lines[1:]
        else:
            header = {"worker_id": name, "role": "encode", "num_threads": 1}
        path.write_text("\n".join([json.dumps({**header, "cores": [0]}), *lines]) + "\n")
    calibrated, result = calibrate(cost, tmp_path)
    assert calibrated.role("decode").step.time_s(shape) == pytest.approx(pred, rel=1e-2)
    assert calibrated.role("decode").neighbour_step is None


def test_decode_factor_per_batch_size(tmp_path):
    """Served decode-only steps whose time is not linear in the batch size (12 sequences as
    slow as 16, as a CPU's matmul kernel can be): each batch size with enough steps gets its
    knot, and the calibrated cost predicts every size; a size with few steps gets none."""
    cost = CostModel.from_dict(profile_dict())
    step = cost.role("decode").step
    served = {4: 1.0, 8: 1.1, 12: 1.0, 16: 1.1}  # x the profile's time, a shape per batch size
    shapes = {d: StepShape(0, 0, d, 300 * d) for d in served}
    truth = {d: served[d] * step.time_s(shapes[d]) * (1.3 if d == 12 else 1.0) for d in served}
    steps = [(shapes[d], truth[d]) for d in served for _ in range(40)]
    steps += [(StepShape(0, 0, 3, 900), step.time_s(StepShape(0, 0, 3, 900)))] * (MIN_KNOT_STEPS - 1)
    write_trace(tmp_path, "decode-0", "decode", steps)
    calibrated, result = calibrate(cost, tmp_path)
    role = calibrated.role("decode")
    assert [d for d, _ in result["decode"].decode_factors] == [4, 8, 12, 16]  # not 3: too few steps
    for d in served:
        assert role.step.time_s(shapes[d]) == pytest.approx(truth[d], rel=1e-6)
    assert role.step.decode_factors == result["decode"].decode_factors
    # Calibrating a calibrated profile again fits its knots afresh, on the terms without them.
    again, _ = calibrate(calibrated, tmp_path)
    assert again.role("decode").step.time_s(shapes[12]) == pytest.approx(truth[12], rel=1e-6)


@pytest.mark.parametrize("files, message", [
    ({}, "no step traces"),
    ({"w.jsonl": "not json\n"}, "not a step trace"),
    ({"w.jsonl": '{"worker_id": "w"}\n'}, "role"),
    ({"w.jsonl": '{"role": "router"}\n'}, "no step cost"),
    ({"w.jsonl": '{"role": "encode"}\n{"t": 0, "wall_s": 0.1, "num_images": 1}\n'}, "encoder batches only"),
    ({"w.jsonl": '{"role": "decode"}\n{"t": 0, "wall_s": 0.1, "num_decode_seqs": 1}\n'}, f"at least {MIN_STEPS}"),
    ({"w.jsonl": '{"role": "decode"}\n{"t": 0, "num_decode_seqs": 1}\n'}, "not a step trace"),
])
def test_bad_traces_are_config_errors(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        calibrate(CostModel.from_dict(profile_dict()), tmp_path)


def test_cli_writes_the_profile_and_bad_input_exits_2(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_dict()))
    traces = tmp_path / "steps"
    write_trace(traces, "colocated-0", "colocated", [(StepShape(0, 0, 2, 200), 0.05)] * MIN_STEPS)
    out = tmp_path / "calibrated.json"
    assert main(["calibrate", "--profile", str(profile), "--step-trace-dir", str(traces), "--out", str(out)]) == 0
    assert "colocated" in capsys.readouterr().out
    assert CostModel.load(out).raw["calibration"]["roles"]["colocated"]["num_steps"] == MIN_STEPS
    assert main(["calibrate", "--profile", str(profile), "--step-trace-dir", str(tmp_path / "none"),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epdserve: error:") and len(err.strip().splitlines()) == 1
    assert main(["calibrate", "--profile", str(profile), "--step-trace-dir", str(traces), "--window", "soon",
                 "--out", str(out)]) == 2
    assert "START:END" in capsys.readouterr().err
    assert main(["calibrate", "--profile", str(profile), "--step-trace-dir", str(traces), "--window", "0:1e9",
                 "--out", str(out)]) == 0
    assert CostModel.load(out).raw["calibration"]["windows"] == [[0.0, 1e9]]


def test_colocated_prefill_and_decode_terms_scaled_apart(tmp_path):
    """Colocated steps mix prefill and decode: each term group gets its own factor (here the
    prefill terms 1.3, the base 0.9, the decode terms 1.1)."""
    cost = CostModel.from_dict(profile_dict())
    step = cost.role("colocated").step
    shapes = ([StepShape(0, 0, 4, 4 * 300)] * 30 + [StepShape(0, 0, 12, 12 * 300)] * 30
              + [StepShape(200, 200 * 201 // 2, 3, 900)] * 12)
    rows = []
    for shape in shapes:
        base, prefill, decode = step.parts_s(shape)
        rows.append((shape, 0.9 * base + 1.3 * prefill + 1.1 * decode))
    write_trace(tmp_path, "colocated-0", "colocated", rows)
    calibrated, result = calibrate(cost, tmp_path)
    assert result["colocated"].alone == pytest.approx((0.9, 1.3, 1.1), rel=2e-2)
    assert result["colocated"].busy == (0.0, 0.0, 0.0)
    for shape, wall in rows:
        assert calibrated.role("colocated").step.time_s(shape) == pytest.approx(wall, rel=1e-2)


def write_encoder_trace(directory, batches, cores=None, worker_id="encode-0"):
    """An encode worker's trace: (start, wall, tiles) per batch, one image each."""
    header = {"worker_id": worker_id, "role": "encode", "num_threads": 1, **({"cores": cores} if cores else {})}
    lines = [json.dumps(header), *(json.dumps({"t": t, "wall_s": w, "cpu_s": w, "num_images": 1, "num_tiles": n})
                                   for t, w, n in batches)]
    (directory / f"{worker_id}.jsonl").write_text("\n".join(lines) + "\n")


def test_encoder_cost_scaled_to_its_batches_time_alone(tmp_path):
    """Batches that counted their tiles scale the profile's encoder cost by one factor, their
    time alone over the profile's prediction; cache hits (no tiles) are left out; on the decode
    worker's core the time-sharing is taken out first."""
    cost = CostModel.from_dict(profile_dict())
    enc = cost.encoder()
    shape = StepShape(0, 0, 4, 1200)
    write_trace(tmp_path, "decode-0", "decode", [(shape, cost.role("decode").step.time_s(shape))] * 12, t0=1000.0)
    batches = [(10.0 * i, 0.8 * enc.time_s(1 + i % 3), 1 + i % 3) for i in range(MIN_STEPS)]
    write_encoder_trace(tmp_path, batches + [(10.0 * MIN_STEPS, 0.001, 0)])  # a cache hit: 1 ms, no tiles
    calibrated, result = calibrate(cost, tmp_path)
    assert set(result) == {"decode"}
    for tiles in (1, 2, 8):
        assert calibrated.encoder().time_s(tiles) == pytest.approx(0.8 * enc.time_s(tiles))
    record = calibrated.raw["calibration"]["encode"]
    assert record["num_batches"] == MIN_STEPS and record["factor"] == pytest.approx(0.8)
    # Written and read back as any profile.
    path = tmp_path / "calibrated.json"
    calibrated.save(path)
    assert CostModel.load(path).encoder().per_tile_s == pytest.approx(0.8 * enc.per_tile_s)
    # On core 0 with the decode worker, every batch running beside a decode step throughout:
    # twice its time alone on the wall, the same factor once the sharing is taken out.
    step = cost.role("decode").step.time_s(shape)
    batches = [(i * 2.0, 2 * 0.8 * enc.time_s(1), 1) for i in range(MIN_STEPS)]
    decode_steps = []
    for t, wall, _ in batches:  # decode steps back to back over each batch, none between
        n = int(np.ceil(wall / step)) + 1
        decode_steps.append([(t - step / 2 + k * step, step) for k in range(n)])
    (tmp_path / "decode-0.jsonl").write_text("\n".join(
        [json.dumps({"worker_id": "decode-0", "role": "decode", "num_threads": 1, "cores": [0]}),
         *(json.dumps({"t": t, "wall_s": w, **shape.to_dict()}) for run in decode_steps for t, w in run)]) + "\n")
    write_encoder_trace(tmp_path, batches, cores=[0])
    calibrated, _ = calibrate(cost, tmp_path)
    assert calibrated.raw["calibration"]["encode"]["factor"] == pytest.approx(0.8, rel=1e-6)


def test_encoder_left_as_profiled_without_tile_counts_or_enough_batches(tmp_path):
    cost = CostModel.from_dict(profile_dict())
    shape = StepShape(0, 0, 4, 1200)
    write_trace(tmp_path, "decode-0", "decode", [(shape, cost.role("decode").step.time_s(shape))] * 12, t0=1000.0)
    (tmp_path / "encode-0.jsonl").write_text("\n".join(  # an older trace: no tile counts
        [json.dumps({"worker_id": "encode-0", "role": "encode", "num_threads": 1}),
         *(json.dumps({"t": 10.0 * i, "wall_s": 0.5, "num_images": 1}) for i in range(MIN_STEPS))]) + "\n")
    calibrated, _ = calibrate(cost, tmp_path)
    assert calibrated.encoder() == cost.encoder() and "encode" not in calibrated.raw["calibration"]
    write_encoder_trace(tmp_path, [(10.0 * i, 0.5, 1) for i in range(MIN_STEPS - 1)])
    calibrated, _ = calibrate(cost, tmp_path)
    assert calibrated.encoder() == cost.encoder() and "encode" not in calibrated.raw["calibration"]


def test_cli_prints_the_encoders_factor(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_dict()))
    enc = CostModel.from_dict(profile_dict()).encoder()
    traces = tmp_path / "steps"
    write_trace(traces, "colocated-0", "colocated", [(StepShape(0, 0, 2, 200), 0.05)] * MIN_STEPS, t0=1000.0)
    write_encoder_trace(traces, [(10.0 * i, 1.25 * enc.time_s(2), 2) for i in range(MIN_STEPS)])
    out = tmp_path / "calibrated.json"
    assert main(["calibrate", "--profile", str(profile), "--step-trace-dir", str(traces), "--out", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("encode"))
    assert f"{MIN_STEPS} batches" in line and "factor 1.250" in line
    assert CostModel.load(out).encoder().time_s(2) == pytest.approx(1.25 * enc.time_s(2))


def test_refresh_scales_a_calibrated_profile_by_one_factor_per_role(tmp_path):
    """``refresh``: each role's whole step cost (its neighbour term and decode factors kept in
    proportion) times its steps' time alone over what the calibrated profile predicts, the
    neighbour term counted by the steps' neighbours' busy share; the encoder by its own factor."""
    base = CostModel.from_dict(profile_dict())
    decode_role = base.role("decode")
    step = decode_role.step.scaled(1.0, 1.0, 1.2).with_decode_factors(((1, 0.9), (8, 1.1)))
    roles = dict(base.roles)
    roles["decode"] = replace(decode_role, step=step, neighbour_step=step.scaled(0.5))
    cost = replace(base, roles=roles, raw={**base.raw, "calibration": {"roles": {"decode": {"factor": 1.2}}}})
    prefill_shape = StepShape(256, 256 * 257 // 2, 0, 0)
    prefill_s = cost.role("prefill").step.time_s(prefill_shape)
    shapes = [StepShape(0, 0, d, 300 * d) for d in (1, 4, 8, 12)] * 5
    # with the neighbour mid-step throughout
    predicted = [1.5 * cost.role("decode").step.time_s(s) for s in shapes]
    # Prefill steps back to back over the whole stretch (own core), at 0.9x; decode steps at 1.1x
    # of the prediction with their busy neighbour.
    num_prefills = max(int(sum(predicted) / (0.9 * prefill_s)) + 4, MIN_STEPS)
    write_trace(tmp_path, "prefill-0", "prefill", [(prefill_shape, 0.9 * prefill_s)] * num_prefills,
                t0=-prefill_s)
    write_trace(tmp_path, "decode-0", "decode", [(s, 1.1 * p) for s, p in zip(shapes, predicted)])
    enc = cost.encoder()  # its batches back to back over the stretch too: the decode steps' other neighbour
    batch_s = 0.7 * enc.time_s(2)
    num_batches = max(int(1.1 * sum(predicted) / batch_s) + 4, MIN_STEPS)
    write_encoder_trace(tmp_path, [((i - 1) * batch_s, batch_s, 2) for i in range(num_batches)])
    refreshed, factors = refresh(cost, tmp_path)
    assert factors["decode"]["factor"] == pytest.approx(1.1, rel=1e-3)
    assert factors["prefill"]["factor"] == pytest.approx(0.9, rel=1e-3)
    assert factors["encode"]["factor"] == pytest.approx(0.7)
    for s in shapes:
        assert refreshed.role("decode").step.time_s(s) == pytest.approx(
            1.1 * cost.role("decode").step.time_s(s))
        assert refreshed.role("decode").neighbour_step.time_s(s) == pytest.approx(
            1.1 * cost.role("decode").neighbour_step.time_s(s))
    assert refreshed.role("decode").step.decode_factors == step.decode_factors
    assert refreshed.role("prefill").step.time_s(prefill_shape) == pytest.approx(0.9 * prefill_s)
    assert refreshed.role("colocated") == cost.role("colocated")  # not traced: unchanged
    assert refreshed.encoder().time_s(3) == pytest.approx(0.7 * enc.time_s(3))
    # The calibration it refreshes stays on record beside the refresh; written and read back.
    path = tmp_path / "refreshed.json"
    refreshed.save(path)
    record = CostModel.load(path).raw["calibration"]
    assert record["roles"] == {"decode": {"factor": 1.2}}
    assert record["refresh"]["factors"]["decode"]["num_steps"] == len(shapes)
    # A window that holds too few steps of a role is an error, as calibrate's.
    with pytest.raises(ConfigError, match="at least"):
        refresh(cost, tmp_path, windows=[(0.0, 2 * predicted[0])])


def test_cli_refresh_prints_the_factors(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_dict()))
    shape = StepShape(0, 0, 2, 200)
    step_s = CostModel.from_dict(profile_dict()).role("colocated").step.time_s(shape)
    traces = tmp_path / "steps"
    write_trace(traces, "colocated-0", "colocated", [(shape, 1.3 * step_s)] * MIN_STEPS)
    out = tmp_path / "refreshed.json"
    assert main(["calibrate", "--refresh", "--profile", str(profile), "--step-trace-dir", str(traces),
                 "--out", str(out)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("colocated"))
    assert f"{MIN_STEPS} steps" in line and "factor 1.300" in line
    assert CostModel.load(out).role("colocated").step.time_s(shape) == pytest.approx(1.3 * step_s)
    assert main(["calibrate", "--refresh", "--profile", str(profile), "--step-trace-dir",
                 str(tmp_path / "none"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("epdserve: error:")


def test_every_calibration_window_weighs_the_same_in_the_fit(tmp_path):
    """A light run's many small steps and a heavy run's few large ones: counted by steps the
    light run decides the terms; with a window each, the heavy run weighs as much, and the fit
    follows its large steps more closely (here no term set can fit both runs exactly)."""
    assert window_weights(np.array([0, 0, 0, 1])) == pytest.approx([2 / 3, 2 / 3, 2 / 3, 2.0])
    assert window_weights(np.array([5, 5])) == pytest.approx([1.0, 1.0])
    cost = CostModel.from_dict(profile_dict())
    step = cost.role("decode").step
    small, middle, large = StepShape(0, 0, 1, 300), StepShape(0, 0, 4, 4 * 300), StepShape(0, 0, 16, 16 * 600)
    light = [(small, step.time_s(small)), (middle, step.time_s(middle))] * 100  # as profiled
    heavy = [(large, 1.3 * step.time_s(large))] * 20  # 1.3x the profile
    write_trace(tmp_path, "decode-0", "decode", light + heavy)
    end_light = sum(w for _, w in light)
    end = end_light + sum(w for _, w in heavy)
    one, _ = calibrate(cost, tmp_path, windows=[(0.0, end + 1.0)])
    two, _ = calibrate(cost, tmp_path, windows=[(0.0, end_light - 1e-9), (end_light - 1e-9, end + 1.0)])
    target = 1.3 * step.time_s(large)
    error_one = abs(one.role("decode").step.time_s(large) / target - 1)
    error_two = abs(two.role("decode").step.time_s(large) / target - 1)
    assert error_two < 0.75 * error_one  # 15 % low against 23 % here
