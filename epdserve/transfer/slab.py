"""Embedding slabs: where encode workers write image embeddings for a prefill worker.

A consumer (prefill or colocated worker) registers one slab at start-up: ``num_rows`` rows of
``hidden_size`` elements, one row per image token. On one host the slab is a POSIX
shared-memory segment (mode 0600) that encode workers map once; only ``(slab, row offset,
rows)`` travels per image. The router owns the allocation (``SlabAllocator``): it places each
image of an admitted request and frees the rows when the consumer is done with the request
and no encoder will write them any more. A full slab is back-pressure at admission, never an
allocation failure in a worker.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from epdserve.transfer.descriptors import SlabEndpoint
from epdserve.transfer.locality import this_node
from epdserve.transfer.segments import create_segment


@dataclass(frozen=True)
class SlabRegion:
    offset: int  # first row
    num_rows: int


class SlabAllocator:
    """First-fit allocation of contiguous row ranges, with coalescing frees (plain Python)."""

    def __init__(self, num_rows: int) -> None:
        if num_rows <= 0:
            raise ValueError(f"a slab needs at least one row, got {num_rows}")
        self.num_rows = num_rows
        # Free extents, sorted by offset, never adjacent (coalesced): parallel lists.
        self._starts: list[int] = [0]
        self._lengths: list[int] = [num_rows]
        self.num_free_rows = num_rows

    def can_allocate(self, row_counts: list[int]) -> bool:
        """Whether every count in ``row_counts`` fits at once (checked on a copy)."""
        trial = SlabAllocator.__new__(SlabAllocator)
        trial.num_rows, trial.num_free_rows = self.num_rows, self.num_free_rows
        trial._starts, trial._lengths = list(self._starts), list(self._lengths)
        return all(trial.allocate(n) is not None for n in row_counts)

    def allocate(self, num_rows: int) -> SlabRegion | None:
        if num_rows <= 0:
            raise ValueError(f"cannot allocate {num_rows} rows")
        for i, length in enumerate(self._lengths):
            if length >= num_rows:
                start = self._starts[i]
                if length == num_rows:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += num_rows
                    self._lengths[i] -= num_rows
                self.num_free_rows -= num_rows
                return SlabRegion(start, num_rows)
        return None

    def free(self, region: SlabRegion) -> None:
        start, end = region.offset, region.offset + region.num_rows
        i = bisect.bisect_left(self._starts, start)
        if (i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start) or (
            i < len(self._starts) and self._starts[i] < end
        ):
            raise ValueError(f"rows {start}..{end} are already free")
        self.num_free_rows += region.num_rows
        if i < len(self._starts) and self._starts[i] == end:  # merge with the next extent
            end += self._lengths[i]
            del self._starts[i], self._lengths[i]
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:  # and the previous
            self._lengths[i - 1] = end - self._starts[i - 1]
            return
        self._starts.insert(i, start)
        self._lengths.insert(i, end - start)

    @property
    def is_all_free(self) -> bool:
        return self.num_free_rows == self.num_rows


class EmbeddingSlab:
    """A consumer's slab in shared memory: ``rows`` is a [num_rows, hidden_size] tensor."""

    def __init__(self, segment: shared_memory.SharedMemory, owner: bool, num_rows: int, hidden_size: int,
                 dtype: torch.dtype) -> None:
        self.segment = segment
        self.owner = owner
        self.num_rows = num_rows
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.rows: torch.Tensor = torch.frombuffer(segment.buf, dtype=dtype)[: num_rows * hidden_size].view(
            num_rows, hidden_size
        )

    @classmethod
    def create(cls, num_rows: int, hidden_size: int, dtype: torch.dtype,
               name_prefix: str = "epdserve-emb") -> EmbeddingSlab:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        segment = create_segment(name_prefix, num_rows * hidden_size * itemsize)
        return cls(segment, True, num_rows, hidden_size, dtype)

    @classmethod
    def attach(cls, endpoint: SlabEndpoint) -> EmbeddingSlab:
        segment = shared_memory.SharedMemory(name=endpoint.shm_name, create=False)
        if f"-{os.getpid()}-" not in endpoint.shm_name:  # created by another process
            # Its owner unlinks it, not this process's resource tracker at exit.
            resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
        return cls(segment, False, endpoint.num_rows, endpoint.hidden_size, getattr(torch, endpoint.dtype))

    @property
    def name(self) -> str:
        return self.segment.name

    def endpoint(self) -> SlabEndpoint:
        return SlabEndpoint(
            transport="shm", shm_name=self.name, num_rows=self.num_rows, hidden_size=self.hidden_size,
            dtype=str(self.dtype).removeprefix("torch."), node=this_node(),
        )

    def region(self, offset: int, num_rows: int) -> torch.Tensor:
        if offset < 0 or num_rows < 0 or offset + num_rows > self.num_rows:
            raise ValueError(f"rows {offset}..{offset + num_rows} are outside the slab of {self.num_rows}")
        return self.rows[offset : offset + num_rows]

    def close(self) -> None:
        self.rows = None  # type: ignore[assignment]
        try:
            self.segment.close()
        except BufferError:
            pass  # a view still exports the buffer; the mapping goes with the process
        if self.owner:
            try:
                self.segment.unlink()
            except FileNotFoundError:
                pass
