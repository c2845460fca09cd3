"""Environment variables read by epdserve. This is the only module that reads them.

Values are read at call time, not import time, so a process (or a test) that sets a
variable before loading a model sees the new value.
"""

from __future__ import annotations

import os
from pathlib import Path

EPDSERVE_CACHE_DIR = "EPDSERVE_CACHE_DIR"
EPDSERVE_DISABLE_CPU_KERNELS = "EPDSERVE_DISABLE_CPU_KERNELS"


def get_cache_dir() -> Path:
    """Root of epdserve's on-disk caches (converted model weights, tokenizers).

    ``$EPDSERVE_CACHE_DIR`` when set and non-empty, else ``$XDG_CACHE_HOME/epdserve``,
    else ``~/.cache/epdserve``. The directory is not created here.
    """
    configured = os.environ.get(EPDSERVE_CACHE_DIR, "").strip()
    if configured:
        return Path(configured).expanduser()
    xdg_cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg_cache).expanduser() if xdg_cache else Path.home() / ".cache"
    return base / "epdserve"


def is_cpu_kernels_disabled() -> bool:
    """``$EPDSERVE_DISABLE_CPU_KERNELS`` set to 1/true/yes/on: use the torch path, not the
    compiled CPU kernels (e.g. paged decode attention)."""
    value = os.environ.get(EPDSERVE_DISABLE_CPU_KERNELS, "").strip().lower()
    return value in ("1", "true", "yes", "on")


EPDSERVE_GC_FREEZE = "EPDSERVE_GC_FREEZE"


def is_gc_freeze_enabled() -> bool:
    """False when ``$EPDSERVE_GC_FREEZE`` is 0/false/no/off: the router and workers then leave
    the objects alive at the end of start-up to the garbage collector (``epdserve/gc_heap.py``)."""
    value = os.environ.get(EPDSERVE_GC_FREEZE, "").strip().lower()
    return value not in ("0", "false", "no", "off")


EPDSERVE_API_KEY = "EPDSERVE_API_KEY"


def get_api_key() -> str | None:
    """``$EPDSERVE_API_KEY`` when set and non-empty: the key ``epdserve serve`` requires
    (``--api-key`` overrides it), and the key the experiments' launcher sends."""
    value = os.environ.get(EPDSERVE_API_KEY, "").strip()
    return value or None


EPDSERVE_CLUSTER_KEY = "EPDSERVE_CLUSTER_KEY"


def get_cluster_key() -> str | None:
    """``$EPDSERVE_CLUSTER_KEY`` when set and non-empty: the cluster secret (64 hex digits) a
    worker proves to the router and its peers (epdserve/auth.py)."""
    value = os.environ.get(EPDSERVE_CLUSTER_KEY, "").strip()
    return value or None


EPDSERVE_NODE_ID = "EPDSERVE_NODE_ID"


def get_node_id() -> str | None:
    """``$EPDSERVE_NODE_ID`` when set: the node this process runs on, as the cluster names it
    (a Ray node id); workers on the same node write each other's memory directly."""
    value = os.environ.get(EPDSERVE_NODE_ID, "").strip()
    return value or None


EPDSERVE_KEEP_FREED_MEMORY = "EPDSERVE_KEEP_FREED_MEMORY"


def is_keep_freed_memory_enabled() -> bool:
    """False when ``$EPDSERVE_KEEP_FREED_MEMORY`` is 0/false/no/off: an engine's process then
    keeps glibc malloc's default thresholds (``epdserve/engine/host_memory.py``)."""
    value = os.environ.get(EPDSERVE_KEEP_FREED_MEMORY, "").strip().lower()
    return value not in ("0", "false", "no", "off")


EPDSERVE_TRACES_DIR = "EPDSERVE_TRACES_DIR"


def get_traces_dir() -> Path:
    """Where experiments find the public request traces (``mooncake_conversation.jsonl``, ...):
    ``$EPDSERVE_TRACES_DIR`` when set and non-empty, else ``shared/data/traces`` beside the
    project's checkout."""
    configured = os.environ.get(EPDSERVE_TRACES_DIR, "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"


EPDSERVE_LOG_LEVEL = "EPDSERVE_LOG_LEVEL"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def get_log_level() -> str:
    """The level every epdserve process logs at (``EPDSERVE_LOG_LEVEL``; default WARNING, an
    unknown value too): INFO shows the router's decisions (switches of role, hand-overs)."""
    level = os.environ.get(EPDSERVE_LOG_LEVEL, "WARNING").upper()
    return level if level in LOG_LEVELS else "WARNING"
