"""The recent arrival mix: when each request arrived, its prompt and answer lengths, its class.

The router notes every request that reaches admission (refused ones too: they are demand) and,
when it finishes, how many tokens it generated; ``GET /v1/traffic`` serves the last
``window_s`` seconds of it, and ``epdserve plan --from-server`` replays that through the
simulator to re-derive the ratio the server should run.
"""

from __future__ import annotations

import time
from collections import deque

MAX_RECORDS = 20_000
COLUMNS = ("arrived_s", "prompt_tokens", "output_tokens", "service_class")


class TrafficLog:
    def __init__(self, max_records: int = MAX_RECORDS) -> None:
        # [arrival (epoch seconds), prompt tokens, output tokens (requested until it finishes), class]
        self.records: deque[list] = deque(maxlen=max_records)
        self._open: dict[str, list] = {}

    def arrived(self, request_id: str, num_prompt_tokens: int, max_output_tokens: int, service_class: str,
                now: float | None = None) -> None:
        record = [now if now is not None else time.time(), num_prompt_tokens, max_output_tokens, service_class]
        self.records.append(record)
        if len(self._open) < self.records.maxlen:
            self._open[request_id] = record

    def finished(self, request_id: str, num_output_tokens: int | None) -> None:
        """The request ended; ``num_output_tokens`` it generated (None: it did not run)."""
        record = self._open.pop(request_id, None)
        if record is not None and num_output_tokens is not None:
            record[2] = num_output_tokens

    def as_json(self, window_s: float, now: float | None = None) -> dict:
        """The requests that arrived in the last ``window_s`` seconds, times from the first."""
        now = now if now is not None else time.time()
        start = now - window_s
        recent = [r for r in self.records if r[0] >= start]
        first = recent[0][0] if recent else now
        span = now - first if recent else 0.0
        return {"object": "traffic", "window_s": window_s, "num_requests": len(recent),
                "rate": len(recent) / span if span > 0 else 0.0, "columns": list(COLUMNS),
                "requests": [[round(r[0] - first, 6), r[1], r[2], r[3]] for r in recent]}
