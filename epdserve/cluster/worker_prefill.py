"""A prefill worker: computes prompts and pushes their KV into decode workers' pages.

It keeps one link per decode worker (``PeerUp`` opens it, ``PeerDown`` closes it). A request
with a ``kv_target`` holds its blocks here until its transfer ends; the router hears of every
such request exactly once by ``TransferDone`` (sent, ok, failed or aborted), after which
nothing more is written into the decode worker's blocks for it.
"""

from __future__ import annotations

import logging

from epdserve.cluster import messages as m
from epdserve.cluster.router_link import MalformedFrame
from epdserve.cluster.worker_base import Handler
from epdserve.cluster.worker_llm import LLMWorker, WorkerOptions
from epdserve.config import EngineArgs
from epdserve.models.loader import LoadedModel
from epdserve.request import MMInput
from epdserve.roles import Role

log = logging.getLogger("epdserve.worker")


class PrefillWorker(LLMWorker):
    role = Role.PREFILL
    outputs_end_at_first_token = True
    shares_kv_pages = True

    def __init__(self, opts: WorkerOptions, engine_args: EngineArgs, loaded: LoadedModel | None = None,
                 num_switches: int = 0) -> None:
        super().__init__(opts, engine_args, loaded, num_switches)
        self._prefill_ids: set[str] = set()  # P/D prefills whose TransferDone is still due
        self.pusher = self.engine.attach_kv_pusher(opts.layerwise)
        self.pusher.stall = opts.stall_kv_transfers

    def _transfer_load(self) -> dict:
        pusher = self.pusher
        return {"kv_bytes_sent": pusher.num_bytes_sent, "kv_seconds_sent": pusher.seconds_sending,
                "num_kv_writes_refused": pusher.num_refused_writes}

    # -- messages ------------------------------------------------------------------------
    def _handlers(self) -> dict[type, Handler]:
        return {**super()._handlers(), m.PeerUp: self._on_peer_up,
                m.PeerDown: lambda msg: self.pusher.remove_peer(msg.worker_id), m.Retarget: self._on_retarget}

    def _on_retarget(self, msg: m.Retarget) -> None:
        ok = (msg.request_id in self._prefill_ids and msg.target in self.pusher.links
              and self.engine.retarget_prefill(msg.request_id, msg.target, msg.target_block_ids,
                                               msg.target_generation, msg.target_num_cached))
        self._send(m.Retargeted(msg.request_id, ok))

    def _on_peer_up(self, msg: m.PeerUp) -> None:
        try:
            self.pusher.add_peer(msg.worker_id, msg.endpoint, self.key)
        except (OSError, ValueError) as e:
            # Transfers to this peer then fail one by one; the worker keeps serving.
            log.warning("cannot reach decode worker %s: %s", msg.worker_id, e)

    def _on_malformed(self, msg: MalformedFrame) -> None:
        if msg.kind == "Submit" and msg.kv_target:
            self._prefill_ids.add(msg.request_id)  # its TransferDone is due
        super()._on_malformed(msg)

    def _add_request(self, msg: m.Submit, mm_inputs: list[MMInput] | None) -> None:
        if not msg.kv_target:
            super()._add_request(msg, mm_inputs)
            return
        self.engine.add_prefill_request(
            msg.request_id, msg.prompt_token_ids, msg.sampling, msg.kv_target, msg.kv_target_block_ids,
            mm_inputs, msg.mm_pipelined, msg.kv_target_generation, msg.kv_target_num_cached,
        )
        self._prefill_ids.add(msg.request_id)

    def _fail_message(self, msg: m.Message | MalformedFrame, exc: Exception) -> None:
        if isinstance(msg, m.Submit) and msg.kv_target and msg.request_id:
            self._prefill_ids.add(msg.request_id)  # its TransferDone is due, however far it got
        super()._fail_message(msg, exc)

    def _fail_request(self, request_id: str, message: str) -> None:
        """A P/D prefill whose TransferDone is still due sends it now, once: nothing more is
        written into the decode worker's blocks for it."""
        super()._fail_request(request_id, message)
        if request_id in self._prefill_ids:
            self._prefill_ids.discard(request_id)
            self._send(m.TransferDone(request_id, False, reason=message))

    def _drop(self, request_id: str) -> None:
        super()._drop(request_id)
        # Confirms, even for a request never seen, that from here on nothing is written into
        # the decode worker's blocks for it.
        self._prefill_ids.discard(request_id)
        self._send(m.TransferDone(request_id, False, reason="aborted"))

    def _held_request_ids(self) -> set[str]:
        return super()._held_request_ids() | self._prefill_ids

    # -- the loop ------------------------------------------------------------------------
    def _idle_timeout_ms(self) -> int:
        return 5 if self.engine.is_transferring() else super()._idle_timeout_ms()  # poll transfers

    def _after_step(self) -> None:
        super()._after_step()
        for stats in self.engine.poll_transfers():
            self._prefill_ids.discard(stats.request_id)
            self._send(m.TransferDone(
                stats.request_id, stats.ok, stats.kv_bytes, stats.kv_bytes_skipped, stats.start, stats.end,
                stats.exposed_s, stats.blocking_s, "" if stats.ok else "KV transfer failed", stats.transport,
                self.engine.kv_bytes_by_group(stats),
            ))

    def _release(self) -> None:
        self.pusher.close()
        super()._release()
