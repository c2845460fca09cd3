"""Workers as Ray actors: ``epdserve serve --cluster ray``.

Ray places the processes and owns their lifetime; everything else is what it is on one
machine. Each worker is an actor whose one long call runs the same ``epdserve worker`` loop,
registering with the router over the same authenticated socket (the router's address must be
one the nodes reach: ``--router-host``, by default this node's address). The cluster secret
travels in the actor's runtime environment (``EPDSERVE_CLUSTER_KEY``), the Ray node id in
``EPDSERVE_NODE_ID``: two workers on one node write each other's memory directly, workers on
different nodes go over TCP to the address of the node they run on.

Placement: ``spread`` (Ray's SPREAD strategy), ``pack`` (Ray's default hybrid policy: a node
fills to half its CPUs before the next is used) or
``by-label`` (a role's workers only on nodes labelled with it, ``ray start --labels
epdserve-role=prefill``). ``--cores-per-worker`` is the actor's CPU reservation and its thread
count. An actor that dies (its process, or its node) is restarted by Ray at most
``max_restarts`` times; the restarted worker registers again under its id. The router hears of
the loss by the worker's missed heartbeats, and fails its requests then.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

from epdserve.envs import EPDSERVE_CLUSTER_KEY, EPDSERVE_NODE_ID
from epdserve.errors import ConfigError

log = logging.getLogger("epdserve.ray")

PLACEMENTS = ("spread", "pack", "by-label")
ROLE_LABEL = "epdserve-role"
_ACTOR_PREFIX = "epdserve-"


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--cluster ray needs Ray: pip install -e '.[ray]'") from None
    return ray


class _WorkerActor:
    """One worker process (a Ray actor); ``run`` is the worker's whole life."""

    def __init__(self, argv: list[str], log_path: str | None) -> None:
        self.argv = argv
        self.log_path = log_path

    def node(self) -> tuple[str, str, int]:
        """(Ray node id, node address, pid) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def run(self) -> int:
        """Run the worker loop until it is told to stop (0). A worker that failed (a fatal
        error, a start-up error) ends the actor's process, so Ray restarts it."""
        import ray

        from epdserve.cluster.worker_cli import run_worker_argv

        os.environ[EPDSERVE_NODE_ID] = ray.get_runtime_context().get_node_id()
        if self.log_path:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
        argv = [*self.argv, "--kv-host", ray.util.get_node_ip_address()]
        rc = run_worker_argv(argv)
        if rc:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return 0


@dataclass
class RayWorker:
    worker_id: str
    role: str
    actor: object
    run_ref: object  # the actor's run() call: ready when the worker stopped for good


@dataclass
class RayWorkers:
    """The server's workers on a Ray cluster."""

    key: bytes
    placement: str = "spread"
    cores_per_worker: int = 1
    max_restarts: int = 5
    workers: list[RayWorker] = field(default_factory=list)
    started_ray: bool = False
    actor_class: object = None  # ray.remote(_WorkerActor), made once

    @classmethod
    def connect(cls, address: str, key: bytes, placement: str, cores_per_worker: int,
                max_restarts: int) -> RayWorkers:
        """Join the Ray cluster at ``address`` ('auto': the one running here, else a new
        local one)."""
        ray = _import_ray()
        if placement not in PLACEMENTS:
            raise ConfigError(f"--placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        started = False
        if not ray.is_initialized():
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            except ConnectionError:
                if address != "auto":
                    raise ConfigError(f"cannot reach the Ray cluster at {address}") from None
                ray.init(include_dashboard=False, log_to_driver=False)
                started = True
        return cls(key, placement, cores_per_worker, max_restarts, started_ray=started,
                   actor_class=ray.remote(_WorkerActor))

    @staticmethod
    def node_address() -> str:
        """This node's address in the Ray cluster (where the router binds by default)."""
        ray = _import_ray()
        return ray.util.get_node_ip_address()

    def start(self, worker_id: str, role: str, router_address: str, worker_args: list[str],
              log_path: str | None = None) -> RayWorker:
        options: dict = {
            "name": f"{_ACTOR_PREFIX}{worker_id}-{os.getpid()}",
            "num_cpus": self.cores_per_worker,
            "max_restarts": self.max_restarts,
            "max_task_retries": -1 if self.max_restarts else 0,
            "runtime_env": {"env_vars": {EPDSERVE_CLUSTER_KEY: self.key.hex(),
                                         "OMP_NUM_THREADS": str(self.cores_per_worker)}},
        }
        if self.placement == "spread":
            options["scheduling_strategy"] = "SPREAD"
        elif self.placement == "by-label":
            options["label_selector"] = {ROLE_LABEL: role}
        argv = ["--role", role, "--router", router_address, "--worker-id", worker_id, *worker_args]
        actor = self.actor_class.options(**options).remote(argv, log_path)
        worker = RayWorker(worker_id, role, actor, actor.run.remote())
        self.workers.append(worker)
        return worker

    def stopped(self) -> list[str]:
        """Workers whose actor ended for good (stopped, or out of restarts)."""
        ray = _import_ray()
        refs = [w.run_ref for w in self.workers]
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready_ids = {id(r) for r in ready}
        return [w.worker_id for w in self.workers if id(w.run_ref) in ready_ids]

    def stop(self, timeout_s: float = 10.0) -> None:
        """After the router told the workers to shut down: wait for their loops to end, then
        end the actors (and the Ray instance this server started)."""
        ray = _import_ray()
        refs = [w.run_ref for w in self.workers]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for worker in self.workers:
            try:
                ray.kill(worker.actor, no_restart=True)
            except Exception as e:  # already gone
                log.debug("killing %s: %s", worker.worker_id, e)
        self.workers.clear()
        if self.started_ray:
            ray.shutdown()
