"""The router: admits requests and runs each over the ready workers; the face the HTTP API
(api.py) and ``epdserve serve`` (serve.py) use.

    open(request)   admission (admission.py), then start its paths (flow.py)
    abort(id)       the client went away
    close()         shut the workers down

Inside: the socket to the workers (channel.py), what each worker message does and who is
alive (dispatch.py), the request path state machine (flow.py), and the encode stage's slab
space and jobs (encode_stage.py). A request's paths, its phases and how it fails are in
flow.py; which worker serves it is ``WorkerRegistry.pick`` (workers.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from epdserve.cluster import messages as m
from epdserve.gc_heap import GCPauseObserver
from epdserve.request import EventType
from epdserve.roles import Role
from epdserve.router import admission
from epdserve.router.admission import Overloaded
from epdserve.router.channel import WorkerChannel
from epdserve.router.config import RouterConfig
from epdserve.router.dispatch import Dispatcher
from epdserve.router.flow import RequestFlow
from epdserve.router.images import ImageInput
from epdserve.router.metrics import RouterMetrics
from epdserve.router.path import Mode, RequestHandle
from epdserve.router.role_control import RoleController, Switch
from epdserve.router.role_switch import SwitchRefused
from epdserve.router.workers import WorkerInfo, WorkerRegistry, WorkerState
from epdserve.sampling import SamplingParams
from epdserve.service import class_of_key

log = logging.getLogger("epdserve.router")

MAX_SWITCH_LOG = 1000


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f} ms"


class Router:
    def __init__(self, key: bytes, config: RouterConfig | None = None, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        """``key``: the cluster secret workers prove (epdserve/auth.py); ``host``/``port``: where
        the worker socket binds."""
        self.config = config or RouterConfig()
        self.registry = WorkerRegistry(self.config.routing, self.config.routing_ttft_slo_s)
        self.metrics = RouterMetrics()
        self.gc_observer = GCPauseObserver(self.metrics.observe_gc_pause)
        self.channel = WorkerChannel(key, host, port)
        self.address = self.channel.address
        self.flow = RequestFlow(self.config, self.channel, self.registry, self.metrics)
        self.encode = self.flow.encode
        self.dispatcher = Dispatcher(self.config, self.channel, self.registry, self.metrics, self.flow)
        self._tasks: list[asyncio.Task] = []
        self.metrics.pending.set_function(lambda: len(self.flow.handles))
        self.metrics.paths.set_function(lambda: len(self.flow.paths))
        for role in Role:
            for state in WorkerState:
                self.metrics.workers_by_role.labels(role, state.value).set_function(
                    lambda role=role, state=state: self._count(role, state))
        # --role-switching auto: the controller, fed the latencies the flow observes
        self.role_controller: RoleController | None = None
        self.switch_log: list[dict] = []  # switches begun: when, which, why (the newest MAX_SWITCH_LOG)
        if self.config.role_switching == "auto":
            self.role_controller = self.flow.role_controller = RoleController(self.config.role_control)
        self.dispatcher.switcher.on_switched = self._on_switched

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self.channel.serve(self.dispatcher.handle), name="router-recv"),
            asyncio.create_task(self.dispatcher.liveness_loop(), name="router-liveness"),
        ]
        if self.role_controller is not None:
            self._tasks.append(asyncio.create_task(self._role_control_loop(), name="router-role-control"))

    async def close(self) -> None:
        for worker in self.registry.workers.values():
            if worker.state in (WorkerState.READY, WorkerState.DRAINING, WorkerState.SWITCHING):
                self.channel.post(worker.worker_id, m.Shutdown())
        for task in self._tasks:
            task.cancel()
        self.dispatcher.close()
        self.channel.close()
        self.gc_observer.close()

    async def wait_for_workers(
        self, roles: dict[str, int], timeout_s: float, alive: Callable[[], bool] = lambda: True
    ) -> bool:
        """True once ``roles`` have registered; False at the deadline, or as soon as
        ``alive()`` says a worker process has exited (checked every half second)."""
        deadline = time.monotonic() + timeout_s
        registered = self.dispatcher.registered
        while True:
            counts = self.registry.count_ready()
            if all(counts.get(r, 0) >= k for r, k in roles.items()):
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not alive():
                return False
            registered.clear()
            try:
                await asyncio.wait_for(registered.wait(), min(remaining, 0.5))
            except asyncio.TimeoutError:
                continue

    def watch_process(self, worker_id: str, pid: int) -> None:
        self.dispatcher.watch_process(worker_id, pid)

    # -- requests ------------------------------------------------------------------------
    def mode(self) -> Mode | None:
        """How a request admitted now would run: P/D when prefill and decode workers are ready,
        else colocated when one is; None when nothing can serve."""
        counts = self.registry.count_ready()
        if counts.get(Role.PREFILL) and counts.get(Role.DECODE):
            return Mode.PD
        if counts.get(Role.COLOCATED):
            return Mode.COLOCATED
        return None

    async def open(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: list[ImageInput] | None = None,
        arrived: float | None = None,
    ) -> RequestHandle:
        """Admit a request and start it; raises Overloaded (429/503) when it cannot run now."""
        flow = self.flow
        images = images or []
        service_class = class_of_key(params.priority)
        flow.traffic.arrived(request_id, len(prompt_token_ids), params.max_tokens * params.n, service_class, arrived)
        try:
            rejection = admission.check_pending(len(flow.handles), self.config.max_pending)
            if rejection is not None:
                raise Overloaded(rejection)
            mode = self.mode()
            if mode is None:
                raise Overloaded(admission.no_workers())
        except Overloaded as e:
            flow.traffic.finished(request_id, None)
            self.metrics.rejected.labels(e.rejection.reason).inc()
            raise
        handle = RequestHandle(request_id, params.n, len(prompt_token_ids), service_class=service_class)
        handle.timing.service_class = handle.service_class
        handle.timing.record(EventType.ARRIVED, arrived or time.time())
        handle.timing.num_images = len(images)
        flow.handles[request_id] = handle
        try:
            if mode is Mode.COLOCATED:
                flow.start_colocated(handle, prompt_token_ids, params, images)
            else:
                await flow.start_pd(handle, prompt_token_ids, params, images)
        except BaseException as e:
            # Whatever stopped the start (a refusal, a send that failed, the client's task
            # cancelled while a reservation was pending): nothing of the request stays behind.
            flow.abort(handle)
            if isinstance(e, Overloaded):
                self.metrics.rejected.labels(e.rejection.reason).inc()
                raise
            if isinstance(e, asyncio.CancelledError):
                raise
            log.exception("cannot start request %s", request_id)
            rejection = admission.start_failed(e)
            self.metrics.rejected.labels(rejection.reason).inc()
            raise Overloaded(rejection) from None
        flow.arm_first_token_deadline(handle)
        handle.timing.record(EventType.ADMITTED, time.time())
        self.metrics.prompt_tokens.inc(len(prompt_token_ids) * params.n)
        self.metrics.images.inc(len(images))
        return handle

    def abort(self, request_id: str) -> None:
        """The client went away (or gave up): stop the request on every worker."""
        handle = self.flow.handles.get(request_id)
        if handle is None:
            return
        self.flow.abort(handle)
        self.metrics.requests.labels("aborted").inc()

    # -- roles ---------------------------------------------------------------------------
    def switch_role(self, worker_id: str, role: str, reason: str = "requested") -> WorkerInfo:
        """Begin moving a worker to ``role`` (role_switch.py); ``SwitchRefused`` says why not."""
        if self.config.role_switching == "off":
            raise SwitchRefused("role switching is off (epdserve serve --role-switching manual|auto)")
        worker = self.dispatcher.switcher.begin(worker_id, role)
        self.switch_log.append({"time": time.time(), "worker": worker_id, "from_role": str(worker.role),
                                "to_role": str(role), "reason": reason})
        del self.switch_log[:-MAX_SWITCH_LOG]
        return worker

    def _on_switched(self, worker: WorkerInfo) -> None:
        if self.role_controller is not None:
            self.role_controller.on_switched(time.monotonic())

    async def _role_control_loop(self) -> None:
        controller = self.role_controller
        while True:
            await asyncio.sleep(controller.config.interval_s)
            for switch in controller.decide(time.monotonic(), list(self.registry.workers.values())):
                self._begin_switch(switch)

    def _begin_switch(self, switch: Switch) -> None:
        p = switch.pressure
        reason = (f"controller: prefill pressure {p.prefill:.2f}, decode pressure {p.decode:.2f} "
                  f"(TTFT P90 {_ms(p.ttft_p90_s)}, ITL P90 {_ms(p.itl_p90_s)}, queued prefill "
                  f"{p.queued_prefill_s * 1e3:.0f} ms, KV in use {p.kv_usage:.0%})")
        try:
            self.switch_role(switch.worker_id, switch.to_role, reason)
        except SwitchRefused as e:  # it changed state between the decision and now
            log.info("role controller: %s", e)
            return
        log.info("worker %s: %s -> %s; %s", switch.worker_id, switch.from_role, switch.to_role, reason)

    def _count(self, role: str, state: WorkerState) -> int:
        return sum(1 for w in self.registry.workers.values() if w.role == role and w.state is state)

    def roles_json(self) -> dict:
        """``GET /v1/roles``: the workers per role and state, the controller's last reading, and
        the switches begun."""
        counts: dict[str, dict[str, int]] = {}
        for w in self.registry.workers.values():
            counts.setdefault(str(w.role), {}).setdefault(w.state.value, 0)
            counts[str(w.role)][w.state.value] += 1
        controller = self.role_controller
        pressure = controller.last_pressure if controller is not None else None
        return {"role_switching": self.config.role_switching, "workers": counts,
                "pressure": pressure.as_json() if pressure is not None else None,
                "switches": list(self.switch_log)}

    @property
    def handles(self) -> dict[str, RequestHandle]:
        return self.flow.handles

    def workers_json(self) -> list[dict]:
        """``/v1/workers``: every worker the router knows, with its load and slab space."""
        return [w.as_json() | self.encode.worker_json(w.worker_id) | self.registry.prefix_json(w.worker_id)
                for w in self.registry.workers.values()]
