"""Which reservation may write each of a decode worker's KV blocks (the write fence).

A decode worker reserves blocks for a prompt whose KV a prefill worker writes. Each
reservation gets a generation number, unique for the fence's lifetime, and every write for it
carries that number. While the reservation is open, ``owner[group, block]`` holds its
generation; when it ends (KV landed and decode started, aborted, expired), the entries go back
to 0 *before* the blocks return to the pool. A write is admitted only when every block it
touches still holds its generation, so a late write of an expired or aborted reservation never
lands in pages that another request now owns::

    reserve -> owner[blocks] = g -> writes carrying g land -> close: owner[blocks] = 0 -> free
                                     a write carrying g after close: refused, nothing written

Over TCP the decode worker's receiver thread checks and writes under ``lock``, and the engine
thread closes under the same lock, so check and write are one step. Over shared memory the
prefill worker writes the pages itself; the owner array then lives in a shared segment next
to the pool, and the writer checks it right before each layer's copy. What that leaves open
is a writer stopped between its check and its copy (one layer, microseconds) while the
reservation is closed and its blocks handed to another request.
"""

from __future__ import annotations

import secrets
import threading
from multiprocessing import shared_memory

import numpy as np

from epdserve.transfer.segments import attach_segment, create_segment


class ReservationFence:
    """Owner side (decode worker). ``shm=True`` puts the owner array in shared memory, named by
    ``shm_name``, for writers in other processes (``FenceView``)."""

    def __init__(self, num_groups: int, num_blocks: int, shm: bool = False) -> None:
        self.num_groups = num_groups
        self.num_blocks = num_blocks
        self._segment: shared_memory.SharedMemory | None = None
        size = num_groups * num_blocks * 8
        if shm:
            self._segment = create_segment("epdserve-fence", size)
            self.owner = np.ndarray((num_groups, num_blocks), dtype=np.int64, buffer=self._segment.buf)
            self.owner[:] = 0
        else:
            self.owner = np.zeros((num_groups, num_blocks), dtype=np.int64)
        self.lock = threading.Lock()
        # A random start: a generation of an earlier process never matches one of this fence.
        self._next_generation = secrets.randbits(48) + 1
        self._open: dict[int, list[list[int]]] = {}  # generation -> block ids per group
        self._requests: dict[int, str] = {}  # generation -> the request it reserved for

    @property
    def shm_name(self) -> str:
        return self._segment.name if self._segment is not None else ""

    def open(self, block_ids: list[list[int]], request_id: str = "") -> int:
        """Mark ``block_ids`` (per group) as written by a new reservation for ``request_id``;
        its generation."""
        with self.lock:
            generation = self._next_generation
            self._next_generation += 1
            for group, ids in enumerate(block_ids):
                self.owner[group, ids] = generation
            self._open[generation] = block_ids
            self._requests[generation] = request_id
            return generation

    def close(self, generation: int) -> None:
        """The reservation ended: no write carrying ``generation`` is admitted from now on."""
        with self.lock:
            block_ids = self._open.pop(generation, None)
            self._requests.pop(generation, None)
            if block_ids is None:
                return
            for group, ids in enumerate(block_ids):
                owned = self.owner[group, ids]
                # Only entries still holding this generation (a block is in one reservation).
                self.owner[group, np.asarray(ids, dtype=np.int64)[owned == generation]] = 0

    def is_open(self, generation: int) -> bool:
        return generation in self._open

    def reservation(self, generation: int) -> tuple[str, list[list[int]]] | None:
        """(request id, block ids per group) of an open reservation (call under ``lock``)."""
        block_ids = self._open.get(generation)
        return None if block_ids is None else (self._requests[generation], block_ids)

    def admits(self, generation: int, group: int, block_ids: np.ndarray) -> bool:
        """Whether a write of ``generation`` may touch ``block_ids`` of ``group`` (call under
        ``lock`` together with the write)."""
        return admits(self.owner, generation, group, block_ids)

    def close_all(self) -> None:
        self.owner = np.zeros((0, 0), dtype=np.int64)
        if self._segment is not None:
            try:
                self._segment.close()
            except BufferError:
                pass  # a view still exports the buffer; the mapping goes with the process
            try:
                self._segment.unlink()
            except FileNotFoundError:
                pass
            self._segment = None


def admits(owner: np.ndarray, generation: int, group: int, block_ids: np.ndarray) -> bool:
    if generation <= 0 or not 0 <= group < owner.shape[0] or block_ids.size == 0:
        return False
    if int(block_ids.min()) < 0 or int(block_ids.max()) >= owner.shape[1]:
        return False
    return bool((owner[group, block_ids] == generation).all())


class FenceView:
    """Writer side over shared memory (prefill worker): the decode worker's owner array."""

    def __init__(self, shm_name: str, num_groups: int, num_blocks: int) -> None:
        self._segment = attach_segment(shm_name, num_groups * num_blocks * 8)  # the owner unlinks it
        self.owner = np.ndarray((num_groups, num_blocks), dtype=np.int64, buffer=self._segment.buf)

    def admits(self, generation: int, group: int, block_ids: np.ndarray) -> bool:
        return admits(self.owner, generation, group, block_ids)

    def close(self) -> None:
        self.owner = np.zeros((0, 0), dtype=np.int64)
        try:
            self._segment.close()
        except BufferError:
            pass
