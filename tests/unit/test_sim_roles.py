"""Role switching in the simulator (sim/roles.py): the router's controller and switch rules
on simulated instances. The synthetic profile is not the subject: its step times are easy to
reason about."""

from __future__ import annotations

import numpy as np
import pytest
from sim_profiles import profile_dict

from epdserve.router.role_control import RoleControlConfig
from epdserve.router.workers import WorkerState
from epdserve.sim.cluster import ClusterSim, SimConfig
from epdserve.sim.cost_model import CostModel
from epdserve.sim.topology import parse_topology
from epdserve.sim.workload import SimWorkload

CONTROL = RoleControlConfig(ttft_slo_s=2.0, tpot_slo_s=0.05, min_dwell_s=5.0, cooldown_s=2.0)


def _workload(num: int, rate: float, input_len: int, output_len: int, seed: int = 0) -> SimWorkload:
    gaps = np.random.default_rng(seed).exponential(1 / rate, num)
    return SimWorkload("phase", np.cumsum(gaps), np.full(num, input_len, dtype=np.int64),
                       np.full(num, output_len, dtype=np.int64), None)


def _run(topology: str, workload: SimWorkload, control: RoleControlConfig | None = CONTROL):
    sim = ClusterSim(CostModel.from_dict(profile_dict()), SimConfig(parse_topology(topology), role_control=control,
                                                                    role_switch_s=0.4), workload)
    return sim, sim.run()


def _good(recorder, ttft_s: float) -> int:
    return int(np.sum(recorder.is_ok & (recorder.ttft <= ttft_s)))


def test_long_prompts_move_decode_instances_to_prefill():
    # 1000-token prompts at 1.5/s need 1.5 s of prefill a second: more than one prefill instance.
    workload = _workload(150, 1.5, 1000, 8)
    sim, rec = _run("prefill=1,decode=3", workload)
    summary = sim.summary()["role_switching"]
    assert summary["num_switches"] >= 1
    first = summary["switches"][0]
    assert (first["from_role"], first["to_role"]) == ("decode", "prefill")
    assert first["ended_s"] - first["began_s"] >= 0.4  # drained, then the switch time
    roles = [inst.role for inst in sim.instances]
    assert roles.count("prefill") == 1 + summary["num_switches"]
    assert all(w.state is WorkerState.READY for w in sim.registry.workers.values())
    switched = sim.by_worker_id[first["worker"]]
    assert switched.role == "prefill" and switched.worker.num_switches >= 1
    assert sim.registry.get(first["worker"]) is switched.worker
    assert rec.is_ok.all()  # nothing lost in a switch
    _, static = _run("prefill=1,decode=3", workload, None)
    assert _good(rec, 2.0) > 2 * _good(static, 2.0)


def test_long_outputs_move_prefill_instances_to_decode():
    # Short prompts, long outputs, many at once: a decode step of 64 sequences takes 0.14 s
    # (2 ms each + 10 ms), above the 50 ms TPOT target, while prefill idles.
    workload = _workload(300, 6.0, 32, 200, seed=1)
    sim, rec = _run("prefill=3,decode=1", workload)
    summary = sim.summary()["role_switching"]
    assert [(s["from_role"], s["to_role"]) for s in summary["switches"]][:1] == [("prefill", "decode")]
    assert [inst.role for inst in sim.instances].count("decode") >= 2
    assert rec.is_ok.all()


def test_role_switching_is_deterministic_and_off_changes_nothing():
    workload = _workload(120, 1.5, 1000, 8)
    a, rec_a = _run("prefill=1,decode=3", workload)
    b, rec_b = _run("prefill=1,decode=3", workload)
    assert a.summary()["role_switching"] == b.summary()["role_switching"]
    np.testing.assert_array_equal(rec_a.ttft, rec_b.ttft)
    off, _ = _run("prefill=1,decode=3", workload, None)
    assert "role_switching" not in off.summary()
    assert [inst.role for inst in off.instances] == ["prefill", "decode", "decode", "decode"]


@pytest.mark.parametrize("topology", ["colocated=2", "prefill=1,decode=1"])
def test_nothing_to_switch(topology):
    """A colocated topology has no sides, and one worker per side has no donor."""
    roles = parse_topology(topology).roles
    sim, _ = _run(topology, _workload(60, 1.5, 1000, 8))
    assert sim.summary().get("role_switching", {"num_switches": 0})["num_switches"] == 0
    assert tuple(dict.fromkeys(inst.role for inst in sim.instances)) == roles


def test_a_draining_decode_instance_hands_its_requests_over():
    """Long answers occupy the three decode instances, then long prompts pile up on the one
    prefill instance: a decode instance switches within a few steps, not after its answers end
    (they move, KV and all, to the other decode instances), and every answer is whole."""
    long_answers = _workload(30, 10.0, 32, 400)
    long_prompts = _workload(60, 2.0, 1000, 4, seed=2)
    workload = SimWorkload("shift", np.concatenate([long_answers.arrival_s, 3.0 + long_prompts.arrival_s]),
                           np.concatenate([long_answers.input_lens, long_prompts.input_lens]),
                           np.concatenate([long_answers.output_lens, long_prompts.output_lens]), None)
    control = RoleControlConfig(ttft_slo_s=2.0, tpot_slo_s=2.0, min_dwell_s=0.0, cooldown_s=2.0)
    sim, rec = _run("prefill=1,decode=3", workload, control)
    first = sim.summary()["role_switching"]["switches"][0]
    assert (first["from_role"], first["to_role"]) == ("decode", "prefill")
    # It waited only for a prompt being prefilled for it (its reservation cannot move then),
    # not for the answers it ran: they moved and finished after it switched.
    answers_end = workload.arrival_s[:30] + rec.latency[:30]
    assert first["ended_s"] < answers_end.min()
    assert rec.is_ok[:30].all()  # (later prompts may find the one decode instance left full: a 503)
    np.testing.assert_array_equal(rec.output_len[:30], workload.output_lens[:30])
