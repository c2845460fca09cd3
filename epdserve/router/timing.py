"""Server-side timing of one request, as returned with ``"return_timing": true``.

TTFT decomposes as ``queue + encode + prefill + blocking KV transfer + first-token output``:

    arrived ─queue─▶ encode_start ─encode─▶ encode_end ─queue─▶ prefill_start
            ─prefill─▶ prefill_end ─first token out─▶ first_token

The queue is every wait: for an encoder (its first image's batch), then for the prefill
worker's first step with the request where that comes after its embeddings are in. Without
images the encode part is empty and the queue ends at ``prefill_start``. With pipelined
prefill, chunks before the last image run while the images wait and encode; that overlapped
prefill time is ``prefill_overlap_ms`` and is not counted again in ``prefill_ms``, so the
parts add up to the TTFT either way.

The prefill step's own time moving KV (a shared-memory write is a copy by the prefill
worker's thread; so is gathering the pages for a TCP send) delays the first token and is
``kv_blocking_ms``; ``prefill_ms`` is the rest of the step. What is still in flight when the
prefill ends (TCP) delays the second token instead; ``exposed_transfer_ms`` is the whole
part not hidden behind prefill compute (blocking + in flight after it).
"""

from __future__ import annotations

import msgspec

from epdserve.cluster.messages import Timing


def _ms(later: float, earlier: float) -> float:
    return round(max(0.0, later - earlier) * 1e3, 3) if later and earlier else 0.0


def _span(later: float | None, earlier: float | None) -> float:
    return max(0.0, later - earlier) if later is not None and earlier is not None else 0.0


def ttft_parts_s(arrived: float | None, encode_start: float | None, encode_end: float | None,
                 prefill_start: float | None, prefill_end: float | None, first_token: float | None,
                 kv_blocking_s: float = 0.0) -> tuple[float, float, float, float]:
    """The TTFT's parts in seconds, (queue, encode, prefill, first token out), as the module
    docstring has them; with ``kv_blocking_s`` they add up to first_token - arrived. None: the
    moment did not happen (a part missing one of its ends is 0). The server's ``timing`` and
    the simulator's breakdown (``sim/results.py``) both take theirs from here."""
    if encode_start is not None and encode_end is not None:
        # Waiting for an encoder, then for the prefill step after the embeddings are in.
        queue = _span(encode_start, arrived) + _span(prefill_start, encode_end)
        encode = encode_end - encode_start
        prefill_from = max(prefill_start, encode_end) if prefill_start is not None else None
    else:
        queue, encode, prefill_from = _span(prefill_start, arrived), 0.0, prefill_start
    prefill = max(0.0, _span(prefill_end, prefill_from) - kv_blocking_s)
    return queue, encode, prefill, _span(first_token, prefill_end if prefill_end is not None else first_token)


def timing_json(t: Timing) -> dict:
    has_encode = bool(t.encode_start and t.encode_end)
    queue_s, encode_s, prefill_s, first_token_s = ttft_parts_s(
        t.arrived or None, t.encode_start or None, t.encode_end or None, t.prefill_start or None,
        t.prefill_end or None, t.first_token or None, t.kv_blocking_s)
    return {
        "arrived": t.arrived,
        "admitted": t.admitted,
        "prefill_start": t.prefill_start,
        "prefill_end": t.prefill_end,
        "kv_transfer_start": t.kv_transfer_start,
        "kv_transfer_end": t.kv_transfer_end,
        "first_token": t.first_token,
        "decode_start": t.decode_start,
        "finished": t.finished,
        "num_cached_tokens": t.num_cached_tokens,
        "num_decode_cached_tokens": t.num_decode_cached_tokens,
        "kv_bytes": t.kv_bytes,
        "kv_bytes_skipped": t.kv_bytes_skipped,
        "kv_bytes_by_group": dict(t.kv_bytes_by_group),
        "kv_load": msgspec.structs.asdict(t.kv_load) if t.kv_load is not None else None,
        "encode_start": t.encode_start,
        "encode_end": t.encode_end,
        "num_images": t.num_images,
        "num_encoder_cache_hits": t.num_encoder_cache_hits,
        "service_class": t.service_class,
        "queue_ms": round(queue_s * 1e3, 3),
        "encode_ms": round(encode_s * 1e3, 3),
        "embed_transfer_ms": round(t.embed_transfer_s * 1e3, 3),
        "prefill_ms": round(prefill_s * 1e3, 3),
        "prefill_overlap_ms": _ms(min(t.encode_end, t.prefill_end), t.prefill_start) if has_encode else 0.0,
        "kv_blocking_ms": round(t.kv_blocking_s * 1e3, 3),
        "kv_transfer_ms": _ms(t.kv_transfer_end, t.kv_transfer_start),
        "exposed_transfer_ms": round(t.kv_exposed_s * 1e3, 3),
        "first_token_ms": round(first_token_s * 1e3, 3),
        "ttft_ms": _ms(t.first_token, t.arrived),
        "e2e_ms": _ms(t.finished, t.arrived),
    }
