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


def timing_json(t: Timing) -> dict:
    prefill_end = t.prefill_end or t.first_token
    has_encode = bool(t.encode_start and t.encode_end)
    queue_end = t.encode_start if has_encode else t.prefill_start
    prefill_from = max(t.prefill_start, t.encode_end) if has_encode and t.prefill_start else t.prefill_start
    prefill_ms = max(0.0, round(_ms(t.prefill_end, prefill_from) - t.kv_blocking_s * 1e3, 3))
    # Waiting for an encoder, then (with images) for the prefill step after the embeddings are in.
    queue_ms = _ms(queue_end, t.arrived) + (_ms(t.prefill_start, t.encode_end) if has_encode else 0.0)
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
        "queue_ms": round(queue_ms, 3),
        "encode_ms": _ms(t.encode_end, t.encode_start),
        "embed_transfer_ms": round(t.embed_transfer_s * 1e3, 3),
        "prefill_ms": prefill_ms,
        "prefill_overlap_ms": _ms(min(t.encode_end, t.prefill_end), t.prefill_start) if has_encode else 0.0,
        "kv_blocking_ms": round(t.kv_blocking_s * 1e3, 3),
        "kv_transfer_ms": _ms(t.kv_transfer_end, t.kv_transfer_start),
        "exposed_transfer_ms": round(t.kv_exposed_s * 1e3, 3),
        "first_token_ms": _ms(t.first_token, prefill_end),
        "ttft_ms": _ms(t.first_token, t.arrived),
        "e2e_ms": _ms(t.finished, t.arrived),
    }
