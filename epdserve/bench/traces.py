"""Request trace files, read into validated records: one parser for bench and the simulator.

- Mooncake JSONL (``read_trace``): one JSON object a line, ``timestamp`` (ms from the start),
  ``input_length``, ``output_length`` and optional ``hash_ids`` (one id per
  ``TRACE_BLOCK_TOKENS`` prompt tokens; equal ids mean equal blocks, a shared prefix).
- Azure CSV (``read_csv_trace``): columns ``arrived_at`` (s), ``num_prefill_tokens``,
  ``num_decode_tokens``; no hash ids.

Numbers may be JSON numbers or numeric strings and must be finite and >= 0; lengths are
truncated to integers. Every malformed line raises ``BenchError`` naming ``path:line``.
Records come back sorted by arrival time (stable: equal times keep the file's order).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from epdserve.bench import BenchError

TRACE_BLOCK_TOKENS = 512  # tokens behind one trace ``hash_ids`` entry (Mooncake traces)


@dataclass(frozen=True)
class TraceRecord:
    arrival_s: float  # as the file gives it (not shifted to the first arrival)
    input_length: int  # prompt tokens
    output_length: int  # output tokens
    hash_ids: tuple[int, ...] = ()  # prompt blocks, in order


def trace_number(record: dict, key: str, where: str) -> float:
    """``record[key]`` as a finite non-negative float; ``where`` (``path:line``) heads the error."""
    value = record.get(key)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value < 0:
        raise BenchError(f"{where}: {key!r} must be a non-negative number, got {value!r}")
    return float(value)


def _mooncake_records(path: str, f: TextIO) -> list[TraceRecord]:
    records = []
    for line_no, line in enumerate(f, start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"{where}: not a JSON object: {e.msg}") from None
        if not isinstance(record, dict):
            raise BenchError(f"{where}: not a JSON object")
        hash_ids = record.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
        ):
            raise BenchError(f"{where}: 'hash_ids' must be a list of non-negative integers")
        records.append(TraceRecord(trace_number(record, "timestamp", where) / 1000.0,
                                   int(trace_number(record, "input_length", where)),
                                   int(trace_number(record, "output_length", where)), tuple(hash_ids)))
    return records


def _azure_records(path: str, f: TextIO) -> list[TraceRecord]:
    reader = csv.DictReader(f)
    needed = {"arrived_at", "num_prefill_tokens", "num_decode_tokens"}
    if not needed <= set(reader.fieldnames or ()):
        raise BenchError(f"{path}: a CSV trace needs columns {', '.join(sorted(needed))}")
    return [
        TraceRecord(trace_number(row, "arrived_at", f"{path}:{i}"),
                    int(trace_number(row, "num_prefill_tokens", f"{path}:{i}")),
                    int(trace_number(row, "num_decode_tokens", f"{path}:{i}")))
        for i, row in enumerate(reader, start=2)
    ]


def _read(path: str, parse: Callable[[str, TextIO], list[TraceRecord]],
          newline: str | None) -> list[TraceRecord]:
    try:
        with open(path, encoding="utf-8", newline=newline) as f:
            records = parse(path, f)
    except OSError as e:
        raise BenchError(f"cannot read trace {path}: {e.strerror}") from None
    if not records:
        raise BenchError(f"{path}: the trace has no requests")
    records.sort(key=lambda r: r.arrival_s)
    return records


def read_trace(path: str) -> list[TraceRecord]:
    """A Mooncake JSONL trace's requests, sorted by arrival (at least one)."""
    return _read(path, _mooncake_records, None)


def read_csv_trace(path: str) -> list[TraceRecord]:
    """An Azure CSV trace's requests, sorted by arrival (at least one)."""
    return _read(path, _azure_records, "")


def read_any_trace(path: str) -> list[TraceRecord]:
    """A trace by its file name: ``*.csv`` Azure, anything else Mooncake JSONL."""
    return read_csv_trace(path) if path.endswith(".csv") else read_trace(path)
