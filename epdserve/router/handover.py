"""Handing a draining decode worker's running requests to the other decode workers.

A decode worker that leaves its role (role_switch.py) would otherwise hold the switch until
its longest generation ends. Each of its decoding paths moves instead, the way a prefill
worker hands a prompt over::

    DECODING ──Pause──▶ HANDING_OVER ──Paused(tokens)──▶ Reserve on a ready decode worker
        ▲                     │                              │ Reserved
        │ (it cannot pause:   │                              ▼
        │  it goes on there)  │                      HandOver: the source copies the KV of
        └─────────────────────┘                      prompt + tokens[:-1] into those blocks
                                                             │ TransferDone(ok)
                                                             ▼
                                       StartDecode(prompt + tokens[:-1], first = tokens[-1])
                                       on the target: DECODING there, the source lets it go

The client's stream does not notice: the target continues after the last token the source
streamed. A prompt still waiting at its prefill worker with its KV due on the draining worker
is re-pointed instead: its blocks are reserved on another decode worker and the prefill worker
sends the KV there (``Retarget``; refused once any of it may have gone, then it lands where it
was going and is handed over from there). Where a step fails (no ready decode worker, the reservation refused or late, the
copy failed, the target lost) the path falls back to recomputing: the paused request is
aborted on the source and the prompt with its tokens so far is submitted to a decode worker,
which computes it and continues (``_recompute``). Paths with images or a grammar are not
handed over (their state does not follow); they finish where they are.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from epdserve.cluster import messages as m
from epdserve.roles import Role
from epdserve.router.path import Mode, Path, Phase
from epdserve.router.workers import WorkerInfo, WorkerRegistry, WorkerState

if TYPE_CHECKING:
    from epdserve.router.channel import WorkerChannel
    from epdserve.router.config import RouterConfig
    from epdserve.router.metrics import RouterMetrics

log = logging.getLogger("epdserve.router")


class PathOwner(Protocol):
    """What the hand-over needs of the request flow (flow.py)."""

    paths: dict[str, Path]

    def fail(self, path: Path, message: str) -> None: ...


class DecodeHandover:
    def __init__(self, owner: PathOwner, channel: WorkerChannel, registry: WorkerRegistry, metrics: RouterMetrics,
                 config: RouterConfig) -> None:
        self.owner = owner
        self.channel = channel
        self.registry = registry
        self.metrics = metrics
        self.config = config
        self._links: dict[str, set[str]] = {}  # source -> decode workers it was told of (PeerUp)

    # -- starting ------------------------------------------------------------------------
    def hand_over_all(self, worker: WorkerInfo) -> None:
        """Begin handing over every decoding path of the draining decode ``worker``."""
        if worker.role != Role.DECODE or worker.state is not WorkerState.DRAINING:
            return
        for path_id in list(worker.request_ids):
            path = self.owner.paths.get(path_id)
            if path is None:
                continue
            if self.can_hand_over(path, worker.worker_id) and not path.no_handover:
                path.phase = Phase.HANDING_OVER
                path.handover_tokens = None
                self.channel.post(worker.worker_id, m.Pause(path_id))
                self._arm_timer(path)
            elif self.can_retarget(path, worker.worker_id) and not path.no_retarget:
                self._retarget(path)

    @staticmethod
    def can_hand_over(path: Path, source: str) -> bool:
        return (path.mode is Mode.PD and path.phase is Phase.DECODING and not path.done and path.decode == source
                and path.mm is None and path.params.grammar is None)

    @staticmethod
    def can_retarget(path: Path, decode: str) -> bool:
        """A prompt waiting at its prefill worker whose KV is to land on ``decode``."""
        return (path.mode is Mode.PD and path.phase is Phase.PREFILLING and not path.done and path.decode == decode
                and path.retarget_to is None and path.prefill is not None)

    def _retarget(self, path: Path) -> None:
        """Reserve the prompt's blocks on another decode worker; then ask its prefill worker
        to send the KV there (``on_retarget_reserved``, ``on_retargeted``)."""
        target = self.registry.pick(Role.DECODE, path.prompt_blocks)
        if target is None:
            return
        path.retarget_to = target.worker_id
        target.take(path.path_id)
        hashes = path.prompt_blocks.hashes(target.registration.block_size) if path.prompt_blocks else []
        self.channel.post(target.worker_id, m.Reserve(path.path_id, len(path.prompt_token_ids), hashes,
                                                      path.mm is not None, priority=path.params.priority))

    def on_retarget_reserved(self, path: Path, msg: m.Reserved) -> None:
        log.info("%s: %s reserved for it: %s", path.path_id, path.retarget_to, msg.ok or msg.reason)
        if not msg.ok or path.phase is not Phase.PREFILLING:
            if msg.ok:  # the prompt has moved on meanwhile (its first token came)
                self.channel.post(path.retarget_to, m.Abort(path.path_id))
            self._drop_retarget(path)
            return
        self.channel.post(path.prefill, m.Retarget(path.path_id, path.retarget_to, msg.block_ids, msg.generation,
                                                   msg.num_cached_tokens))

    def on_retargeted(self, sender: str, msg: m.Retargeted) -> None:
        path = self.owner.paths.get(msg.request_id)
        if path is None or path.done or path.retarget_to is None or sender != path.prefill:
            return
        log.info("%s: its KV goes to %s instead of %s: %s", path.path_id, path.retarget_to, path.decode,
                 "yes" if msg.ok else "no, it may have started")
        if not msg.ok:
            self.channel.post(path.retarget_to, m.Abort(path.path_id))
            self._drop_retarget(path)
            return
        old, new = path.decode, path.retarget_to
        self.channel.post(old, m.Abort(path.path_id))  # its reservation goes; its fence refuses late writes
        previous = self.registry.get(old)
        if previous is not None:
            previous.drop(path.path_id)
        path.decode, path.retarget_to = new, None
        self.metrics.handovers.labels("retargeted").inc()

    def _drop_retarget(self, path: Path) -> None:
        """The prompt stays with its decode worker (tried once)."""
        target = self.registry.get(path.retarget_to) if path.retarget_to else None
        if target is not None:
            target.drop(path.path_id)
        path.retarget_to = None
        path.no_retarget = True

    def _arm_timer(self, path: Path) -> None:
        if path.transfer_timer is not None:
            path.transfer_timer.cancel()
        path.transfer_timer = asyncio.get_running_loop().call_later(
            self.config.reserve_timeout_s + self.config.transfer_timeout_s, self.on_timeout, path)

    # -- worker events -------------------------------------------------------------------
    def on_paused(self, sender: str, msg: m.Paused) -> None:
        path = self.owner.paths.get(msg.request_id)
        if path is None or path.done or path.phase is not Phase.HANDING_OVER or sender != path.decode:
            return
        if not msg.ok or not msg.output_token_ids:
            path.phase = Phase.DECODING  # it goes on where it is; the worker drains it
            path.no_handover = True
            self._end_timer(path)
            return
        path.handover_tokens = list(msg.output_token_ids)
        target = self.registry.pick(Role.DECODE)
        if target is None:
            self._recompute(path, "no ready decode worker to take it")
            return
        path.handover_to = target.worker_id
        target.take(path.path_id)
        num_tokens = len(path.current_prompt) + len(path.handover_tokens) - 1
        self.channel.post(target.worker_id, m.Reserve(path.path_id, num_tokens))

    def on_reserved(self, path: Path, msg: m.Reserved) -> None:
        """The target's answer to the hand-over's reservation."""
        if path.handover_to is None or path.handover_tokens is None:
            return
        if not msg.ok:
            self._release_target(path)
            self._recompute(path, f"the target could not reserve: {msg.reason}")
            return
        source, target = path.decode, path.handover_to
        known = self._links.setdefault(source, set())
        if target not in known:
            endpoint = self.registry.get(target).endpoint if self.registry.get(target) else None
            if endpoint is None:
                self.channel.post(target, m.Abort(path.path_id))
                self._release_target(path)
                self._recompute(path, "the target offers no KV endpoint")
                return
            self.channel.post(source, m.PeerUp(target, endpoint))
            known.add(target)
        path.handover_generation = msg.generation
        self.channel.post(source, m.HandOver(path.path_id, target, msg.block_ids, msg.generation,
                                             msg.num_cached_tokens))

    def on_transfer_done(self, path: Path, sender: str, msg: m.TransferDone) -> None:
        """The source copied the paused request's KV into the target's blocks (or failed)."""
        if sender != path.decode or path.handover_to is None or path.handover_tokens is None:
            return
        self._end_timer(path)
        target = path.handover_to
        if not msg.ok:
            self.channel.post(target, m.Abort(path.path_id))
            self._release_target(path)
            self._recompute(path, msg.reason or "the KV copy failed")
            return
        tokens = path.handover_tokens
        done = len(tokens) - 1  # generated before; the target starts after the last one
        current = path.current_params
        params = replace(current, max_tokens=current.max_tokens - done, min_tokens=max(0, current.min_tokens - done))
        prompt = path.current_prompt + tokens[:-1]
        self.channel.post(target, m.StartDecode(path.path_id, prompt, tokens[-1], params,
                                                kv_via_tcp=msg.transport == "tcp"))
        self._move_to(path, target)
        path.decode_prompt, path.decode_params = prompt, params
        self.metrics.handovers.labels("moved").inc()
        self.metrics.kv_bytes.labels(msg.transport or "shm").inc(msg.kv_bytes)
        for group, num_bytes in msg.kv_bytes_by_group.items():
            self.metrics.kv_group_bytes.labels(group).inc(num_bytes)

    def on_target_lost(self, path: Path) -> None:
        """The worker it was moving to is gone: the source still holds it (paused)."""
        path.handover_to = None
        self._recompute(path, "the target decode worker was lost")

    def on_timeout(self, path: Path) -> None:
        path.transfer_timer = None
        if path.done or path.phase is not Phase.HANDING_OVER:
            return
        if path.handover_to is not None:
            self.channel.post(path.handover_to, m.Abort(path.path_id))
            self._release_target(path)
        if path.handover_tokens is None:
            # Paused never came back: the source is stuck or gone; its liveness decides.
            path.phase = Phase.DECODING
            return
        self._recompute(path, "the hand-over did not finish in time")

    # -- endings -------------------------------------------------------------------------
    def _recompute(self, path: Path, why: str) -> None:
        """Fall back: abort the paused request on the source and submit the prompt with its
        tokens so far to a decode worker (the least loaded ready one, else the source), which
        computes it and continues after them."""
        tokens = path.handover_tokens or []
        source = path.decode
        worker = self.registry.pick(Role.DECODE) or self.registry.get(source)
        if worker is None or not worker.is_serving:
            self.owner.fail(path, f"cannot hand the request over ({why}) and its decode worker is gone")
            return
        log.info("handing %s over by recomputing it on %s: %s", path.path_id, worker.worker_id, why)
        current = path.current_params
        params = replace(current, max_tokens=current.max_tokens - len(tokens),
                         min_tokens=max(0, current.min_tokens - len(tokens)))
        prompt = path.current_prompt + tokens
        self.channel.post(source, m.Abort(path.path_id))
        self._end_timer(path)
        if params.max_tokens < 1:
            self.owner.fail(path, f"cannot hand the request over ({why})")
            return
        path.no_handover = worker.worker_id == source  # it stays on the draining worker: no second try
        self._move_to(path, worker.worker_id, len(prompt))
        path.decode_prompt, path.decode_params = prompt, params
        if not self.channel.post(worker.worker_id, m.Submit(path.path_id, prompt, params)):
            self.owner.fail(path, f"cannot hand the request over ({why})")
            return
        self.metrics.handovers.labels("recomputed").inc()

    def _move_to(self, path: Path, worker_id: str, num_prefill_tokens: int = 0) -> None:
        """The path runs on ``worker_id`` from now on; the source lets it go."""
        source = self.registry.get(path.decode) if path.decode else None
        if source is not None and source.worker_id != worker_id:
            source.drop(path.path_id)
        worker = self.registry.get(worker_id)
        if worker is not None and path.path_id not in worker.request_ids:
            worker.take(path.path_id, num_prefill_tokens, path.params.priority)
        path.decode = worker_id
        path.handover_to = path.handover_tokens = None
        path.phase = Phase.DECODING

    def _release_target(self, path: Path) -> None:
        target = self.registry.get(path.handover_to) if path.handover_to else None
        if target is not None:
            target.drop(path.path_id)
        path.handover_to = None

    @staticmethod
    def _end_timer(path: Path) -> None:
        if path.transfer_timer is not None:
            path.transfer_timer.cancel()
            path.transfer_timer = None

    def forget(self, worker_id: str) -> None:
        """A worker re-registered or left: the links it was told of are gone with it."""
        self._links.pop(worker_id, None)
        for known in self._links.values():
            known.discard(worker_id)
