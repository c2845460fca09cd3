"""A worker process: one engine in a role (colocated, prefill or decode), driven by the router.

    epdserve worker --role prefill|decode|colocated --router tcp://HOST:PORT [engine options]

The worker registers with the router (role, pid, KV endpoint), sends heartbeats from a thread
of its own, and runs the engine loop: take control messages, run one step, report outputs and
finished KV transfers. The roles' classes:

- ``worker_base.WorkerBase``: the router link and the loop every worker kind shares;
- ``worker_llm.LLMWorker`` / ``ColocatedWorker``: an engine taking requests and images;
- ``worker_prefill.PrefillWorker``: pushes each prompt's KV to its decode worker, one link per
  decode worker, opened when the router announces the peer;
- ``worker_decode.DecodeWorker``: KV pages in shared memory (``shm``) or behind a TCP listener
  (``tcp``) so prefill workers can write them; reservations, and decoding once the KV landed;
- ``encode_worker.EncodeWorker``: the vision encoder only (``--role encode``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from epdserve.cluster.worker_base import run_process
from epdserve.cluster.worker_decode import DecodeWorker
from epdserve.cluster.worker_llm import ROLES, ColocatedWorker, LLMWorker, WorkerOptions
from epdserve.cluster.worker_prefill import PrefillWorker
from epdserve.config import EngineArgs
from epdserve.roles import Role

__all__ = ["ROLES", "WorkerOptions", "run_worker", "worker_class"]

_CLASSES: dict[Role, type[LLMWorker]] = {
    Role.COLOCATED: ColocatedWorker,
    Role.PREFILL: PrefillWorker,
    Role.DECODE: DecodeWorker,
}


def worker_class(role: str) -> type[LLMWorker]:
    """The worker class of an LLM role."""
    return _CLASSES[Role(role)]


def run_worker(opts: WorkerOptions, engine_args: EngineArgs) -> int:
    """The worker process's body; its exit status (0, or ``EXIT_FATAL`` after a fatal error).
    A ``SwitchRole`` from the router moves it to another LLM role in this process."""
    cls = worker_class(opts.role)
    return run_process(lambda: cls(opts, engine_args), opts.die_with_parent, _successor)


def _successor(worker: LLMWorker) -> Callable[[], LLMWorker]:
    """What builds ``worker`` again in the role a ``SwitchRole`` named: the same options and
    the loaded model (the weights stay; the KV pages, transfer resources and slab are new)."""
    role, opts, args, loaded = worker.next_role, worker.opts, worker.engine_args, worker.engine.loaded
    cls = worker_class(role)
    num_switches = worker.num_switches + 1
    return lambda: cls(replace(opts, role=str(role)), args, loaded, num_switches)
