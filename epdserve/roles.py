"""What a worker process does; the one list of roles every floor (router, workers, planner,
simulator) uses. A ``StrEnum``: a role is its own name in messages, metrics and logs."""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    COLOCATED = "colocated"  # prefill and decode of a request in one engine
    PREFILL = "prefill"  # prompt only; the KV goes to a decode worker
    DECODE = "decode"  # reserves pages, receives KV, generates
    ENCODE = "encode"  # vision encoder only; embeddings go to a consumer's slab


# Roles that run the language model (an engine with a KV cache and a step loop).
LLM_ROLES = (Role.COLOCATED, Role.PREFILL, Role.DECODE)
