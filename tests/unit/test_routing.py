"""The router's routing policy (``WorkerRegistry.pick``), on its own and through the simulator,
which routes with the same registry."""

from __future__ import annotations

import pytest
from test_sim import fixed_workload, profile_dict, run

from epdserve.cluster import messages as m
from epdserve.router.workers import WorkerInfo, WorkerRegistry


def worker(worker_id: str, free_blocks: int = 100) -> WorkerInfo:
    info = WorkerInfo(m.Register(worker_id, "colocated", 0, "localhost", "m", 1024, 128, 16))
    info.load = m.Load(0, 0, free_blocks, 0)
    return info


def test_pick_prefers_the_worker_with_less_prefill_ahead():
    registry = WorkerRegistry()
    a, b = worker("a"), worker("b")
    registry.add(a)
    registry.add(b)
    a.take("long", num_prompt_tokens=1000)  # a is prefilling one long prompt
    b.take("d1", 50)
    b.take("d2", 50)
    b.prefilled("d1")
    b.prefilled("d2")  # b only decodes, two requests in hand
    assert (a.num_prefill_tokens, b.num_prefill_tokens) == (1000, 0)
    assert registry.pick("colocated") is b  # by requests in hand alone it would be a
    a.prefilled("long")
    assert registry.pick("colocated") is a  # no prefill ahead anywhere: fewer requests
    a.take("x", 10)
    b.take("y", 10)
    a.drop("x")  # an aborted request leaves no prefill behind
    assert a.num_prefill_tokens == 0 and "x" not in a.request_ids
    a.prefilled("unknown")  # outputs for requests the worker no longer holds are ignored
    assert a.num_prefill_tokens == 0


def test_pick_ties_go_to_more_free_blocks():
    registry = WorkerRegistry()
    a, b = worker("a", free_blocks=10), worker("b", free_blocks=20)
    registry.add(a)
    registry.add(b)
    assert registry.pick("colocated") is b


@pytest.mark.parametrize("routing", ["least-prefill", "least-requests"])
def test_pick_is_the_first_worker_of_the_smallest_key(routing):
    """Over many random registries (other roles and workers not ready among them, many ties),
    the pick is what min() gives over the ready workers of the role, keyed (prefill tokens
    ahead, requests in hand, -free blocks), the first of equals."""
    import random

    from epdserve.router.workers import WorkerState

    rng = random.Random(7)
    for _ in range(500):
        registry = WorkerRegistry(routing)
        for i in range(rng.randint(0, 8)):
            w = worker(f"w{i}", free_blocks=rng.choice([10, 20, 30]))
            if rng.random() < 0.2:
                w.role = "decode"
            if rng.random() < 0.2:
                w.state = WorkerState.DRAINING
            for k in range(rng.randint(0, 3)):
                w.take(f"r{i}_{k}", rng.choice([0, 100]))
            registry.add(w)
        ready = [w for w in registry.workers.values()
                 if w.role == "colocated" and w.state is WorkerState.READY]
        by_prefill = routing == "least-prefill"
        expected = min(ready, key=lambda w: (w.num_prefill_tokens if by_prefill else 0, len(w.request_ids),
                                             -w.load.num_free_blocks), default=None)
        assert registry.pick_least_loaded("colocated") is expected


def test_simulated_request_goes_around_a_prefill():
    """colocated=2 (synthetic costs: a step is 10 ms + 1 ms per prefill token + 2 ms per decode
    sequence). r0 (500 tokens) is prefilled by 0.51 s and decodes on one instance; r1 (300
    tokens) arrives at 0.6 s and starts a 0.31 s prefill on the other. At 0.65 s each instance
    holds one request and the prefilling one has more free KV blocks, so by requests in hand
    and free blocks r2 would queue behind r1's prefill; it goes to the instance that is only
    decoding and joins its next step."""
    _, rec = run(profile_dict(), "colocated=2", fixed_workload([0.0, 0.6, 0.65], [500, 300, 10], [200, 20, 2]))
    assert rec.ttft[0] == pytest.approx(0.01 + 0.5)
    assert rec.ttft[1] == pytest.approx(0.01 + 0.3)
    # r0 decodes alone in 12 ms steps from 0.51 s; the 12th ends at 0.654 s, after r2's
    # arrival, and the next step (10 ms + 10 tokens + one decode sequence) gives r2 its token.
    assert rec.ttft[2] == pytest.approx(0.51 + 12 * 0.012 + 0.01 + 0.01 + 0.002 - 0.65)


def test_least_requests_policy_and_bad_policy():
    registry = WorkerRegistry("least-requests")
    a, b = worker("a"), worker("b")
    registry.add(a)
    registry.add(b)
    a.take("long", num_prompt_tokens=1000)
    b.take("d1", 50)
    b.take("d2", 50)
    assert registry.pick("colocated") is a  # requests in hand only
    with pytest.raises(ValueError, match="routing must be one of"):
        WorkerRegistry("random")


def test_simulated_least_requests_queues_behind_the_prefill():
    """The run of test_simulated_request_goes_around_a_prefill with ``least-requests``: r2 goes
    to the instance with more free blocks, the one prefilling r1 (0.6 .. 0.91 s), and its
    prefill follows: a step of 10 ms + 10 tokens + r1's first decode."""
    _, rec = run(profile_dict(), "colocated=2", fixed_workload([0.0, 0.6, 0.65], [500, 300, 10], [200, 20, 2]),
                 routing="least-requests")
    assert rec.ttft[2] == pytest.approx(0.91 + 0.01 + 0.01 + 0.002 - 0.65)
