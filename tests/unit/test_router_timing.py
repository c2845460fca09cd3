"""The server's TTFT decomposition (``return_timing``): its parts add up to the TTFT."""

from __future__ import annotations

import pytest

from epdserve.cluster.messages import Timing
from epdserve.router.timing import timing_json

PARTS = ("queue_ms", "encode_ms", "prefill_ms", "kv_blocking_ms", "first_token_ms")


def test_waiting_for_the_prefill_step_after_the_embeddings_counts_as_queue():
    # 0.5 s for an encoder, 0.5 s encoding, 0.2 s for the prefill worker, 0.3 s prefill, 0.1 s out.
    t = Timing(arrived=100.0, encode_start=100.5, encode_end=101.0, prefill_start=101.2, prefill_end=101.5,
               first_token=101.6)
    j = timing_json(t)
    assert j["queue_ms"] == pytest.approx(700.0)
    assert j["encode_ms"] == pytest.approx(500.0) and j["prefill_ms"] == pytest.approx(300.0)
    assert sum(j[k] for k in PARTS) == pytest.approx(j["ttft_ms"])


def test_pipelined_prefill_overlaps_the_wait_for_the_encoder():
    # The text was prefilled from 100.2 while the image waited for the encoder and encoded
    # (100.4-101.0); the prefill ends 0.2 s after the embedding is in. The overlapped prefill is
    # in prefill_overlap_ms, and the parts still add up to the TTFT.
    t = Timing(arrived=100.0, encode_start=100.4, encode_end=101.0, prefill_start=100.2, prefill_end=101.2,
               first_token=101.2)
    j = timing_json(t)
    assert j["queue_ms"] == pytest.approx(400.0) and j["encode_ms"] == pytest.approx(600.0)
    assert j["prefill_ms"] == pytest.approx(200.0) and j["prefill_overlap_ms"] == pytest.approx(800.0)
    assert sum(j[k] for k in PARTS) == pytest.approx(j["ttft_ms"])


def test_without_images_the_queue_ends_at_the_prefill_start():
    t = Timing(arrived=100.0, prefill_start=100.25, prefill_end=100.5, first_token=100.5, kv_blocking_s=0.05)
    j = timing_json(t)
    assert (j["queue_ms"], j["encode_ms"]) == (pytest.approx(250.0), 0.0)
    assert j["prefill_ms"] == pytest.approx(200.0)
    assert sum(j[k] for k in PARTS) == pytest.approx(j["ttft_ms"])
