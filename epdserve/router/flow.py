"""The request path state machine: every change of a path's phase happens here, in a method
named for the event that causes it (path.py draws the phases).

    start_colocated / start_pd      admitted: submit (colocated) or reserve, then submit (P/D)
    on_reserved                     the decode worker's answer to Reserve
    on_outputs -> _on_first_token   tokens; on P/D the prefill worker's first token
    on_transfer_done                the prefill worker stopped writing the path's KV (ok or not)
    on_transfer_timeout             the KV did not land in time (the transfer policy applies)
    on_reservation_expired          the decode worker gave the reservation's blocks back
    on_request_failed               a worker failed the path's request
    on_worker_lost                  a worker the path runs on was suspected or died
    on_first_token_timeout          no first token in time
    abort / fail                    the client left / the request failed

The first token is streamed the moment the prefill worker samples it. A decode worker's
reserved blocks are released only after the prefill worker has confirmed that it stopped
writing into them (TransferDone, ok or not), so no late write lands in reused pages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import msgspec

from epdserve.cluster import messages as m
from epdserve.request import EventType, hash_prompt_ids
from epdserve.roles import Role
from epdserve.router import admission
from epdserve.router.admission import Overloaded
from epdserve.router.channel import WorkerChannel
from epdserve.router.config import RouterConfig
from epdserve.router.encode_stage import EncodeStage
from epdserve.router.handover import DecodeHandover
from epdserve.router.images import ImageInput
from epdserve.router.metrics import RouterMetrics
from epdserve.router.path import Mode, Path, Phase, RequestHandle, StreamEvent
from epdserve.router.role_control import RoleController
from epdserve.router.traffic import TrafficLog
from epdserve.router.workers import PromptBlocks, WorkerInfo, WorkerRegistry
from epdserve.sampling import SamplingParams

log = logging.getLogger("epdserve.router")


class _ReservationRefused(Exception):
    pass


class RequestFlow:
    def __init__(self, config: RouterConfig, channel: WorkerChannel, registry: WorkerRegistry,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.channel = channel
        self.registry = registry
        self.metrics = metrics
        self.handles: dict[str, RequestHandle] = {}  # admitted requests not yet finished
        self.paths: dict[str, Path] = {}  # paths some worker, slab region or encode job still holds
        self.encode = EncodeStage(self, channel, registry, metrics, config.encode_pipelined)
        self.handover = DecodeHandover(self, channel, registry, metrics, config)
        self.role_controller: RoleController | None = None  # --role-switching auto: fed the latencies below
        self.traffic = TrafficLog()  # the arrival mix (GET /v1/traffic)

    # -- starting ------------------------------------------------------------------------
    def start_colocated(self, handle: RequestHandle, prompt: list[int], params: SamplingParams,
                        images: list[ImageInput]) -> None:
        is_predictive = self.config.admission == "predictive"
        prompt_blocks = (self._prompt_blocks(prompt, images)
                         if self.registry.routing == "prefix-aware" or is_predictive else None)
        if is_predictive:
            self._check_slo(Role.COLOCATED, handle, prompt_blocks, params)
        worker = self._pick_for_queue(Role.COLOCATED, prompt_blocks if self.registry.routing == "prefix-aware" else None)
        path = Path(handle.request_id, handle, None, prompt, params, Mode.COLOCATED, Phase.RUNNING,
                    colocated=worker.worker_id)
        refs = self.encode.place(path, worker, images) if images else []
        self._add_path(path, worker, len(prompt))
        self.channel.submit(worker.worker_id, m.Submit(path.path_id, prompt, params, images=refs,
                                                       mm_pipelined=self.config.encode_pipelined))
        self.encode.dispatch(path)

    async def start_pd(self, handle: RequestHandle, prompt: list[int], params: SamplingParams,
                       images: list[ImageInput]) -> None:
        """Reserve blocks on a decode worker for every sequence, then submit each to a prefill
        worker; on a refusal the caller aborts every path of the request."""
        prompt_blocks = self._prompt_blocks(prompt, images)
        paths = [Path(path_id, handle, index, prompt, seq_params, Mode.PD, prompt_blocks=prompt_blocks)
                 for index, (path_id, seq_params) in enumerate(params.split(handle.request_id))]
        if self.config.admission == "predictive":
            self._check_slo(Role.PREFILL, handle, prompt_blocks, params)
        for path in paths:
            await self._reserve(path, prompt_blocks, bool(images))
        for path in paths:
            prefill = self.registry.pick(Role.PREFILL, prompt_blocks)
            if prefill is None:
                raise Overloaded(admission.no_workers(Role.PREFILL))
            refs = self.encode.place(path, prefill, images) if images else []
            path.prefill = prefill.worker_id
            path.phase = Phase.PREFILLING
            prefill.take(path.path_id, len(prompt), params.priority)
            block_ids, generation, num_cached = path.reserved.result() if path.reserved else ([], 0, 0)
            handle.timing.num_decode_cached_tokens = max(handle.timing.num_decode_cached_tokens, num_cached)
            self.metrics.prefix_cached_tokens.labels(Role.DECODE).inc(num_cached)
            self.channel.submit(prefill.worker_id, m.Submit(
                path.path_id, prompt, path.params, kv_target=path.decode or "",
                kv_target_block_ids=block_ids, kv_target_generation=generation, kv_target_num_cached=num_cached,
                images=refs, mm_pipelined=self.config.encode_pipelined,
            ))
            self.encode.dispatch(path)

    @staticmethod
    def _prompt_blocks(prompt: list[int], images: list[ImageInput]) -> PromptBlocks:
        """The prompt's blocks by prefix-cache key (images by their content hash)."""
        return PromptBlocks(hash_prompt_ids(prompt, [(i.span.offset, i.span.length, i.content_hash) for i in images]))

    def _check_slo(self, role: str, handle: RequestHandle, prompt_blocks: PromptBlocks,
                   params: SamplingParams) -> None:
        """``--admission predictive``: refuse now what no worker of ``role`` is predicted to
        start within its class's TTFT SLO (``admission.check_predicted_ttft``)."""
        slo = self.config.class_slos.get(handle.service_class)
        if slo is None or slo.ttft_s is None:
            return
        predicted = self.registry.predict_ttft(role, prompt_blocks, params.priority)
        if predicted is not None:  # its first token tells how far off the prediction was
            handle.predicted_ttft_s = predicted / self.registry.ttft_correction.factor
        rejection = admission.check_predicted_ttft(handle.service_class, predicted, slo)
        if rejection is not None:
            raise Overloaded(rejection)

    def _pick_for_queue(self, role: str, prompt_blocks: PromptBlocks | None = None) -> WorkerInfo:
        worker = self.registry.pick(role, prompt_blocks)
        rejection = admission.check_worker_queue(worker, self.config.max_waiting_per_worker, role)
        if rejection is not None:
            raise Overloaded(rejection)
        return worker

    async def _reserve(self, path: Path, prompt_blocks: PromptBlocks, has_images: bool) -> None:
        """Reserve the path's blocks on a decode worker, naming the prompt's blocks by key so
        the worker reuses the ones it has cached; a full decode worker queues the reservation
        for up to ``decode_queue_timeout_s``."""
        decode = self._pick_for_queue(Role.DECODE, prompt_blocks)
        path.phase = Phase.RESERVING
        path.decode = decode.worker_id
        path.reserved = asyncio.get_running_loop().create_future()
        self._add_path(path, decode, 0)
        block_size = decode.registration.block_size
        hashes = prompt_blocks.hashes(block_size)
        max_wait_s = self.config.decode_queue_timeout_s
        self.channel.submit(decode.worker_id, m.Reserve(path.path_id, len(path.prompt_token_ids), hashes,
                                                        has_images, max_wait_s, path.params.priority))
        try:
            await asyncio.wait_for(asyncio.shield(path.reserved), max_wait_s + self.config.reserve_timeout_s)
        except asyncio.TimeoutError:
            raise Overloaded(admission.reservation_timeout()) from None
        except _ReservationRefused as e:
            raise Overloaded(admission.reservation_refused(str(e))) from None

    def _add_path(self, path: Path, worker: WorkerInfo, num_prefill_tokens: int) -> None:
        self.paths[path.path_id] = path
        path.handle.paths.append(path)
        worker.take(path.path_id, num_prefill_tokens, path.params.priority)

    def arm_first_token_deadline(self, handle: RequestHandle) -> None:
        if self.config.first_token_timeout_s:
            handle.first_token_timer = asyncio.get_running_loop().call_later(
                self.config.first_token_timeout_s, self.on_first_token_timeout, handle)

    # -- worker events -------------------------------------------------------------------
    def on_reserved(self, msg: m.Reserved) -> None:
        path = self.paths.get(msg.request_id)
        if path is not None and path.phase is Phase.HANDING_OVER and not path.done:
            self.handover.on_reserved(path, msg)
            return
        if path is not None and path.retarget_to is not None and not path.done:
            self.handover.on_retarget_reserved(path, msg)
            return
        if path is None or path.reserved is None or path.reserved.done():
            return
        if msg.ok:
            path.reserved.set_result((msg.block_ids, msg.generation, msg.num_cached_tokens))
        else:
            path.reserved.set_exception(_ReservationRefused(msg.reason))

    def on_outputs(self, msg: m.Outputs) -> None:
        now = time.time()
        worker = self.registry.get(msg.worker_id)
        for out in msg.outputs:
            if worker is not None:
                worker.prefilled(out.request_id)
            path = self.paths.get(out.request_id)
            if path is None or path.done:
                continue
            handle = path.handle
            if path.mode is Mode.PD:
                out = msgspec.structs.replace(out, index=path.index)
                if msg.worker_id == path.prefill and path.phase is Phase.PREFILLING:
                    out = self._on_first_token(path, out)
                elif msg.worker_id != path.decode or not (
                        path.phase is Phase.DECODING
                        or (path.phase is Phase.HANDING_OVER and path.handover_tokens is None)):
                    continue  # late output of a worker this path has left (e.g. after a recompute)
                elif out.finished:
                    self._finish_path(path)
            elif msg.worker_id != path.colocated:
                continue  # not the worker serving this path
            elif not handle.has_first_token and out.token_ids:
                handle.timing.num_cached_tokens = out.num_cached_tokens
                self._observe_kv_load(handle.timing, out.kv_load)
                self.metrics.prefix_cached_tokens.labels(Role.COLOCATED).inc(out.num_cached_tokens)
            self._observe_token(handle, out, now)
            if out.finished:
                handle.num_finished_outputs += 1
                if handle.num_finished_outputs >= handle.n:
                    if path.mode is Mode.COLOCATED:
                        self._finish_path(path)
                    self._complete(handle, now)
            handle.queue.put_nowait(StreamEvent(output=out))

    def _on_first_token(self, path: Path, out: m.TokenOutput) -> m.TokenOutput:
        timing = path.handle.timing
        self._observe_inline_encode(timing, out)
        timing.record(EventType.PREFILL_START, out.prefill_start)
        timing.record(EventType.PREFILL_END, out.prefill_end)
        timing.num_cached_tokens = out.num_cached_tokens
        self._observe_kv_load(timing, out.kv_load)
        self.metrics.prefix_cached_tokens.labels(Role.PREFILL).inc(out.num_cached_tokens)
        path.first_token_id = out.token_ids[0] if out.token_ids else None
        path.continues = out.finish_reason == "length" and path.params.max_tokens > 1
        if not path.continues:
            path.phase = Phase.DRAINING  # the answer is complete; blocks go when the transfer ends
            if path.transfer_done:
                self.channel.post(path.decode, m.Abort(path.path_id))
                self._finish_path(path)
            return out
        path.phase = Phase.TRANSFERRING
        if path.transfer_done:
            self._start_decode(path)
        else:
            loop = asyncio.get_running_loop()
            path.transfer_timer = loop.call_later(self.config.transfer_timeout_s, self.on_transfer_timeout, path)
        return msgspec.structs.replace(out, finished=False, finish_reason=None)

    def on_transfer_done(self, msg: m.TransferDone, sender: str = "") -> None:
        path = self.paths.get(msg.request_id)
        if path is None:
            return
        if path.phase is Phase.HANDING_OVER:
            if not path.done:
                self.handover.on_transfer_done(path, sender, msg)
            return
        path.transfer_done = True
        if path.transfer_timer is not None:
            path.transfer_timer.cancel()
            path.transfer_timer = None
        timing = path.handle.timing
        if msg.ok:
            timing.record(EventType.KV_TRANSFER_START, msg.transfer_start)
            timing.record(EventType.KV_TRANSFER_END, msg.transfer_end)
            path.kv_transport = msg.transport
            timing.kv_bytes += msg.kv_bytes
            timing.kv_bytes_skipped += msg.kv_bytes_skipped
            self.metrics.kv_bytes.labels(msg.transport or "shm").inc(msg.kv_bytes)
            for group, num_bytes in msg.kv_bytes_by_group.items():
                timing.kv_bytes_by_group[group] = timing.kv_bytes_by_group.get(group, 0) + num_bytes
                self.metrics.kv_group_bytes.labels(group).inc(num_bytes)
            self.metrics.kv_bytes_skipped.inc(msg.kv_bytes_skipped)
            self.metrics.kv_seconds.inc(max(0.0, msg.transfer_end - msg.transfer_start))
            self.metrics.kv_exposed.inc(msg.exposed_s)
            timing.kv_exposed_s = max(timing.kv_exposed_s, msg.exposed_s)
            timing.kv_blocking_s = max(timing.kv_blocking_s, msg.blocking_s)
        if path.done or path.phase is Phase.DRAINING:
            self.channel.post(path.decode, m.Abort(path.path_id))
            self._finish_path(path)
            return
        self._release(path, path.prefill)
        if path.phase is not Phase.TRANSFERRING:
            return  # the first token has not reached the router yet
        if msg.ok:
            self._start_decode(path)
        else:
            self._transfer_failed(path, msg.reason or "KV transfer failed")

    def _start_decode(self, path: Path) -> None:
        path.phase = Phase.DECODING
        path.handle.timing.record(EventType.DECODE_START, time.time())
        assert path.first_token_id is not None
        self.channel.post(path.decode, m.StartDecode(path.path_id, path.prompt_token_ids, path.first_token_id,
                                                     path.params, kv_via_tcp=path.kv_transport == "tcp"))

    def on_transfer_timeout(self, path: Path) -> None:
        path.transfer_timer = None
        if path.phase is Phase.TRANSFERRING and not path.transfer_done:
            self.channel.post(path.prefill, m.Abort(path.path_id))
            self._transfer_failed(path, f"KV transfer did not finish within {self.config.transfer_timeout_s:g} s")

    def on_reservation_expired(self, sender: str, msg: m.ReservationExpired) -> None:
        """The decode worker gave the reservation's blocks back (its KV did not land in time);
        writes for it are refused from now on. The prefill side stops, and the request fails or
        the decode worker computes the prompt itself (``transfer_policy``)."""
        path = self.paths.get(msg.request_id)
        if path is None or path.done or path.mode is not Mode.PD or sender != path.decode:
            return
        if path.phase is Phase.PREFILLING:
            self.channel.post(path.prefill, m.Abort(path.path_id))
            path.first_token_id = None
            self._transfer_failed(path, "the decode worker's KV reservation expired before the prompt's KV landed")
        elif path.phase is Phase.TRANSFERRING:
            self.channel.post(path.prefill, m.Abort(path.path_id))
            self._transfer_failed(path, "the decode worker's KV reservation expired before the KV landed")

    def _transfer_failed(self, path: Path, reason: str) -> None:
        decode = self.registry.get(path.decode) if path.decode else None
        # A prompt with images cannot be recomputed by a decode worker (it has no embeddings).
        if (self.config.transfer_policy == "recompute" and decode is not None and decode.is_serving
                and path.mm is None):
            # The decode worker computes the prompt itself and continues after the first token
            # (or from the prompt, when no first token came yet). Same id: the abort releases
            # the reservation before the new request arrives.
            path.phase = Phase.DECODING
            params, prompt = path.params, path.prompt_token_ids
            if path.first_token_id is not None:
                params = replace(params, max_tokens=params.max_tokens - 1, min_tokens=max(0, params.min_tokens - 1))
                prompt = prompt + [path.first_token_id]
            self.channel.post(decode.worker_id, m.Abort(path.path_id))
            if self.channel.post(decode.worker_id, m.Submit(path.path_id, prompt, params)):
                return
        self.fail(path, reason)

    def on_request_failed(self, msg: m.RequestFailed) -> None:
        path = self.paths.get(msg.request_id)
        if path is not None:
            self.fail(path, msg.message)

    def on_worker_lost(self, worker: WorkerInfo, reason: str) -> None:
        """``worker`` was suspected or died: every path it held stops, and its requests fail."""
        for path_id in list(worker.request_ids):
            path = self.paths.get(path_id)
            worker.drop(path_id)
            if path is None:
                continue
            if path.mode is Mode.PD and worker.role == Role.PREFILL:
                # It writes nothing more that could land: a dead process writes nothing, and a
                # paused or hung one that resumes finds the decode worker's fence closed
                # (transfer/fence.py). So the decode side need not wait for its TransferDone.
                path.transfer_done = True
                if path.done:
                    self.channel.post(path.decode, m.Abort(path.path_id))
                    self._release(path, path.decode)
                    continue
            if path.done:
                continue
            if path.mode is Mode.PD and worker.role == Role.DECODE and path.phase is Phase.DRAINING:
                path.done = True
                continue
            if path.phase is Phase.HANDING_OVER and worker.worker_id == path.handover_to:
                self.handover.on_target_lost(path)  # the source still holds it
                continue
            if worker.worker_id == path.retarget_to:
                path.retarget_to = None  # it goes on to its decode worker
                continue
            self.fail(path, f"{worker.role} worker {worker.worker_id} failed while serving this request ({reason})")

    def on_first_token_timeout(self, handle: RequestHandle) -> None:
        handle.first_token_timer = None
        if handle.request_id in self.handles and not handle.has_first_token:
            self._fail_handle(handle, f"no first token within {self.config.first_token_timeout_s:g} s "
                                      "(--first-token-timeout)", outcome="timeout")

    # -- ending --------------------------------------------------------------------------
    def abort(self, handle: RequestHandle) -> None:
        """Stop every path of the request on every worker and forget the request."""
        for path in list(handle.paths):
            self._abort_path(path)
        self.drop_handle(handle)

    def fail(self, path: Path, message: str) -> None:
        self._fail_handle(path.handle, message)

    def _fail_handle(self, handle: RequestHandle, message: str, outcome: str = "failed") -> None:
        """End the request with an error to its client; every path of it is stopped."""
        if handle.request_id in self.handles:
            handle.queue.put_nowait(StreamEvent(error=message))
            self.drop_handle(handle)
            self.metrics.requests.labels(outcome).inc()
        for other in list(handle.paths):
            self._abort_path(other)

    def _abort_path(self, path: Path) -> None:
        if path.reserved is not None and not path.reserved.done():
            path.reserved.set_exception(_ReservationRefused("request aborted"))
            path.reserved.exception()  # retrieved: no "never retrieved" warning
        if path.done:
            return
        path.done = True
        self.encode.abort(path)
        if path.transfer_timer is not None:
            path.transfer_timer.cancel()
        if path.mode is Mode.COLOCATED:
            self.channel.post(path.colocated, m.Abort(path.path_id))
            self._release(path, path.colocated)
            return
        prefill = self.registry.get(path.prefill) if path.prefill is not None else None
        prefill_alive = prefill is not None and prefill.is_serving
        if path.prefill is not None:
            self.channel.post(path.prefill, m.Abort(path.path_id))
        for other in (path.handover_to, path.retarget_to):
            if other is not None:
                self.channel.post(other, m.Abort(path.path_id))
                self._release(path, other)
        if path.decode is not None and (path.transfer_done or not prefill_alive or path.phase is Phase.RESERVING):
            self.channel.post(path.decode, m.Abort(path.path_id))
            self._release(path, path.decode)
            self._release(path, path.prefill)
        # Otherwise the decode worker's blocks are released when the prefill worker confirms
        # (TransferDone) that it no longer writes into them; the path stays indexed until then.

    def _finish_path(self, path: Path) -> None:
        path.done = True
        if path.transfer_timer is not None:
            path.transfer_timer.cancel()
        for worker_id in path.workers:
            self._release(path, worker_id)

    def _release(self, path: Path, worker_id: str | None) -> None:
        if worker_id is None:
            return
        worker = self.registry.get(worker_id)
        if worker is not None:
            worker.drop(path.path_id)
        if path.mm is not None and worker_id == path.mm.consumer:
            self.encode.on_consumer_done(path)
        self.forget_if_idle(path)

    def forget_if_idle(self, path: Path) -> None:
        """Drop the path from the index once no worker, slab region or encode job holds it."""
        if not self.encode.is_holding(path) and all(
            path.path_id not in w.request_ids for w in self.registry.workers.values()
        ):
            self.paths.pop(path.path_id, None)

    def drop_handle(self, handle: RequestHandle) -> None:
        if self.handles.pop(handle.request_id, None) is not None:
            self.traffic.finished(handle.request_id, handle.num_output_tokens if handle.has_first_token else None)
        if handle.first_token_timer is not None:
            handle.first_token_timer.cancel()
            handle.first_token_timer = None

    def _complete(self, handle: RequestHandle, now: float) -> None:
        handle.timing.record(EventType.FINISHED, now)
        self.metrics.e2e.observe(now - handle.timing.arrived)
        self.metrics.requests.labels("ok").inc()
        slo = self.config.class_slos.get(handle.service_class)
        if slo is None:
            outcome = "none"
        else:
            timing = handle.timing
            ttft_s = timing.first_token - timing.arrived if timing.first_token else None
            per_seq = handle.num_output_tokens / max(handle.n, 1)
            tpot_s = (now - timing.first_token) / (per_seq - 1) if timing.first_token and per_seq > 1 else None
            outcome = "met" if slo.is_met(ttft_s, tpot_s) else "missed"
        self.metrics.class_requests.labels(handle.service_class, outcome).inc()
        self.drop_handle(handle)

    # -- observations --------------------------------------------------------------------
    def _observe_token(self, handle: RequestHandle, out: m.TokenOutput, now: float) -> None:
        if not out.token_ids:
            return
        timing = handle.timing
        if not handle.has_first_token:
            self._observe_inline_encode(timing, out)
            timing.record(EventType.FIRST_TOKEN, now)
            if handle.first_token_timer is not None:
                handle.first_token_timer.cancel()
                handle.first_token_timer = None
            self.metrics.ttft.observe(now - timing.arrived)
            if handle.predicted_ttft_s is not None:
                self.registry.ttft_correction.observe(handle.predicted_ttft_s, now - timing.arrived)
            if self.role_controller is not None:
                self.role_controller.observe_ttft(time.monotonic(), now - timing.arrived)
            timing.record(EventType.PREFILL_START, out.prefill_start)
            if timing.prefill_start:
                self.metrics.queue_time.observe(max(0.0, timing.prefill_start - timing.arrived))
                timing.record(EventType.PREFILL_END, out.prefill_end)
        elif handle.last_token_time:
            self.metrics.itl.observe(now - handle.last_token_time)
            if self.role_controller is not None:
                self.role_controller.observe_itl(time.monotonic(), now - handle.last_token_time)
        handle.last_token_time = now
        handle.num_output_tokens += len(out.token_ids)
        self.metrics.generation_tokens.inc(len(out.token_ids))

    def _observe_kv_load(self, timing: m.Timing, load: m.KVLoad | None) -> None:
        timing.kv_load = load
        if load is not None:
            counter = self.metrics.kv_tier_tokens
            for kind, value in (("found", load.num_found_tokens), ("chosen", load.num_chosen_tokens),
                                ("host", load.num_host_tokens), ("disk", load.num_disk_tokens),
                                ("peer", load.num_peer_tokens)):
                counter.labels(kind).inc(value)

    @staticmethod
    def _observe_inline_encode(timing: m.Timing, out: m.TokenOutput) -> None:
        """A consumer that encoded the images itself reports when."""
        if out.encode_start and not timing.encode_start:
            timing.record(EventType.ENCODE_START, out.encode_start)
            timing.record(EventType.ENCODE_END, out.encode_end)
            timing.num_encoder_cache_hits = out.num_encoder_cache_hits
