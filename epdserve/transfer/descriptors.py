"""Descriptors of the memory other processes write into: a decode worker's KV pages and a
consumer's embedding slab. Registered with the router at start-up and handed to peers; the
transfer layer opens links from them. msgspec structs (they travel inside control messages)."""

from __future__ import annotations

import msgspec


class KVEndpoint(msgspec.Struct, omit_defaults=True):
    """How a prefill worker reaches a decode worker's KV pages (registered at start-up)."""

    transport: str  # "shm" | "tcp"
    shm_name: str = ""  # shared-memory segment holding the decode worker's whole KV pool
    host: str = ""
    port: int = 0
    num_blocks: int = 0
    block_size: int = 0
    dtype: str = ""
    # per layer: (num_kv_heads, head_dim); the pool is [layer][2][block][slot][head][dim]
    layer_shapes: list[tuple[int, int]] = []
    # The write fence (epdserve/transfer/fence.py): shm only, the owner array's segment.
    fence_shm_name: str = ""
    num_groups: int = 1


class SlabEndpoint(msgspec.Struct, omit_defaults=True):
    """A consumer's embedding slab (registered at start-up): rows of ``hidden_size`` elements."""

    transport: str  # "shm" | "tcp"
    shm_name: str = ""
    host: str = ""
    port: int = 0
    num_rows: int = 0
    hidden_size: int = 0
    dtype: str = ""
