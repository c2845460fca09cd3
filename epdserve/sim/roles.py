"""Role switching in the simulator: the router's controller and switch rules on simulated
instances, so a policy is tried on a hundred instances before it runs live.

The controller is ``router/role_control.py``'s ``RoleController``, fed what the router feeds
it: each request's TTFT at its first token, and the gap each decode step puts between the
tokens of the requests it ran (one sample per step, weighted by its requests: the router sees
one gap per request). It decides every ``interval_s`` on the instances' ``WorkerInfo`` (their
load from the heartbeats, their queued prompt tokens). A switch follows the router's path
(``role_switch.py``): ``check_switch``, then DRAINING (the registry picks it no more), then,
once the instance holds nothing, SWITCHING for ``switch_s`` (the measured time a worker takes
to rebuild its role and register), then a fresh instance of the new role in its place (same
id, host and position; empty pool, as a real switch leaves it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from epdserve.roles import Role
from epdserve.router.role_control import RoleControlConfig, RoleController, Switch
from epdserve.router.role_switch import SwitchRefused, check_switch
from epdserve.router.workers import WorkerRegistry, WorkerState
from epdserve.sim.instance import EncodeInstance, StepInstance

class SimRoleSwitching:
    def __init__(self, config: RoleControlConfig, switch_s: float, registry: WorkerRegistry,
                 instances: list[StepInstance | EncodeInstance], by_worker_id: dict[str, StepInstance | EncodeInstance],
                 schedule_switch: Callable[[float, StepInstance], None],
                 hand_over: Callable[[StepInstance], None] = lambda inst: None) -> None:
        """``instances``, ``by_worker_id``: the loop's own (it replaces a switched instance in
        them); ``schedule_switch(when, instance)``: the drained instance is back at ``when``;
        ``hand_over(instance)``: its decoding requests move to the other decode instances (as
        router/handover.py moves them)."""
        self.registry = registry
        self.instances = instances
        self.by_worker_id = by_worker_id
        self.schedule_switch = schedule_switch
        self.hand_over = hand_over
        self.controller = RoleController(config)
        self.switch_s = switch_s
        self.next_decision = config.interval_s
        self.draining: dict[str, StepInstance] = {}  # DRAINING instances by worker id
        self.switches: list[dict] = []  # each switch: when it began and ended, which, why

    # -- what the controller is told -------------------------------------------------------
    def observe_ttft(self, now: float, seconds: float) -> None:
        self.controller.observe_ttft(now, seconds)

    def observe_decode_step(self, end: float, step_s: float, num_seqs: int) -> None:
        if num_seqs:
            self.controller.observe_itl(end, step_s, num_seqs)

    # -- the loop's hooks ----------------------------------------------------------------
    def on_heartbeat(self, now: float) -> None:
        if self.draining:
            self.poll(now)
        if now < self.next_decision:
            return
        self.next_decision = now + self.controller.config.interval_s
        workers = [inst.worker for inst in self.instances if inst.role != Role.ENCODE]
        for switch in self.controller.decide(now, workers):
            self._begin(now, switch)

    def _begin(self, now: float, switch: Switch) -> None:
        try:
            worker = check_switch(self.registry, switch.worker_id, switch.to_role)
        except SwitchRefused:
            return
        worker.state = WorkerState.DRAINING
        worker.switch_to = Role(switch.to_role)
        worker.switch_began = now
        inst = self.draining[worker.worker_id] = self.by_worker_id[worker.worker_id]
        if inst.role == Role.DECODE:
            self.hand_over(inst)
        p = switch.pressure
        self.switches.append({"began_s": now, "ended_s": None, "worker": worker.worker_id,
                              "from_role": switch.from_role, "to_role": switch.to_role,
                              "prefill_pressure": round(p.prefill, 3), "decode_pressure": round(p.decode, 3)})
        self.poll(now)

    def poll(self, now: float) -> None:
        """Each draining instance that holds nothing now starts its switch."""
        for worker_id, inst in list(self.draining.items()):
            if inst.worker.request_ids or inst.is_busy or inst.scheduler.holds_blocks():
                if inst.role == Role.DECODE and not inst.handover_pending and inst.scheduler.running:
                    self.hand_over(inst)  # what started decoding here since (the router's poll does this)
                continue
            del self.draining[worker_id]
            inst.worker.state = WorkerState.SWITCHING
            self.schedule_switch(now + self.switch_s, inst)

    def on_switched(self, now: float, inst: StepInstance) -> None:
        """The instance's new role is up (the loop put ``inst`` in its place)."""
        self.controller.on_switched(now)
        for entry in reversed(self.switches):
            if entry["worker"] == inst.worker.worker_id and entry["ended_s"] is None:
                entry["ended_s"] = now
                break

    def summary(self, end_s: float) -> dict:
        """The switches, and how long each role had how many instances (instance-seconds)."""
        return {"num_switches": len(self.switches), "switches": self.switches,
                "switch_s": self.switch_s,
                "last_pressure": (self.controller.last_pressure.as_json()
                                  if self.controller.last_pressure is not None else None),
                "draining_at_end": sorted(self.draining) if math.isfinite(end_s) else []}
