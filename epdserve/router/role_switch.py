"""Moving a worker to another role at run time, without restarting its process.

    begin(worker, role)   READY -> DRAINING: it gets no new request; what it holds runs out
    poll()                DRAINING and holding nothing -> SWITCHING: ``SwitchRole`` is sent, its
                          peers drop their links to it, its slab leaves the encode stage
    on_register(...)      SWITCHING, registered in the new role -> READY (a new worker of it)

The worker rebuilds its engine around the model it has loaded (new KV pages, transfer
endpoints and slab) and registers again under its id; the registration is then handled as any
other, so prefill workers hear of a new decode worker and the prefix index starts its pool
empty. Losing a DRAINING worker fails what it holds, as losing a READY one does; a SWITCHING
worker holds nothing, and one that has not registered again within ``register_timeout_s`` is
given up (``on_timeout``). Who decides to switch: ``role_control.py`` (``--role-switching
auto``) or an operator (``POST /v1/workers/{id}/role``, ``manual``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from epdserve.cluster import messages as m
from epdserve.errors import EpdserveError
from epdserve.roles import LLM_ROLES, Role
from epdserve.router.channel import WorkerChannel
from epdserve.router.metrics import RouterMetrics
from epdserve.router.workers import WorkerInfo, WorkerRegistry, WorkerState

log = logging.getLogger("epdserve.router")

ROLE_SWITCHING = ("off", "manual", "auto")  # epdserve serve --role-switching
DEFAULT_REGISTER_TIMEOUT_S = 60.0  # SwitchRole sent -> registered in the new role


class SwitchRefused(EpdserveError):
    """The switch cannot begin (the reason says why); nothing changed."""


def check_switch(registry: WorkerRegistry, worker_id: str, role: str) -> WorkerInfo:
    """The worker, when it may begin a switch to ``role`` now; else ``SwitchRefused`` (the
    router's rule, and the simulator's)."""
    if role not in LLM_ROLES:
        raise SwitchRefused(f"role must be one of {', '.join(LLM_ROLES)}, got {role!r}")
    worker = registry.get(worker_id)
    if worker is None:
        raise SwitchRefused(f"no worker {worker_id!r}")
    if worker.role not in LLM_ROLES:
        raise SwitchRefused(f"worker {worker_id} is a {worker.role} worker; only "
                            f"{', '.join(LLM_ROLES)} workers switch roles")
    if worker.state is not WorkerState.READY:
        raise SwitchRefused(f"worker {worker_id} is {worker.state.value}, not ready")
    if worker.role == role:
        raise SwitchRefused(f"worker {worker_id} is a {role} worker already")
    if len(registry.ready(worker.role)) < 2:
        raise SwitchRefused(f"worker {worker_id} is the last ready {worker.role} worker")
    return worker


class RoleSwitcher:
    def __init__(self, registry: WorkerRegistry, channel: WorkerChannel, metrics: RouterMetrics,
                 on_leave: Callable[[WorkerInfo], None], on_timeout: Callable[[str, str], None],
                 hand_over: Callable[[WorkerInfo], None] = lambda worker: None,
                 register_timeout_s: float = DEFAULT_REGISTER_TIMEOUT_S) -> None:
        """``on_leave(worker)``: its old role's resources are going (peers, slab);
        ``hand_over(worker)``: move what a draining decode worker runs to the others
        (handover.py), rather than wait for it to finish;
        ``on_timeout(worker_id, reason)``: give up a worker that did not come back;
        ``on_switched`` (set by the router): called with each worker that finished a switch."""
        self.registry = registry
        self.channel = channel
        self.metrics = metrics
        self.on_leave = on_leave
        self.hand_over = hand_over
        self.on_timeout = on_timeout
        self.register_timeout_s = register_timeout_s
        self.switching: dict[str, WorkerInfo] = {}  # DRAINING or SWITCHING, by id
        self.on_switched: Callable[[WorkerInfo], None] = lambda worker: None

    def begin(self, worker_id: str, role: str) -> WorkerInfo:
        """READY -> DRAINING toward ``role`` (``check_switch``'s refusals raise ``SwitchRefused``)."""
        worker = check_switch(self.registry, worker_id, role)
        worker.state = WorkerState.DRAINING
        worker.switch_to = Role(role)
        worker.switch_began = time.monotonic()
        self.switching[worker_id] = worker
        log.info("worker %s drains (%d requests in hand) to switch from %s to %s", worker_id,
                 len(worker.request_ids), worker.role, role)
        self.poll()
        return worker

    def poll(self) -> None:
        """Send ``SwitchRole`` to each draining worker that holds nothing now; give up those
        whose new registration is overdue."""
        if not self.switching:
            return
        now = time.monotonic()
        for worker in list(self.switching.values()):
            if worker.state is WorkerState.DRAINING and not worker.request_ids:
                self._send_switch(worker, now)
            elif worker.state is WorkerState.DRAINING:
                self.hand_over(worker)
            elif worker.state is WorkerState.SWITCHING and now - worker.switch_began > self.register_timeout_s:
                self.switching.pop(worker.worker_id, None)
                self.on_timeout(worker.worker_id, f"it did not register as a {worker.switch_to} worker within "
                                                  f"{self.register_timeout_s:g} s of switching")
            elif worker.state not in (WorkerState.DRAINING, WorkerState.SWITCHING):
                self.switching.pop(worker.worker_id, None)  # lost meanwhile (suspect, dead)

    def _send_switch(self, worker: WorkerInfo, now: float) -> None:
        worker.state = WorkerState.SWITCHING
        worker.switch_began = now  # the registration deadline counts from here
        self.on_leave(worker)
        self.metrics.forget_worker_role(worker.worker_id, worker.role)
        if not self.channel.post(worker.worker_id, m.SwitchRole(Role(worker.switch_to))):
            self.switching.pop(worker.worker_id, None)
            self.on_timeout(worker.worker_id, "it cannot be sent the switch of role")
            return
        log.info("worker %s switches from %s to %s", worker.worker_id, worker.role, worker.switch_to)

    def on_register(self, old: WorkerInfo | None, new: WorkerInfo) -> bool:
        """A registration of ``new`` under ``old``'s id: True when it completes ``old``'s
        switch (``new`` carries its history); False for any other registration."""
        if old is None or old.state is not WorkerState.SWITCHING:
            return False
        self.switching.pop(old.worker_id, None)
        if new.role != old.switch_to:
            log.warning("worker %s registered as %s, not the %s it switched to", new.worker_id, new.role,
                        old.switch_to)
        new.num_switches = old.num_switches + 1
        self.metrics.role_switches.labels(old.role, new.role).inc()
        log.info("worker %s is a %s worker now (%.2f s after it began switching)", new.worker_id, new.role,
                 time.monotonic() - old.switch_began)
        self.on_switched(new)
        return True
