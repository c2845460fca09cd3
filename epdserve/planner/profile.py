"""Step time of each role on this machine, measured on the real runner, and the fitted cost model.

A probe builds the engine for the model once and times ``ModelRunner.execute`` on synthetic
``SchedulerOutput`` steps whose block tables come from the real ``KVCacheManager``: the exact
step a worker runs, without the scheduler deciding its shape. Each role runs with the threads
its worker gets (``torch.set_num_threads`` and core pinning, restored afterwards):

    colocated  2 threads   prefill chunks, decode batches and mixed steps (decodes + a chunk)
    prefill    1 thread    prefill chunks (one or several prompts per step), each pushing its
                           KV into a shared-memory pool as a P/D prefill worker does
    decode     1 thread    decode batches x context lengths
    encode     1 thread    vision tower, 1..8 tiles of 512 x 512

A point is timed after one warm-up run, ``min_repeats`` .. ``max_repeats`` times (until
``min_time_s`` has passed; fewer, down to one, once its runs took ``max_point_s``; a first run
that long is the only one), and its median kept. The samples are fitted per role with
``StepCost.fit``; the file keeps samples and fit quality next to the coefficients.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from multiprocessing import resource_tracker
from types import ModuleType

import numpy as np
import torch

from epdserve.bench.experiments.report import cpu_busy_share, cpu_model
from epdserve.config import EngineArgs, resolve_device_name, resolve_dtype_name
from epdserve.engine.engine import LLMEngine
from epdserve.engine.kv_offload import probe_tiers
from epdserve.engine.step_shape import StepShape
from epdserve.errors import ConfigError
from epdserve.planner.profile_grid import ProfileGrid
from epdserve.planner.profile_neighbour import busy_neighbour
from epdserve.planner.step_probe import StepProbe, median_time_s
from epdserve.sim.cost_model import (
    PROFILE_VERSION,
    STEP_ROLES,
    CostModel,
    EncodeCost,
    RoleProfile,
    StepCost,
)
from epdserve.transfer.connector import KVPusher
from epdserve.transfer.shm_pool import SharedKVPool

ROLES = (*STEP_ROLES, "encode")
DEFAULT_THREADS = {"colocated": 2, "prefill": 1, "decode": 1, "encode": 1}  # one worker's cores here
KV_PEER_ID = "profile-kv-peer"  # the prefill role's stand-in decode worker
REMEASURE_ERROR = 0.05  # a point the fit misses by more than this (relative) is timed again
REMEASURE_SHARE = 0.25  # at most this share of a role's points


def role_cores(num_threads: int) -> tuple[int, ...]:
    """The cores a worker with ``num_threads`` threads is pinned to (the first ones, as
    ``cluster.local.assign_cores`` gives the first worker)."""
    cores = sorted(os.sched_getaffinity(0))
    return tuple(cores[i % len(cores)] for i in range(num_threads))


@contextlib.contextmanager
def worker_threads(num_threads: int) -> Iterator[None]:
    """Run the body as a worker with ``num_threads`` threads pinned to its cores, then restore."""
    old_threads, old_affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    os.sched_setaffinity(0, role_cores(num_threads))
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        os.sched_setaffinity(0, old_affinity)


@contextlib.contextmanager
def pushing_kv(probe: StepProbe) -> Iterator[SharedKVPool]:
    """While the body runs, every prefill entry pushes its KV layer by layer into a second pool
    in shared memory, as a P/D prefill worker writes into its decode worker's pages by default
    (shm, layer-wise): that copy is the prefill thread's own work, part of its step time.
    Yields the receiving pool."""
    runner = probe.engine.runner
    caches = runner.kv_caches
    pool = SharedKVPool.create(caches[0].shape[1], caches[0].shape[2], [tuple(c.shape[3:]) for c in caches],
                               caches[0].dtype)
    pusher = KVPusher(caches, runner.layer_to_group, runner.block_size, layerwise=True)
    try:
        pusher.add_peer(KV_PEER_ID, pool.endpoint())
        # Attaching in the creating process dropped the segment from this process's resource
        # tracker; register it again so the owner's unlink stays balanced.
        resource_tracker.register(pool.segment._name, "shared_memory")  # type: ignore[attr-defined]
        runner.pusher, probe.kv_target = pusher, KV_PEER_ID
        yield pool
    finally:
        runner.pusher, probe.kv_target = None, None
        pusher.close()
        pool.close()


@dataclass(frozen=True)
class ProfileTarget:
    """What to profile: the engine options the workers will serve with, the roles and their threads."""

    args: EngineArgs
    roles: tuple[str, ...]
    num_threads: dict[str, int]  # per role
    grid: ProfileGrid
    has_busy_neighbours: bool = False  # time each role next to a busy worker on the other cores
    temperature: float = 0.0  # sampling of the measured steps (0: greedy, bench's default)

    def __post_init__(self) -> None:
        if not self.roles:
            raise ConfigError(f"no role given; roles: {', '.join(ROLES)}")
        for role in self.roles:
            if role not in ROLES:
                raise ConfigError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")
            if self.num_threads.get(role, 0) < 1:
                raise ConfigError(f"role {role!r} needs at least 1 thread")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")


class Profiler:
    """Loads the model once, then measures every role of a ``ProfileTarget`` into a ``CostModel``."""

    def __init__(self, target: ProfileTarget) -> None:
        self.target = target
        # The probe's KV pool holds the grid's largest step; the profile records the pool the
        # serving options give a worker.
        num_probe_blocks = -(-target.grid.max_kv_tokens // target.args.block_size) + 64
        self.engine = LLMEngine(replace(target.args, num_kv_blocks=num_probe_blocks, enable_prefix_caching=False))
        self.probe = StepProbe(self.engine, target.args.seed, target.temperature)
        bytes_per_block = self.engine.runner.kv_cache_bytes // num_probe_blocks
        spec = self.engine.loaded.spec
        self.serving = target.args.resolve(spec.max_position_embeddings, bytes_per_block)
        self.kv_bytes_per_token = bytes_per_block // target.args.block_size
        # Per attention group (a window, or None): what a P/D transfer sends per token.
        dtype_bytes = self.engine.runner.kv_caches[0].element_size()
        self.kv_groups = tuple((g.sliding_window, g.bytes_per_block(target.args.block_size, dtype_bytes)
                                // target.args.block_size)
                               for g in self.engine.kv_cache.groups if g.kind in ("full", "sliding"))
        sched = self.serving.scheduler
        self.points = {
            role: target.grid.points(role, sched.max_num_batched_tokens, sched.max_num_seqs, sched.max_model_len)
            for role in target.roles if role in STEP_ROLES
        }
        self.encoder = load_encoder(target.args) if "encode" in target.roles else None

    @property
    def num_points(self) -> int:
        """Progress ticks of ``run``: every point, the re-measure budget, every encoder batch."""
        num_tiles = len(self.target.grid.encoder_tiles) if self.encoder is not None else 0
        return sum(len(p) + num_remeasured(len(p)) for p in self.points.values()) + num_tiles

    def measure_role(self, role: str, tick: Callable[[], None]) -> RoleProfile:
        """Time the role's points with its threads and fit its step cost.

        Other processes on the cores only ever add time, so the points the first fit misses
        most (relative error above ``REMEASURE_ERROR``, at most ``REMEASURE_SHARE`` of them)
        are timed once more and keep the faster median before the final fit.
        """
        points = self.points[role]
        grid = self.target.grid
        start = time.perf_counter()
        kv_push = pushing_kv(self.probe) if role == "prefill" else contextlib.nullcontext()
        with self.neighbour(role), worker_threads(self.target.num_threads[role]), kv_push:
            samples = []
            for point in points:
                samples.append(self.probe.measure(point, grid))
                tick()
            cost, _ = StepCost.fit(samples)
            # Steps of max_point_s and more are not timed again: their noise is small against
            # their length, and a second timing would cost as much as many short points.
            worst = [i for i in worst_fitted(samples, cost, num_remeasured(len(points)))
                     if samples[i][1] < grid.max_point_s]
            for i in worst:
                shape, time_s = self.probe.measure(points[i], grid)
                samples[i] = (shape, min(time_s, samples[i][1]))
                tick()
            for _ in range(num_remeasured(len(points)) - len(worst)):
                tick()
        cost, fit = StepCost.fit(samples)
        fit = {**fit, "num_remeasured": len(worst), "measure_s": time.perf_counter() - start}
        sched = self.serving.scheduler
        return RoleProfile(
            name=role, num_threads=self.target.num_threads[role], num_kv_blocks=self.serving.cache.num_blocks,
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
            step=cost, fit=fit, samples=tuple({**s.to_dict(), "time_s": t} for s, t in samples),
        )

    def neighbour(self, role: str) -> contextlib.AbstractContextManager:
        """A busy worker on the cores ``role`` leaves free, when the target asks for one."""
        if not self.target.has_busy_neighbours:
            return contextlib.nullcontext()
        used = set(role_cores(self.target.num_threads[role]))
        return busy_neighbour(self.target.args, tuple(c for c in sorted(os.sched_getaffinity(0)) if c not in used))

    def run(self, tick: Callable[[], None] = lambda: None) -> CostModel:
        """Measure every role; the host record notes how busy other work kept the CPUs just
        before (it inflates every timing)."""
        host = {**host_info(), "busy_share_at_start": cpu_busy_share()}
        roles = {role: self.measure_role(role, tick) for role in self.points}
        encode, embed_bytes = None, None
        if self.encoder is not None:
            with self.neighbour("encode"), worker_threads(self.target.num_threads["encode"]):
                encode, embed_bytes = self.encoder.measure(self.target.grid, self.target.num_threads["encode"], tick)
        # The reload rule's other side: the KV tiers' media, for blocks of this model's layout.
        kv_tiers = probe_tiers(self.target.args.kv_tiers, self.kv_bytes_per_token * self.serving.cache.block_size)
        spec = self.engine.loaded.spec
        raw = {
            "version": PROFILE_VERSION,
            "device": self.serving.device,
            "host": host,
            "has_busy_neighbours": self.target.has_busy_neighbours,
            "temperature": self.target.temperature,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "kv_tiers": kv_tiers,
        }
        return CostModel(
            model=spec.name, dtype=self.serving.dtype, block_size=self.serving.cache.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token, embed_bytes_per_token=embed_bytes,
            num_layers=spec.num_layers, roles=roles, encode=encode, raw=raw, kv_groups=self.kv_groups,
            kv_tiers={t: (e["bytes_per_s"], e["latency_s"]) for t, e in kv_tiers.items() if "bytes_per_s" in e},
        )


def num_remeasured(num_points: int) -> int:
    """How many of a role's points may be timed a second time."""
    return math.ceil(REMEASURE_SHARE * num_points)


