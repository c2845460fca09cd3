"""The decode worker's reservation queue (engine/reservation_queue.py): by scheduling key, then arrival,
each wait bounded; the decode worker and the simulator both use it."""

from __future__ import annotations

import msgspec
import pytest

from epdserve.cluster import messages as m
from epdserve.engine.reservation_queue import ReservationQueue
from epdserve.service import MAX_SCHEDULE_KEY, MIN_SCHEDULE_KEY, schedule_key


class Room:
    """A pool of ``free`` units; a request takes ``need`` of them."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.taken: list[str] = []

    def take(self, request_id: str, need: int) -> bool:
        if need > self.free:
            return False
        self.free -= need
        self.taken.append(request_id)
        return True


def test_taken_at_once_when_nobody_waits_else_queued_or_refused():
    room, queue = Room(3), ReservationQueue[int]()
    assert queue.offer("a", 2, 10.0, 0.0, room.take) and room.taken == ["a"] and len(queue) == 0
    assert queue.offer("b", 2, 10.0, 0.0, room.take) and "b" in queue  # no room: waits
    assert queue.offer("c", 1, 10.0, 0.0, room.take) and "c" in queue  # room, but b came first
    assert room.taken == ["a"] and queue.request_ids() == {"b", "c"}
    assert not ReservationQueue[int]().offer("d", 5, 0.0, 0.0, room.take)  # no wait allowed: refused


def test_served_in_arrival_order_and_expired_ones_returned():
    room, queue = Room(0), ReservationQueue[int]()
    for request_id, need, wait in [("a", 2, 5.0), ("b", 1, 1.0), ("c", 1, 5.0)]:
        queue.offer(request_id, need, wait, 0.0, room.take)
    room.free = 1  # not enough for the head: nobody behind it jumps ahead
    assert queue.serve(0.5, room.take) == [] and room.taken == [] and len(queue) == 3
    room.free = 3
    assert queue.serve(0.6, room.take) == [] and room.taken == ["a", "b"] and queue.request_ids() == {"c"}
    queue.remove("c")
    assert len(queue) == 0


def test_a_head_whose_wait_ran_out_lets_the_next_try():
    room, queue = Room(0), ReservationQueue[int]()
    queue.offer("big", 4, 1.0, 0.0, room.take)
    queue.offer("small", 1, 5.0, 0.0, room.take)
    room.free = 1
    assert queue.serve(0.9, room.take) == [] and len(queue) == 2
    assert queue.serve(1.0, room.take) == [("big", 4)] and room.taken == ["small"] and len(queue) == 0


def test_lower_keys_are_served_first_then_arrival():
    """A realtime reservation (lower scheduling key) is offered the room before the interactive
    ones that came earlier; one of equal key waits its turn."""
    realtime, interactive, batch = (schedule_key(c) for c in ("realtime", "interactive", "batch"))
    room, queue = Room(0), ReservationQueue[int]()
    queue.offer("i1", 1, 10.0, 0.0, room.take, interactive)
    queue.offer("b1", 1, 10.0, 0.0, room.take, batch)
    queue.offer("i2", 1, 10.0, 0.0, room.take, interactive)
    room.free = 1
    # room for one: a realtime arrival is ahead of everyone waiting, so it is tried at once
    assert queue.offer("r1", 1, 10.0, 0.0, room.take, realtime) and room.taken == ["r1"] and "r1" not in queue
    room.free = 1
    # an interactive arrival with room free still queues behind the interactive ones waiting
    assert queue.offer("i3", 1, 10.0, 0.0, room.take, interactive) and "i3" in queue and room.free == 1
    queue.offer("r2", 5, 10.0, 0.0, room.take, realtime)  # too big for now: queued at the front
    room.free = 4
    assert queue.serve(1.0, room.take) == [] and room.taken == ["r1"]  # r2 holds back the rest
    room.free = 9
    queue.serve(1.0, room.take)
    assert room.taken == ["r1", "r2", "i1", "i2", "i3", "b1"] and len(queue) == 0


def test_a_reserve_frame_carries_a_checked_scheduling_key():
    frame = m.encode(m.Reserve("r", 10, [], False, 5.0, schedule_key("realtime", -7)))
    assert m.decode(frame).priority == schedule_key("realtime", -7)
    for bad in (MAX_SCHEDULE_KEY + 1, MIN_SCHEDULE_KEY - 1):
        with pytest.raises(msgspec.ValidationError):
            m.decode(m.encode(m.Reserve("r", 10, priority=bad)))
