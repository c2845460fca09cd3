"""The router's encode stage on its own: what an encoder's report counts, whatever the order in
which the encoder's report and the consumer's landing arrive (they come on different channels).

The request flow and the worker channel are stand-ins here (the encode stage is the subject);
the metrics, the slab allocator and the paths are the router's own.
"""

from __future__ import annotations

from epdserve.cluster import messages as m
from epdserve.router.encode_stage import EncodeStage
from epdserve.router.metrics import RouterMetrics
from epdserve.router.path import Mode, Path, PathImages, RequestHandle
from epdserve.router.workers import WorkerRegistry
from epdserve.sampling import SamplingParams
from epdserve.transfer.slab import SlabAllocator

ENCODER, CONSUMER = "encode-0", "prefill-0"


class Flow:
    """Stand-in for the request flow: the path index and the rule that drops an idle path."""

    def __init__(self) -> None:
        self.paths: dict[str, Path] = {}
        self.failed: list[str] = []
        self.stage: EncodeStage | None = None

    def fail(self, path: Path, message: str) -> None:
        path.done = True
        self.failed.append(message)

    def forget_if_idle(self, path: Path) -> None:
        if not self.stage.is_holding(path):
            self.paths.pop(path.path_id, None)


class Channel:
    def __init__(self) -> None:
        self.posted: list[tuple[str, object]] = []

    def post(self, worker_id: str, msg: object) -> None:
        self.posted.append((worker_id, msg))


def _stage_with_one_image() -> tuple[EncodeStage, Flow, Channel, Path]:
    flow, channel, metrics = Flow(), Channel(), RouterMetrics()
    stage = EncodeStage(flow, channel, WorkerRegistry(), metrics)
    flow.stage = stage
    allocator = stage.allocators[CONSUMER] = SlabAllocator(64)
    handle = RequestHandle("r1", 1, 8)
    path = Path("r1", handle, 0, list(range(8)), SamplingParams(), Mode.PD)
    path.mm = PathImages([], CONSUMER, [allocator.allocate(16)], pending_jobs={0: ENCODER})
    stage.jobs_per_encoder[ENCODER] = {("r1", 0)}
    flow.paths["r1"] = path
    return stage, flow, channel, path


def _done(**fields) -> m.EncodeDone:
    return m.EncodeDone("r1", 0, True, encode_start=100.0, encode_end=100.5, num_bytes=4096, via_tcp=True,
                        **fields)


def _sample(stage: EncodeStage, name: str) -> float:
    return stage.metrics.registry.get_sample_value(name)


def test_a_report_after_the_landing_and_the_end_of_its_request_is_counted_once():
    stage, flow, _, path = _stage_with_one_image()
    stage.on_embedding_landed(m.EmbeddingLanded("r1", 0))  # the consumer's report came first
    path.done = True
    stage.on_consumer_done(path)
    assert "r1" not in flow.paths  # slab rows free, path forgotten
    assert stage.allocators[CONSUMER].num_free_rows == 64

    stage.on_encode_done(ENCODER, _done(is_cache_hit=True))
    assert _sample(stage, "epdserve_embedding_transfer_bytes_total") == 4096
    assert _sample(stage, "epdserve_encoder_cache_hits_total") == 1
    assert _sample(stage, "epdserve_image_encode_seconds_count") == 1
    assert _sample(stage, "epdserve_image_encode_seconds_sum") == 0.5

    stage.on_encode_done(ENCODER, _done())  # a repeated report counts nothing more
    stage.on_encode_done("encode-1", _done())  # nor one from an encoder the job was not sent to
    assert _sample(stage, "epdserve_embedding_transfer_bytes_total") == 4096
    assert _sample(stage, "epdserve_image_encode_seconds_count") == 1
    assert flow.failed == []


def test_a_report_after_the_landing_still_times_the_running_request():
    stage, flow, channel, path = _stage_with_one_image()
    stage.on_embedding_landed(m.EmbeddingLanded("r1", 0))
    assert path.mm.pending_jobs == {}
    stage.on_encode_done(ENCODER, _done(write_s=0.25))
    timing = path.handle.timing
    assert timing.encode_start == 100.0 and timing.encode_end > 0
    assert timing.embed_transfer_s == 0.25
    assert channel.posted == []  # over TCP the landing, not the report, tells the consumer
    assert path.mm.regions  # rows held until the consumer is done
    stage.on_consumer_done(path)
    assert "r1" not in flow.paths and stage.allocators[CONSUMER].num_free_rows == 64


def test_a_report_before_the_landing_holds_the_rows_until_the_landing():
    stage, flow, _, path = _stage_with_one_image()
    stage.on_encode_done(ENCODER, _done())
    assert path.mm.pending_jobs == {0: ENCODER} and path.mm.sent_indices == {0}
    stage.on_consumer_done(path)
    assert "r1" in flow.paths  # not landed yet: the rows may still be written
    stage.on_embedding_landed(m.EmbeddingLanded("r1", 0))
    assert "r1" not in flow.paths and stage.allocators[CONSUMER].num_free_rows == 64
    assert _sample(stage, "epdserve_embedding_transfer_bytes_total") == 4096
