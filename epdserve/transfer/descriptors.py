"""Descriptors of the memory other processes write into: a decode worker's KV pages and a
consumer's embedding slab. Registered with the router at start-up and handed to peers; the
transfer layer opens links from them. msgspec structs (they travel inside control messages)."""

from __future__ import annotations

import msgspec

NULL_BLOCK = 0  # block 0 of every KV pool: never handed out, stands for a block a table does not hold


class KVEndpoint(msgspec.Struct, omit_defaults=True):
    """How a prefill worker reaches a decode worker's KV pages (registered at start-up).

    A decode worker may offer both ways in: its pool in shared memory (``shm_name``, for
    writers on its node) and a TCP listener (``host``/``port``, for any node); each prefill
    worker takes the shared pool when it runs on the same ``node`` (locality.py)."""

    transport: str  # what it offers: "shm", "tcp", or "auto" (both)
    shm_name: str = ""  # shared-memory segment holding the decode worker's whole KV pool
    host: str = ""
    port: int = 0
    node: str = ""  # locality.this_node() of the decode worker
    num_blocks: int = 0
    block_size: int = 0
    dtype: str = ""
    # per layer: (num_kv_heads, head_dim); the pool is [layer][2][block][slot][head][dim]
    layer_shapes: list[tuple[int, int]] = []
    # The write fence (epdserve/transfer/fence.py): shm only, the owner array's segment.
    fence_shm_name: str = ""
    num_groups: int = 1


class SlabEndpoint(msgspec.Struct, omit_defaults=True):
    """A consumer's embedding slab (registered at start-up): rows of ``hidden_size`` elements,
    in shared memory for encode workers on its node and/or behind a TCP listener."""

    transport: str  # what it offers: "shm", "tcp", or "auto" (both)
    shm_name: str = ""
    host: str = ""
    port: int = 0
    node: str = ""
    num_rows: int = 0
    hidden_size: int = 0
    dtype: str = ""
