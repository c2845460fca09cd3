"""The role controller's rule (router/role_control.py) and the switch checks
(router/role_switch.py ``check_switch``), on registries of plain ``WorkerInfo``."""

from __future__ import annotations

import pytest

from epdserve.cluster import messages as m
from epdserve.errors import ConfigError
from epdserve.router.role_control import KV_FULL, LatencyWindow, RoleControlConfig, RoleController
from epdserve.router.role_switch import SwitchRefused, check_switch
from epdserve.router.workers import WorkerInfo, WorkerRegistry, WorkerState

PER_TOKEN_S = 1e-3  # the workers' measured prefill seconds per prompt token


def _worker(worker_id: str, role: str, since: float = -1e9) -> WorkerInfo:
    info = WorkerInfo(m.Register(worker_id, role, pid=0, host="h", model_name="m", max_model_len=4096,
                                 num_kv_blocks=100, block_size=16))
    info.load = m.Load(0, 0, num_free_blocks=100, num_used_blocks=0, prefill_s_per_token=PER_TOKEN_S)
    info.role_since = since
    return info


def _cluster(num_prefill: int, num_decode: int) -> list[WorkerInfo]:
    return ([_worker(f"p{i}", "prefill") for i in range(num_prefill)]
            + [_worker(f"d{i}", "decode") for i in range(num_decode)])


def _queue_prefill(workers: list[WorkerInfo], seconds: float) -> None:
    """Prompt work of ``seconds`` queued on every prefill worker."""
    for w in workers:
        if w.role == "prefill":
            w.take(f"r-{w.worker_id}", int(seconds / PER_TOKEN_S))


def _use_kv(workers: list[WorkerInfo], share: float) -> None:
    for w in workers:
        if w.role == "decode":
            w.load = m.Load(0, 0, num_free_blocks=round(100 * (1 - share)), num_used_blocks=round(100 * share))


CONFIG = RoleControlConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, min_dwell_s=0, cooldown_s=5, num_confirm=3)


def _decide_n(controller: RoleController, workers: list[WorkerInfo], start: float, n: int):
    decisions = [controller.decide(start + i, workers) for i in range(n)]
    return [s for d in decisions for s in d], decisions


def test_prefill_pressure_moves_the_least_busy_decode_worker_after_confirmation():
    workers = _cluster(1, 3)
    _queue_prefill(workers, 2.0)  # pressure 2.0
    workers[2].take("busy")  # d1 holds a request: d0 or d2 drain sooner
    controller = RoleController(CONFIG)
    switches, decisions = _decide_n(controller, workers, 0.0, 3)
    assert decisions[:2] == [[], []]  # two agreeing decisions are not enough
    # One prefill worker at 2.0: with 1 + k the queued work projects to 2.0 / (1 + k) <= 0.9 at k = 2.
    assert [s.worker_id for s in switches] == ["d0", "d2"]
    switch = switches[0]
    assert (switch.from_role, switch.to_role) == ("decode", "prefill")
    assert switch.pressure.prefill == pytest.approx(2.0) and switch.pressure.queued_prefill_s == pytest.approx(2.0)


def test_decode_pressure_moves_a_prefill_worker():
    workers = _cluster(3, 1)
    controller = RoleController(CONFIG)
    for t in range(20):
        controller.observe_itl(0.0, 0.15)  # ITL P90 150 ms against 100: pressure 1.5
    switches, _ = _decide_n(controller, workers, 0.0, 3)
    # Every gap alike: the projection cannot tell fixed cost from load, so one worker moves.
    assert [(s.from_role, s.to_role) for s in switches] == [("prefill", "decode")]
    assert switches[0].pressure.itl_p90_s == pytest.approx(0.15)


def test_no_switch_when_the_donor_would_lose_its_slack():
    workers = _cluster(1, 2)
    _queue_prefill(workers, 1.5)
    # Decode at 40 % of its KV bound: after losing one of two workers it would be at 80 %, above
    # the band's low edge (0.7), and prefill (1.5) is not twice as far past its SLO: no switch.
    _use_kv(workers, 0.4 * KV_FULL)
    controller = RoleController(CONFIG)
    assert _decide_n(controller, workers, 0.0, 10)[0] == []
    # At 30 % it would be at 60 %: it moves.
    _use_kv(workers, 0.3 * KV_FULL)
    assert len(_decide_n(controller, workers, 10.0, 3)[0]) == 1


