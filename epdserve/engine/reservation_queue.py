"""A full decode worker's reservation queue: in priority order, then first come first served,
each for a bounded wait.

A P/D request reserves its decode blocks (and sequence seat) before its prompt is computed.
When the decode worker has no room, the reservation waits here instead of being refused; the
worker offers the room each step frees to the waiting ones in the order the workers' own
queues use (the request's scheduling key, lower first: its service class, then its priority,
``service.py``; then arrival). The head that does not fit holds back the rest, as a
scheduler's queue does, and a reservation whose wait ran out is refused. The decode worker (cluster/worker_decode.py) and the simulator
(sim/cluster.py) both keep one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class ReservationQueue(Generic[T]):
    def __init__(self) -> None:
        # request id -> (item, deadline, (scheduling key, arrival number))
        self._waiting: dict[str, tuple[T, float, tuple[int, int]]] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def request_ids(self) -> set[str]:
        return set(self._waiting)

    def offer(self, request_id: str, item: T, max_wait_s: float, now: float,
              try_reserve: Callable[[str, T], bool], key: int = 0) -> bool:
        """A new reservation of scheduling key ``key``: taken now by ``try_reserve`` when nobody
        waits before it (no waiting one of a key <= ``key``), else queued until ``now +
        max_wait_s``; False: no room and no wait (``max_wait_s`` 0)."""
        if all(k > key for _, _, (k, _) in self._waiting.values()) and try_reserve(request_id, item):
            return True
        if max_wait_s <= 0:
            return False
        self._waiting[request_id] = (item, now + max_wait_s, (key, next(self._arrivals)))
        return True

    def remove(self, request_id: str) -> None:
        """The request left (aborted, failed) while waiting."""
        self._waiting.pop(request_id, None)

    def serve(self, now: float, try_reserve: Callable[[str, T], bool]) -> list[tuple[str, T]]:
        """Offer the room there is now to the waiting reservations in order (key, arrival);
        returns those whose wait ran out before room came (they leave the queue; refuse them)."""
        expired = []
        for request_id, (item, deadline, _) in sorted(self._waiting.items(), key=lambda kv: kv[1][2]):
            if try_reserve(request_id, item):
                del self._waiting[request_id]
            elif deadline <= now:
                del self._waiting[request_id]
                expired.append((request_id, item))
            else:
                break
        return expired
