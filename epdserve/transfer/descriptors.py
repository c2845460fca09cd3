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
    # Tensor parallelism: the worker's ranks, each holding ``layer_shapes``' heads of the model's
    # ``total_kv_heads`` (transfer/tp_plan.py); the pools of ranks 1.. in shared memory (rank 0's
    # is ``shm_name``). Over TCP rank 0's listener lands every rank's frames.
    tp_size: int = 1
    total_kv_heads: int = 0  # 0: layer_shapes' heads (TP 1)
    rank_shm_names: list[str] = []
    # Recurrent state (a model with state layers): per layer the state of one request
    # (``[]``: a layer without state; those layers' ``layer_shapes`` have no heads), its
    # ``num_state_slots`` slots in shared memory ``state_shm_name`` (shm), or landed by the TCP
    # listener with the KV.
    state_shapes: list[list[int]] = []
    num_state_slots: int = 0
    state_shm_name: str = ""


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
