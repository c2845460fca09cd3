"""Simulator settings and run statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.cluster.messages import MAX_RESERVE_WAIT_S
from epdserve.config import ENCODE_BATCH_IMAGES
from epdserve.errors import ConfigError
from epdserve.router.admission import ADMISSION_POLICIES, DEFAULT_MAX_PENDING, DEFAULT_MAX_WAITING_PER_WORKER
from epdserve.router.role_control import RoleControlConfig
from epdserve.router.workers import DEFAULT_ROUTING
from epdserve.service import SERVICE_CLASSES, ClassSLO
from epdserve.sim.instance import SHM_BYTES_PER_S
from epdserve.sim.topology import Topology


@dataclass(frozen=True)
class SimConfig:
    topology: Topology
    link_bytes_per_s: float = SHM_BYTES_PER_S  # each prefill / encode instance's outgoing link
    heartbeat_s: float = 0.2  # load reports reach the router this often (the workers' default)
    max_pending: int = DEFAULT_MAX_PENDING
    max_waiting_per_worker: int = DEFAULT_MAX_WAITING_PER_WORKER
    # P/D: a full decode instance queues reservations this long (as serve --decode-queue-timeout)
    decode_queue_timeout_s: float = 60.0
    max_num_seqs: dict[str, int] = field(default_factory=dict)  # per role; absent: the profile's
    max_model_len: int | None = None  # None: the workload's longest request
    enable_prefix_caching: bool = True
    is_mm_pipelined: bool = True
    # Where a request's images sit in its prompt: after its text (as bench's random-mm and chat
    # clients send them: the text is prefilled while the images encode) or before it.
    images_after_text: bool = True
    encode_max_batch_images: int = ENCODE_BATCH_IMAGES
    max_detail_requests: int = 10_000  # requests that keep inter-token gaps and timing
    is_fast_forward: bool = True  # decode-only stretches in bulk (same result as stepping)
    # Instances share hosts in creation order (encode, prefill, decode / colocated), this many
    # per host; a role's ``neighbour_step`` applies to the others on its host.
    instances_per_host: int = 1
    # Each host's cores (0: no instance shares one). Instances take them as serve pins its
    # workers (consecutive, wrapping: cluster/local.py core_sets, ``cores_per_worker`` each); a step
    # gets 1 / (1 + k) of its core while k others on one of its cores are mid-step (instance.Pace).
    cores_per_host: int = 0
    cores_per_worker: int = 1
    routing: str = DEFAULT_ROUTING  # the router's policy (WorkerRegistry.pick, which checks it)
    routing_ttft_slo_s: float | None = None  # prefix-aware's TTFT SLO (as serve --routing-ttft-slo)
    # KV tiers below each instance's pool, per host (as serve --kv-host-tier-gib, --kv-disk-tier-gib;
    # 0: none), read at the profile's measured bandwidths unless given here (bytes per second).
    kv_host_tier_gib: float = 0.0
    kv_disk_tier_gib: float = 0.0
    kv_tier_bytes_per_s: dict[str, float] = field(default_factory=dict)
    # Service classes (epdserve.service): each request's class drawn from ``class_mix`` (share
    # per class; empty: every request interactive) with ``class_seed``; SLOs per class, and the
    # router's admission policy (as serve --service-class-slo, --admission).
    class_mix: dict[str, float] = field(default_factory=dict)
    class_seed: int = 0
    class_slos: dict[str, ClassSLO] = field(default_factory=dict)
    admission: str = "queue"
    # Role switching (sim/roles.py; as serve --role-switching auto): the controller's settings
    # (None: roles stay as the topology set them; a colocated topology has none to switch) and
    # the seconds a drained worker takes to come back in its new role.
    role_control: RoleControlConfig | None = None
    role_switch_s: float = 0.4

    @property
    def has_kv_tiers(self) -> bool:
        return self.kv_host_tier_gib > 0 or self.kv_disk_tier_gib > 0

    def __post_init__(self) -> None:
        checks = [
            (self.link_bytes_per_s > 0, f"link bandwidth must be > 0, got {self.link_bytes_per_s}"),
            (self.heartbeat_s > 0, f"heartbeat period must be > 0, got {self.heartbeat_s}"),
            (0 <= self.decode_queue_timeout_s <= MAX_RESERVE_WAIT_S,
             f"decode queue timeout must be 0 to {MAX_RESERVE_WAIT_S:g} s, got {self.decode_queue_timeout_s}"),
            (self.max_pending >= 1, f"max_pending must be >= 1, got {self.max_pending}"),
            (self.max_waiting_per_worker >= 1, f"max_waiting_per_worker must be >= 1, got {self.max_waiting_per_worker}"),
            (self.encode_max_batch_images >= 1, "encode batch must hold >= 1 image"),
            (self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2"),
            (self.max_detail_requests >= 0, "max_detail_requests must be >= 0"),
            (self.instances_per_host >= 1, f"instances per host must be >= 1, got {self.instances_per_host}"),
            (self.cores_per_host >= 0 and self.cores_per_worker >= 1,
             f"cores per host must be >= 0 and per worker >= 1, got {self.cores_per_host}, {self.cores_per_worker}"),
            (self.kv_host_tier_gib >= 0 and self.kv_disk_tier_gib >= 0, "KV tier sizes must be >= 0 GiB"),
            (not self.has_kv_tiers or self.enable_prefix_caching, "the KV tiers below the pool need prefix caching"),
            (all(t in ("host", "disk") and v > 0 for t, v in self.kv_tier_bytes_per_s.items()),
             f"KV tier bandwidths must be host or disk, > 0: {self.kv_tier_bytes_per_s}"),
            (all(c in SERVICE_CLASSES and v >= 0 for c, v in self.class_mix.items())
             and (not self.class_mix or sum(self.class_mix.values()) > 0),
             f"class mix takes shares >= 0 of {', '.join(SERVICE_CLASSES)}, not all 0: {self.class_mix}"),
            (self.admission in ADMISSION_POLICIES, f"admission must be one of {', '.join(ADMISSION_POLICIES)}"),
            (self.role_switch_s >= 0, f"role switch time must be >= 0 s, got {self.role_switch_s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        for role, n in self.max_num_seqs.items():
            if role not in ("colocated", "prefill", "decode") or not isinstance(n, int) or n < 1:
                raise ConfigError(f"max_num_seqs: bad entry {role}={n}")


@dataclass
class SimStats:
    wall_s: float = 0.0  # real seconds the simulation took
    num_events: int = 0
    sim_end_s: float = 0.0
