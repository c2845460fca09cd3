"""On-disk cache of GGUF checkpoints converted to Hugging Face-style directories.

Dequantizing a GGUF file and converting its tokenizer takes seconds to tens of seconds;
the result is kept so that later loads only memory-map a safetensors file::

    <cache root>/models/<stem>-<key>/      key: hash of (absolute path, size, mtime, format)
        config.json  generation_config.json  model.safetensors (float32, HF tensor names)
        tokenizer.json  tokenizer_config.json  epdserve_meta.json

Invariant: an entry directory exists only when complete. It is written under a temporary
name in the same parent and renamed into place as the last step, so a crash leaves at most
a ``.tmp-*`` directory, never a half-written entry. The meta file records every file's size;
an entry whose files do not match (torn by a power loss) is treated as absent and rewritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from epdserve.envs import get_cache_dir

CACHE_FORMAT_VERSION = 1  # bump when the layout or the conversion changes
META_FILE = "epdserve_meta.json"


def _source_identity(source: Path) -> dict[str, object]:
    stat = source.stat()
    return {
        "source": str(source.resolve()),
        "size_bytes": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "format_version": CACHE_FORMAT_VERSION,
    }


def entry_dir(source: Path) -> Path:
    """Where the converted copy of ``source`` lives (whether or not it exists yet)."""
    identity = json.dumps(_source_identity(source), sort_keys=True)
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return get_cache_dir() / "models" / f"{source.stem}-{key}"


def lookup(source: Path) -> Path | None:
    """The complete cache entry for ``source``, or None when it has not been converted."""
    entry = entry_dir(source)
    meta_file = entry / META_FILE
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if meta.get("identity") != _source_identity(source):
        return None
    return entry if _file_sizes(entry) == meta.get("file_sizes") else None


def _file_sizes(entry: Path) -> dict[str, int]:
    """Size in bytes of every file of an entry but the meta file (catches torn writes)."""
    return {file.name: file.stat().st_size for file in entry.iterdir() if file.name != META_FILE}


@contextlib.contextmanager
def publish(source: Path) -> Iterator[Path]:
    """Yield an empty temporary directory to fill; on success it becomes ``entry_dir(source)``.

    On an exception the temporary directory is removed and nothing is published. If another
    process published the same entry meanwhile, its copy is kept and ours discarded.
    """
    entry = entry_dir(source)
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
    staging.chmod(0o755)  # mkdtemp makes it owner-only; an entry is as readable as its parent
    try:
        yield staging
        meta = {
            "identity": _source_identity(source),
            "file_sizes": _file_sizes(staging),
            "created_unix_s": time.time(),
        }
        (staging / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        if lookup(source) is None:
            if entry.exists():
                shutil.rmtree(entry)  # unreadable leftovers under the entry's name
            try:
                os.rename(staging, entry)
            except OSError:
                if lookup(source) is None:  # not a concurrent publisher winning the race
                    raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