def worst_fitted(samples: list[tuple[StepShape, float]], cost: StepCost, max_count: int) -> list[int]:
    """Indices of the samples ``cost`` misses by more than ``REMEASURE_ERROR``, worst first."""
    errors = [abs(cost.time_s(shape) - t) / t for shape, t in samples]
    order = sorted(range(len(samples)), key=lambda i: -errors[i])
    return [i for i in order[:max_count] if errors[i] > REMEASURE_ERROR]


def host_info() -> dict:
    """CPU model and the cores this process may use."""
    return {"cpu": cpu_model(), "num_cores": len(os.sched_getaffinity(0))}


def load_encoder(args: EngineArgs) -> EncoderProbe:
    """The vision tower's probe; ConfigError when this build has no vision encoder."""
    try:
        from epdserve.models import multimodal
    except ImportError:
        raise ConfigError(
            "the encode role needs the vision encoder (epdserve.models.multimodal), which is not available; "
            "profile without it: --roles colocated,prefill,decode"
        ) from None
    return EncoderProbe(multimodal, args)


def encoder_available() -> bool:
    """True when the vision encoder can be imported (the default roles then include encode)."""
    try:
        from epdserve.models import multimodal  # noqa: F401
    except ImportError:
        return False
    return True


class EncoderProbe:
    """Times the vision tower (+ connector) on batches of random 512 x 512 tiles."""

    def __init__(self, multimodal: ModuleType, args: EngineArgs) -> None:
        device_name = resolve_device_name(args.device)
        dtype = getattr(torch, resolve_dtype_name(args.dtype, device_name))
        device = torch.device(device_name)
        self.spec = multimodal.load_multimodal_spec(args.model)
        self.encoder = multimodal.load_vision_encoder(args.model, dtype, device, seed=args.seed)
        self._encode_images = multimodal.encode_images
        self._dtype_bytes = torch.tensor([], dtype=dtype).element_size()

    def measure(self, grid: ProfileGrid, num_threads: int, tick: Callable[[], None]) -> tuple[EncodeCost, int]:
        """The fitted encoder cost and the bytes of one embedding row (text hidden x dtype)."""
        size = self.spec.vision.image_size
        generator = torch.Generator().manual_seed(0)
        samples = []
        for num_tiles in grid.encoder_tiles:
            batch = [torch.rand(num_tiles, 3, size, size, generator=generator) * 2 - 1]  # normalised range
            samples.append((num_tiles, median_time_s(partial(self._encode_images, self.encoder, batch), grid)))
            tick()
        base_s, per_tile_s = fit_line(samples)
        cost = EncodeCost(
            num_threads=num_threads, tokens_per_tile=self.spec.vision.tokens_per_tile, base_s=base_s,
            per_tile_s=per_tile_s, samples=tuple({"num_tiles": n, "time_s": t} for n, t in samples),
        )
        return cost, self.spec.hidden_size * self._dtype_bytes


def fit_line(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``t = base + slope * x`` with both terms >= 0."""
    x = np.array([n for n, _ in samples], dtype=np.float64)
    y = np.array([t for _, t in samples], dtype=np.float64)
    if len(set(x.tolist())) > 1:
        slope, base = np.polyfit(x, y, 1)
        if slope >= 0 and base >= 0:
            return float(base), float(slope)
        if slope < 0:
            return float(max(y.mean(), 0.0)), 0.0
    return 0.0, float(max((x @ y) / (x @ x), 0.0))
