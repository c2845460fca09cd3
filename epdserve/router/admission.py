"""Admission: what the router refuses before a request runs, with the HTTP status and the
reason (a metric label) of each refusal.

The one copy of these rules: the router (core.py, flow.py, encode_stage.py) raises
``Overloaded`` with one of these rejections, and the simulator (sim/cluster.py) records the
same rejections for the requests it refuses::

    too many requests in the router                       429 queue_full
    no ready worker of a needed role                      503 no_workers (Retry-After 5)
    the picked worker's queue is full                     429 worker_queue_full
    (last reported waiting + submitted since that report)
    a decode worker cannot reserve the prompt's blocks    503 no_kv_blocks
    (the prompt can never fit, or no room came free
    within --decode-queue-timeout)
    ... or does not answer the reservation in time        503 reservation_timeout
    a consumer's embedding slab is full                   503 embedding_slab_full
    images but nobody can encode them                     503 no_encoder (Retry-After 5)
    the worker cannot be sent the request                 503 unreachable
    --admission predictive: the request's class has a      429 slo_unreachable
    TTFT SLO that no worker is predicted to meet            (Retry-After: the excess)
    (batch work is deferred instead: queued behind the other classes)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epdserve.errors import EpdserveError
from epdserve.service import ClassSLO

if TYPE_CHECKING:
    from epdserve.router.workers import WorkerInfo

DEFAULT_MAX_PENDING = 512  # requests in the router at once
DEFAULT_MAX_WAITING_PER_WORKER = 256  # queued at one worker
NO_WORKERS_RETRY_S = 5


@dataclass(frozen=True)
class Rejection:
    status: int  # HTTP status: 429 (retry later, queue full) or 503 (no capacity)
    reason: str  # metric label (epdserve_router_rejected_total{reason})
    message: str
    retry_after: int = 1  # seconds (the Retry-After header)


class Overloaded(EpdserveError):
    """Admission refused; the client should retry after ``retry_after`` seconds."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection
        self.status = rejection.status
        self.retry_after = rejection.retry_after


def check_pending(num_pending: int, max_pending: int) -> Rejection | None:
    """``num_pending``: requests the router holds now, this one not counted."""
    if num_pending >= max_pending:
        return Rejection(429, "queue_full", f"server is at its limit of {max_pending} requests")
    return None


def check_worker_queue(worker: WorkerInfo | None, max_waiting_per_worker: int, role: str | None = None) -> Rejection | None:
    """The picked worker (None: no ready worker of ``role``) can queue one more request."""
    if worker is None:
        return no_workers(role)
    if worker.load.num_waiting + worker.num_submitted >= max_waiting_per_worker:
        return Rejection(429, "worker_queue_full", f"worker queues are full ({max_waiting_per_worker})")
    return None


ADMISSION_POLICIES = ("queue", "predictive")  # epdserve serve --admission


def check_predicted_ttft(service_class: str, predicted_s: float | None, slo: ClassSLO | None) -> Rejection | None:
    """``--admission predictive``: refuse a request of ``service_class`` whose best predicted
    TTFT (``WorkerRegistry.predict_ttft``) breaks its class's TTFT SLO; batch work is admitted
    anyway (deferred: it queues behind the other classes). None: admit."""
    if slo is None or slo.ttft_s is None or predicted_s is None or predicted_s <= slo.ttft_s:
        return None
    if service_class == "batch":
        return None
    return Rejection(429, "slo_unreachable",
                     f"predicted time to first token {predicted_s * 1e3:.0f} ms exceeds the {service_class} class's "
                     f"TTFT SLO of {slo.ttft_s * 1e3:.0f} ms on every worker",
                     max(1, math.ceil(predicted_s - slo.ttft_s)))


def no_workers(role: str | None = None) -> Rejection:
    kind = f"{role} workers" if role else "workers"
    return Rejection(503, "no_workers", f"no {kind} are available", NO_WORKERS_RETRY_S)


def reservation_refused(reason: str) -> Rejection:
    return Rejection(503, "no_kv_blocks", f"decode KV cache is full: {reason}")


def reservation_timeout() -> Rejection:
    return Rejection(503, "reservation_timeout", "decode worker did not answer the reservation in time")


def slab_full(worker_id: str) -> Rejection:
    return Rejection(503, "embedding_slab_full", f"embedding slab of {worker_id} is full")


def no_encoder() -> Rejection:
    return Rejection(503, "no_encoder", "no encode workers are available", NO_WORKERS_RETRY_S)


def unreachable(worker_id: str) -> Rejection:
    return Rejection(503, "unreachable", f"worker {worker_id} cannot be reached")


def start_failed(error: BaseException) -> Rejection:
    return Rejection(503, "start_failed", f"cannot start the request: {type(error).__name__}")