def test_no_switch_when_both_sides_are_hot_or_either_has_one_worker():
    workers = _cluster(2, 2)
    _queue_prefill(workers, 2.0)
    _use_kv(workers, KV_FULL)  # both sides at or past their SLO: nothing to give
    assert _decide_n(RoleController(CONFIG), workers, 0.0, 10)[0] == []
    workers = _cluster(2, 1)
    _queue_prefill(workers, 2.0)  # prefill needs one, but decode has only one worker
    assert _decide_n(RoleController(CONFIG), workers, 0.0, 10)[0] == []


def test_dwell_cooldown_and_one_switch_at_a_time():
    workers = _cluster(2, 3)
    _queue_prefill(workers, 1.0)  # 1.0 x 2 / (2 + 1) <= 0.9: one worker
    config = RoleControlConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, min_dwell_s=30, cooldown_s=10, num_confirm=1)
    for w in workers:
        w.role_since = 0.0
    controller = RoleController(config)
    assert controller.decide(29.0, workers) == []  # nobody has held its role 30 s yet
    [first] = controller.decide(30.0, workers)
    workers_by_id = {w.worker_id: w for w in workers}
    workers_by_id[first.worker_id].state = WorkerState.DRAINING
    assert controller.decide(31.0, workers) == []  # one round at a time
    # The switch ends at 40 s: a new prefill worker (its registration) ...
    switched = _worker(first.worker_id, "prefill", since=40.0)
    workers = [switched if w.worker_id == first.worker_id else w for w in workers]
    controller.on_switched(40.0)
    _queue_prefill(workers, 2.0)  # and the prefill side is short again
    assert controller.decide(45.0, workers) == []  # ... then the cooldown
    assert controller.decide(50.0, workers) != []


def test_an_oscillating_load_does_not_make_it_flap():
    """Prefill pressure that swings above ``high`` and back every decision never holds for
    ``num_confirm`` decisions in a row: no switch."""
    workers = _cluster(2, 2)
    controller = RoleController(CONFIG)
    for t in range(60):
        for w in workers:
            w.request_ids.clear()
            w.prefill_tokens.clear()
            w.num_prefill_tokens = 0
        if t % 2 == 0:
            _queue_prefill(workers, 2.0)
        assert controller.decide(float(t), workers) == []


def test_latency_window_forgets_old_samples_and_weights():
    window = LatencyWindow(window_s=10.0)
    for i in range(10):
        window.add(float(i), 0.01 * (i + 1))
    assert window.percentile(9.0, 0.9, 1) == pytest.approx(0.09)
    assert window.percentile(15.0, 0.5, 1) == pytest.approx(0.08)  # samples before 5 s are gone
    assert window.percentile(15.0, 0.5, 8) is None  # too few left
    weighted = LatencyWindow(10.0)
    weighted.add(0.0, 0.02, weight=9)
    weighted.add(0.0, 0.5, weight=1)
    assert weighted.percentile(0.0, 0.5, 1) == 0.02 and weighted.percentile(0.0, 0.95, 1) == 0.5


@pytest.mark.parametrize("fields", [{"ttft_slo_s": 0}, {"low": 0.9, "high": 0.8}, {"num_confirm": 0},
                                    {"min_dwell_s": -1}, {"interval_s": float("inf")}])
def test_bad_controller_settings(fields):
    with pytest.raises(ConfigError):
        RoleControlConfig(**{"ttft_slo_s": 1.0, "tpot_slo_s": 0.1, **fields})


def test_check_switch_refusals():
    registry = WorkerRegistry()
    for w in _cluster(2, 1) + [_worker("e0", "encode")]:
        registry.add(w)
    assert check_switch(registry, "p0", "decode").worker_id == "p0"
    for worker_id, role, reason in (("p0", "encode", "role must be"), ("x", "decode", "no worker"),
                                    ("e0", "decode", "encode worker"), ("p0", "prefill", "already"),
                                    ("d0", "prefill", "last ready decode")):
        with pytest.raises(SwitchRefused, match=reason):
            check_switch(registry, worker_id, role)
    registry.get("p1").state = WorkerState.DRAINING
    with pytest.raises(SwitchRefused, match="draining, not ready"):
        check_switch(registry, "p1", "decode")
    with pytest.raises(SwitchRefused, match="last ready prefill"):
        check_switch(registry, "p0", "decode")


