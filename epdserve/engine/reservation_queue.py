"""A full decode worker's reservation queue: first come, first served, each for a bounded wait.

A P/D request reserves its decode blocks (and sequence seat) before its prompt is computed.
When the decode worker has no room, the reservation waits here instead of being refused; the
worker offers the room each step frees to the waiting ones in arrival order (the head that does
not fit holds back the rest, as a scheduler's FCFS queue does), and a reservation whose wait
ran out is refused. The decode worker (cluster/worker_decode.py) and the simulator
(sim/cluster.py) both keep one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ReservationQueue(Generic[T]):
    def __init__(self) -> None:
        self._waiting: dict[str, tuple[T, float]] = {}  # request id -> (item, deadline), arrival order

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def request_ids(self) -> set[str]:
        return set(self._waiting)

    def offer(self, request_id: str, item: T, max_wait_s: float, now: float,
              try_reserve: Callable[[str, T], bool]) -> bool:
        """A new reservation: taken now by ``try_reserve`` when nobody waits before it, else
        queued until ``now + max_wait_s``; False: no room and no wait (``max_wait_s`` 0)."""
        if not self._waiting and try_reserve(request_id, item):
            return True
        if max_wait_s <= 0:
            return False
        self._waiting[request_id] = (item, now + max_wait_s)
        return True

    def remove(self, request_id: str) -> None:
        """The request left (aborted, failed) while waiting."""
        self._waiting.pop(request_id, None)

    def serve(self, now: float, try_reserve: Callable[[str, T], bool]) -> list[tuple[str, T]]:
        """Offer the room there is now to the waiting reservations in arrival order; returns
        those whose wait ran out before room came (they leave the queue; refuse them)."""
        expired = []
        for request_id, (item, deadline) in list(self._waiting.items()):
            if try_reserve(request_id, item):
                del self._waiting[request_id]
            elif deadline <= now:
                del self._waiting[request_id]
                expired.append((request_id, item))
            else:
                break
        return expired
