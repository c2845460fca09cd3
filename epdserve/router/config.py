"""The router's options (``epdserve serve`` sets them from its flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.cluster.messages import MAX_RESERVE_WAIT_S
from epdserve.errors import EpdserveError
from epdserve.router.admission import ADMISSION_POLICIES, DEFAULT_MAX_PENDING, DEFAULT_MAX_WAITING_PER_WORKER
from epdserve.router.role_control import RoleControlConfig
from epdserve.router.role_switch import ROLE_SWITCHING
from epdserve.router.workers import DEFAULT_ROUTING
from epdserve.service import ClassSLO

TRANSFER_POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class RouterConfig:
    # Liveness lease: a worker whose heartbeats stop this long is suspected, its requests fail.
    heartbeat_timeout_s: float = 1.0
    # Progress watchdog: a worker whose loop has been in one step this long (its heartbeats say)
    # is treated like a dead one; either way it serves again once it reconciles.
    step_timeout_s: float = 60.0
    first_token_timeout_s: float = 120.0  # admitted -> first token; then the request fails (0: none)
    reserve_timeout_s: float = 5.0  # for the decode worker's answer to a reservation, past its queue wait
    # P/D: how long a reservation may wait at a full decode worker for blocks or a seat (then 503)
    decode_queue_timeout_s: float = 60.0
    transfer_timeout_s: float = 30.0  # first token out -> KV landed; then the policy applies
    transfer_policy: str = "fail"  # "fail" | "recompute" (decode worker computes the prompt)
    max_pending: int = DEFAULT_MAX_PENDING  # requests in the router at once; beyond: 429
    max_waiting_per_worker: int = DEFAULT_MAX_WAITING_PER_WORKER  # queued at one worker; beyond: 429
    encode_pipelined: bool = True  # prefill may start before all of a request's images are encoded
    routing: str = DEFAULT_ROUTING  # WorkerRegistry.pick's policy (checked there)
    routing_ttft_slo_s: float | None = None  # prefix-aware: the TTFT SLO it routes for (checked there)
    # SLO per service class (epdserve.service.parse_class_slos): attainment per class in the metrics
    class_slos: dict[str, ClassSLO] = field(default_factory=dict)
    admission: str = "queue"  # "queue" | "predictive" (admission.check_predicted_ttft)
    # Switches of role at run time (role_switch.py): "off"; "manual" (POST /v1/workers/{id}/role);
    # "auto" (also the controller of role_control.py, with ``role_control``'s SLOs and bands)
    role_switching: str = "off"
    role_control: RoleControlConfig | None = None

    def __post_init__(self) -> None:
        if self.admission not in ADMISSION_POLICIES:
            raise EpdserveError(f"admission must be one of {', '.join(ADMISSION_POLICIES)}, got {self.admission!r}")
        if self.role_switching not in ROLE_SWITCHING:
            raise EpdserveError(f"role switching must be one of {', '.join(ROLE_SWITCHING)}, got {self.role_switching!r}")
        if self.role_switching == "auto" and self.role_control is None:
            raise EpdserveError("role switching 'auto' needs the SLOs it keeps (role_control)")
        if self.transfer_policy not in TRANSFER_POLICIES:
            raise EpdserveError(f"transfer policy must be fail or recompute, got {self.transfer_policy!r}")
        if not 0 <= self.decode_queue_timeout_s <= MAX_RESERVE_WAIT_S:
            raise EpdserveError(f"the decode queue timeout must be 0 to {MAX_RESERVE_WAIT_S:g} s, "
                                f"got {self.decode_queue_timeout_s:g}")
        if self.heartbeat_timeout_s <= 0 or self.step_timeout_s <= 0 or self.first_token_timeout_s < 0:
            raise EpdserveError("the worker lease and step timeout must be positive, the first-token timeout >= 0")
