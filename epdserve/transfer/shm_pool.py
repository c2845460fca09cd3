"""A KV pool in POSIX shared memory, so another process can write into its pages.

One segment holds every layer: layer l occupies ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` elements starting at ``offsets[l]``. The owner creates it (mode 0600) and unlinks
it on close; a peer attaches once at start-up and keeps the mapping.
"""

from __future__ import annotations

import math
from multiprocessing import shared_memory

import torch

from epdserve.transfer.descriptors import KVEndpoint
from epdserve.transfer.locality import this_node
from epdserve.transfer.segments import attach_segment, create_segment


def _layer_numels(num_blocks: int, block_size: int, layer_shapes: list[tuple[int, int]]) -> list[int]:
    return [2 * num_blocks * block_size * heads * dim for heads, dim in layer_shapes]


class SharedKVPool:
    def __init__(
        self,
        segment: shared_memory.SharedMemory,
        owner: bool,
        num_blocks: int,
        block_size: int,
        layer_shapes: list[tuple[int, int]],
        dtype: torch.dtype,
    ) -> None:
        self.segment = segment
        self.owner = owner
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layer_shapes = layer_shapes
        self.dtype = dtype
        flat = torch.frombuffer(segment.buf, dtype=dtype)
        self.layers: list[torch.Tensor] = []
        offset = 0
        for (heads, dim), numel in zip(layer_shapes, _layer_numels(num_blocks, block_size, layer_shapes)):
            view = flat[offset : offset + numel].view(2, num_blocks, block_size, heads, dim)
            self.layers.append(view)
            offset += numel
        self._flat = flat

    @classmethod
    def create(
        cls,
        num_blocks: int,
        block_size: int,
        layer_shapes: list[tuple[int, int]],
        dtype: torch.dtype,
        name_prefix: str = "epdserve-kv",
    ) -> SharedKVPool:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        size = sum(_layer_numels(num_blocks, block_size, layer_shapes)) * itemsize
        pool = cls(create_segment(name_prefix, size), True, num_blocks, block_size, layer_shapes, dtype)
        pool._flat.zero_()
        return pool

    @classmethod
    def attach(cls, endpoint: KVEndpoint, name: str | None = None) -> SharedKVPool:
        """Map the pool ``name`` (default: the endpoint's own, rank 0's) laid out as the endpoint
        says (every tensor-parallel rank's pool has the same layout)."""
        shapes = [tuple(s) for s in endpoint.layer_shapes]
        return cls.attach_named(name or endpoint.shm_name, endpoint.num_blocks, endpoint.block_size, shapes,
                                getattr(torch, endpoint.dtype))

    @classmethod
    def attach_named(cls, name: str, num_blocks: int, block_size: int, layer_shapes: list[tuple[int, int]],
                     dtype: torch.dtype) -> SharedKVPool:
        """Map another process's pool ``name``; ValueError when it is smaller than the layout."""
        expected = sum(_layer_numels(num_blocks, block_size, layer_shapes))
        segment = attach_segment(name, expected * torch.tensor([], dtype=dtype).element_size())
        return cls(segment, False, num_blocks, block_size, layer_shapes, dtype)

    @property
    def name(self) -> str:
        return self.segment.name

    def endpoint(self) -> KVEndpoint:
        return KVEndpoint(
            transport="shm",
            shm_name=self.name,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
            layer_shapes=[tuple(s) for s in self.layer_shapes],
            node=this_node(),
        )

    def close(self) -> None:
        self.layers = []
        self._close_segment()

    def _close_segment(self) -> None:
        self._flat = None  # type: ignore[assignment]
        try:
            self.segment.close()
        except BufferError:
            pass  # a tensor view still exports the buffer; the mapping goes with the process
        if self.owner:
            try:
                self.segment.unlink()
            except FileNotFoundError:
                pass


class SharedStatePool:
    """Recurrent state in POSIX shared memory (a decode worker's, so that a prefill worker can
    write a request's state into its slot): layer l is ``[num_slots, *shapes[l]]``, empty for
    a layer without state. Created and unlinked by the owner, attached once by a peer."""

    def __init__(self, segment: shared_memory.SharedMemory, owner: bool, num_slots: int,
                 shapes: list[tuple[int, ...]], dtype: torch.dtype) -> None:
        self.segment = segment
        self.owner = owner
        self.num_slots = num_slots
        self.shapes = shapes
        flat = torch.frombuffer(segment.buf, dtype=dtype)
        self.layers: list[torch.Tensor] = []
        offset = 0
        for shape in shapes:
            numel = num_slots * math.prod(shape) if shape else 0
            self.layers.append(flat[offset : offset + numel].view(num_slots, *shape) if shape else flat[:0])
            offset += numel
        self._flat = flat

    @staticmethod
    def _size(num_slots: int, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
        numel = sum(num_slots * math.prod(s) for s in shapes if s)
        return max(1, numel) * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def create(cls, num_slots: int, shapes: list[tuple[int, ...]], dtype: torch.dtype,
               name_prefix: str = "epdserve-state") -> SharedStatePool:
        pool = cls(create_segment(name_prefix, cls._size(num_slots, shapes, dtype)), True, num_slots, shapes, dtype)
        pool._flat.zero_()
        return pool

    @classmethod
    def attach(cls, endpoint: KVEndpoint) -> SharedStatePool:
        """The state pool an endpoint names; ValueError when it is smaller than it says."""
        dtype = getattr(torch, endpoint.dtype)
        shapes = [tuple(s) for s in endpoint.state_shapes]
        segment = attach_segment(endpoint.state_shm_name, cls._size(endpoint.num_state_slots, shapes, dtype))
        return cls(segment, False, endpoint.num_state_slots, shapes, dtype)

    @property
    def name(self) -> str:
        return self.segment.name

    def close(self) -> None:
        self.layers = []
        SharedKVPool._close_segment(self)  # type: ignore[arg-type]