def test_the_projection_grows_only_the_load_driven_part_of_a_latency():
    """Decode steps cost 70 ms with little load and 110 ms now (P90): with one of two decode
    workers gone the projection is 70 + 40 x 2 = 150 ms, not 220; against a 250 ms TPOT target
    that is 0.6, inside the band, so a prefill-starved cluster gets the worker."""
    from epdserve.router.role_control import decode_pressure_with

    config = RoleControlConfig(ttft_slo_s=1.0, tpot_slo_s=0.25, min_dwell_s=0, cooldown_s=0, num_confirm=1)
    workers = _cluster(1, 2)
    _queue_prefill(workers, 2.0)
    controller = RoleController(config)
    for i in range(50):
        controller.observe_itl(0.0, 0.07 if i < 25 else 0.11)
    p = controller.pressure(0.0, workers)
    assert p.itl_base_s == pytest.approx(0.07) and p.itl_p90_s == pytest.approx(0.11)
    assert decode_pressure_with(p, config, 1) == pytest.approx(0.15 / 0.25)
    assert decode_pressure_with(p, config, 2) == pytest.approx(p.decode)
    [switch] = controller.decide(0.0, workers)
    assert switch.to_role == "prefill"


def test_a_large_cluster_moves_several_workers_at_once():
    """Prefill at twice its target on 10 workers, decode idle on 10: moving workers until the
    projection reaches ``high`` takes several in one round, none past the donor's slack."""
    workers = _cluster(10, 10)
    _queue_prefill(workers, 2.0)
    controller = RoleController(CONFIG)
    switches, _ = _decide_n(controller, workers, 0.0, 3)
    # queued work 2.0 s per worker x 10 / (10 + k) <= 0.9 s: k = 13 > 9 spare decode workers
    assert len(switches) == 9 and {s.to_role for s in switches} == {"prefill"}
    assert len({s.worker_id for s in switches}) == 9
    workers = _cluster(10, 10)
    _queue_prefill(workers, 1.0)  # 1.0 x 10 / (10 + k) <= 0.9: k = 2
    assert len(_decide_n(RoleController(CONFIG), workers, 0.0, 3)[0]) == 2


def test_the_side_furthest_past_its_slo_gets_a_worker():
    """Both sides past their SLOs: prefill at 5.0 is more than three times decode's 1.6 with one
    worker fewer, so decode gives one up (one only: then prefill is no longer that far ahead)."""
    workers = _cluster(2, 2)
    _queue_prefill(workers, 5.0)
    _use_kv(workers, 0.8 * KV_FULL)  # with one of two decode workers: 1.6
    switches, _ = _decide_n(RoleController(CONFIG), workers, 0.0, 3)
    assert [(s.from_role, s.to_role) for s in switches] == [("decode", "prefill")]
    workers = _cluster(2, 2)
    _queue_prefill(workers, 4.0)  # 4.0 < 3 x 1.6: it waits
    _use_kv(workers, 0.8 * KV_FULL)
    assert _decide_n(RoleController(CONFIG), workers, 0.0, 10)[0] == []


def test_ttft_correction_follows_measured_over_predicted():
    from epdserve.router.workers import TTFTCorrection

    c = TTFTCorrection()
    assert c.factor == 1.0
    for _ in range(60):
        c.observe(1.0, 1.5)
    assert c.factor == pytest.approx(1.5, rel=0.01)
    c.observe(0.01, 100.0)  # too short a prediction to learn from
    c.observe(1.0, 0.0)
    assert c.num_observed == 60
    for _ in range(200):
        c.observe(1.0, 50.0)  # clamped
    assert c.factor == pytest.approx(TTFTCorrection.MAX, rel=0.01)


def test_the_priority_rule_does_not_undo_the_last_round_at_once():
    """Prefill took a decode worker by priority; then decode is the one far past its SLO (the
    answers handed over to the decode worker left): within ``priority_hold_s`` it does not
    take the worker back by priority, after it may."""
    config = RoleControlConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, min_dwell_s=0, cooldown_s=0, num_confirm=1,
                               priority_hold_s=30.0)
    controller = RoleController(config)
    workers = _cluster(2, 2)
    _queue_prefill(workers, 5.0)
    _use_kv(workers, 0.8 * KV_FULL)
    [switch] = controller.decide(0.0, workers)
    assert switch.to_role == "prefill"
    workers = _cluster(3, 1)  # after the switch: decode three times past its SLO, prefill under it
    _queue_prefill(workers, 0.6)  # with one worker fewer: 0.9, past its band but < 3.0 / 3
    for t in (10.0, 31.0):
        for _ in range(10):
            controller.observe_itl(t, 0.3)
    assert controller.decide(10.0, workers) == []
    assert [s.to_role for s in controller.decide(31.0, workers)] == ["decode"]
