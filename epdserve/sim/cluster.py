"""Discrete-event cluster simulator: the request path through router, instances and links.

The event loop, the instances and the heartbeat are ``loop.SimLoop``'s; this module handles
what happens to a request. Sampled tokens are a dummy id and requests stop at ``max_tokens``.

The router is the real one's rules: ``WorkerRegistry.pick`` on heartbeat-reported load,
``max_pending`` and per-worker queue limits (429), decode reservation refusal (503); a full
decode instance queues reservations (by service class and priority, then arrival) for up to
``decode_queue_timeout_s``, granted at its step ends as the decode worker does.
P/D: reserve on decode, naming the prompt's blocks by key (decode takes the ones its prefix
cache holds), prefill with ``hold_kv_for_transfer``, copying from decode's pages what decode
holds beyond its own pool hit when that beats computing it (``peer_pull.py``); the first token
leaves at prefill end; KV goes layer by layer over the prefill instance's link, only the blocks
decode lacks; decode starts (``add_prefilled``) when the last layer is out, and prefill frees
its blocks then.
E/P/D: each image is encoded on a picked encoder, batched by image, and its embedding sent
over that encoder's link; the prefill scheduler computes what is ready (``MMInput``).
A request's moments go on its ``Flight`` and its engine ``Request`` by ``EventType``.
"""

from __future__ import annotations

from epdserve.engine.step_shape import StepShape
from epdserve.request import EventType, MMInput, Request, hash_prompt_ids
from epdserve.router.admission import (
    Rejection,
    check_pending,
    check_predicted_ttft,
    check_worker_queue,
    reservation_refused,
)
from epdserve.router.workers import PromptBlocks
from epdserve.sampling import SamplingParams
from epdserve.service import DEFAULT_KEY, SERVICE_CLASSES, schedule_key
from epdserve.sim import fastforward
from epdserve.sim.config import SimConfig
from epdserve.sim.instance import EncodeInstance, StepInstance, progress_rate
from epdserve.sim.loop import ARRIVAL, EMBED_DONE, HANDED_OVER, RESERVED, TRANSFER_DONE, SimLoop
from epdserve.sim.results import Flight
from epdserve.validate import InvalidFieldError, check_prompt_length

__all__ = ["ClusterSim", "SimConfig"]

DUMMY_TOKEN_ID = 0


class ClusterSim(SimLoop):
    """The simulated cluster: ``ClusterSim(cost, config, workload).run()`` replays the workload
    and returns its ``Recorder``."""

    # -- router ------------------------------------------------------------------------------
    def _reject(self, index: int, num_prompt: int, rejection: Rejection) -> None:
        self.recorder.fail(index, self.now, num_prompt, f"{rejection.status} {rejection.message}", self.now)

    def _sampling(self, max_tokens: int, key: int = DEFAULT_KEY) -> SamplingParams:
        params = self._params.get((max_tokens, key))
        if params is None:
            params = self._params[max_tokens, key] = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                     priority=key)
        return params

    def _on_arrival(self, index: int) -> None:
        now, w, config = self.now, self.workload, self.config
        if index + 1 < len(w):
            self._push(float(w.arrival_s[index + 1]), ARRIVAL, index + 1)
        num_output = int(w.output_lens[index])
        num_prompt = int(w.input_lens[index]) + self.num_image_tokens
        rejection = check_pending(len(self.flights), config.max_pending)
        if rejection is not None:
            return self._reject(index, num_prompt, rejection)
        try:
            check_prompt_length(num_prompt, self.max_model_len)  # the edge's rule
        except InvalidFieldError as e:
            return self.recorder.fail(index, now, num_prompt, f"400 {e}", now)
        rid = str(index)
        prompt = w.prompt_token_ids(index, self._filler)
        if self.num_image_tokens:
            images = [DUMMY_TOKEN_ID] * self.num_image_tokens
            prompt = prompt + images if config.images_after_text else images + prompt
        prompt_blocks = None
        if self.is_prefix_aware or (self.is_split and config.enable_prefix_caching):
            # The router names the prompt's blocks (images by their content) for prefix-aware
            # routing and for the decode worker's reservation.
            spans = self._image_spans(index, num_prompt)
            prompt_blocks = PromptBlocks(hash_prompt_ids(prompt, spans) if spans else prompt)
        service_class = SERVICE_CLASSES[self.class_ids[index]]
        key = schedule_key(service_class)
        predicted = None
        if config.admission == "predictive":  # the router's rule (flow.py _check_slo)
            slo = config.class_slos.get(service_class)
            if slo is not None and slo.ttft_s is not None:
                predicted = self.registry.predict_ttft("prefill" if self.is_split else "colocated",
                                                       prompt_blocks or PromptBlocks(prompt), key)
                rejection = check_predicted_ttft(service_class, predicted, slo)
                if rejection is not None:
                    return self._reject(index, num_prompt, rejection)
        first = self._pick("decode" if self.is_split else "colocated", prompt_blocks)
        rejection = check_worker_queue(first.worker, config.max_waiting_per_worker)
        if rejection is not None:
            return self._reject(index, num_prompt, rejection)
        flight = Flight(index, now, num_prompt, num_output, prompt)
        flight.prompt_blocks = prompt_blocks
        flight.key = key
        if predicted is not None:
            flight.predicted_ttft_s = predicted / self.registry.ttft_correction.factor
        blocks = None
        answer_at = None  # when a busy decode instance answers the reservation
        if self.is_split:
            if not first.kv_cache.can_ever_hold_prompt(num_prompt):
                return self._reject(index, num_prompt, reservation_refused(f"no room for {num_prompt + 1} tokens"))
            def try_reserve(_: str, flight: Flight) -> bool:
                nonlocal blocks, answer_at
                blocks, answer_at = self._reserve(first, flight)
                return blocks is not None

            if not first.reserve_queue.offer(rid, flight, config.decode_queue_timeout_s, now, try_reserve,
                                            flight.key):
                return self._reject(index, num_prompt, reservation_refused(f"no room for {num_prompt + 1} tokens"))
            if blocks is None:
                self._sync(first)  # waiting: the queue is served at its step ends
            flight.decode = first
            first.worker.take(rid)
        else:
            self._sync(first)
            flight.colocated = first
        if self.recorder.is_detail(index):
            flight.token_times = []
            self.detail_ids.add(rid)
        self.flights[rid] = flight
        if blocks is None and self.is_split:
            return  # in the decode instance's queue
        if answer_at is not None:
            # A worker reads control messages between steps: the decode worker answers the
            # reservation when its step in flight ends, and only then does the router submit
            # the prompt to a prefill worker.
            self._push(answer_at, RESERVED, (flight, blocks))
        else:
            self._submit(flight, blocks)

    def _reserve_blocks(self, inst: StepInstance, flight: Flight) -> list[list[int]] | None:
        """``Scheduler.reserve`` on the decode instance with the prompt's block keys (the
        leading ones its prefix cache holds are taken from it: ``flight.num_decode_cached``)."""
        hashes = None
        if flight.prompt_blocks is not None:
            hashes = flight.prompt_blocks.hashes(inst.kv_cache.block_size)
        blocks = inst.scheduler.reserve(flight.request_id, flight.num_prompt, hashes)
        if blocks is not None:
            flight.num_decode_cached = inst.scheduler.num_reserved_cached(flight.request_id)
        return blocks

    def _reserve(self, inst: StepInstance, flight: Flight) -> tuple[list[list[int]] | None, float | None]:
        """The decode instance reserves blocks for the prompt and its first token: the blocks
        (None: no room) and when the answer leaves (None: now, the instance is idle).

        A decode-only stretch in flight keeps running when the reservation fits beside all of
        its steps' blocks: a reservation changes no running sequence, so stepping would run the
        same steps, and the step in flight ends when the stretch's step of that index does.
        Otherwise the stretch ends with the step in flight, and the reservation is judged
        against the blocks left after it, as stepping would."""
        stretch = inst.stretch
        if stretch is None:
            blocks = self._reserve_blocks(inst, flight)
            return blocks, (inst.busy_until if blocks is not None and inst.is_busy else None)
        kv = inst.kv_cache
        need = kv.num_blocks_for_prompt(flight.num_prompt)
        num_free = kv.num_free_blocks()
        if fastforward.free_after(inst, stretch, num_free) < need:
            self._sync(inst)
            if fastforward.free_after(inst, stretch, num_free) < need:
                return None, None
        blocks = self._reserve_blocks(inst, flight)
        if blocks is None:
            return None, None
        stretch.free0 -= num_free - kv.num_free_blocks()
        return blocks, stretch.ends[fastforward.steps_done_before(stretch, self.now)]

    def _grant_reservations(self, inst: StepInstance) -> None:
        """The decode worker's queue (worker_decode.py ``_grant_waiting``): reserve for the
        waiting requests in arrival order while there is room; refuse those whose wait ran out."""
        def try_reserve(_: str, flight: Flight) -> bool:
            blocks = self._reserve_blocks(inst, flight)
            if blocks is not None:
                self._submit(flight, blocks)
            return blocks is not None

        now = self.now
        for rid, flight in inst.reserve_queue.serve(now, try_reserve):
            inst.worker.drop(rid)
            del self.flights[rid]
            self.detail_ids.discard(rid)
            rejection = reservation_refused(f"no room within {self.config.decode_queue_timeout_s:g} s")
            self.recorder.fail(flight.index, flight.arrived, flight.num_prompt,
                               f"{rejection.status} {rejection.message}", now)

    def _on_heartbeat(self, payload: object) -> None:
        """Between steps an idle decode worker's loop still serves its queue (every poll)."""
        for inst in self.instances:
            if getattr(inst, "reserve_queue", None) and not inst.is_busy:
                self._grant_reservations(inst)
        super()._on_heartbeat(payload)

    def _submit(self, flight: Flight, blocks: list[list[int]] | None) -> None:
        """The router submits the prompt: to a prefill instance (after the decode instance
        reserved ``blocks`` for it), or to the colocated instance picked at arrival."""
        rid, prompt, arrival = flight.request_id, flight.prompt, flight.arrived
        if self.is_split:
            target = flight.prefill = self._pick("prefill", flight.prompt_blocks)
            request = Request(rid, prompt, self._sampling(1, flight.key), arrival_time=arrival, hold_kv_for_transfer=True,
                              kv_target=flight.decode.worker.worker_id, kv_target_block_ids=blocks,
                              kv_target_num_cached=flight.num_decode_cached)
            flight.kv_sent = flight.num_decode_cached  # decode holds those blocks: they are not sent
            if flight.prompt_blocks is not None and target.kv_cache.enable_prefix_caching:
                # the keys the router computed are the engine's (spares hashing the prompt twice)
                target.kv_cache.adopt_block_hashes(rid, flight.prompt_blocks.hashes(target.kv_cache.block_size))
        else:
            target = flight.colocated
            request = Request(rid, prompt, self._sampling(flight.num_output, flight.key), arrival_time=arrival)
        target.worker.take(rid, len(prompt), flight.key)
        request.record(EventType.ARRIVED, arrival)
        if self.num_image_tokens:
            self._submit_images(flight, request)
        target.scheduler.add_request(request)
        self._kick(target)

    def _image_spans(self, index: int, num_prompt: int) -> list[tuple[int, int, str]]:
        """(offset, length, content hash) of each image of request ``index`` in its prompt."""
        if not self.num_image_tokens:
            return []
        num_images = self.workload.num_images
        tokens = self.num_image_tokens // num_images
        first = num_prompt - self.num_image_tokens if self.config.images_after_text else 0
        return [(first + k * tokens, tokens, f"{index:011x}{k:04x}") for k in range(num_images)]

    def _submit_images(self, flight: Flight, request: Request) -> None:
        w = self.workload
        for k, (offset, length, content_hash) in enumerate(self._image_spans(flight.index, flight.num_prompt)):
            mm = MMInput(offset=offset, length=length, num_embeds=length, content_hash=content_hash)
            flight.mm_inputs.append(mm)
            encoder = self._pick("encode")
            flight.encoders[encoder] = flight.encoders.get(encoder, 0) + 1
            encoder.worker.take(flight.request_id)
            encoder.queue.append((flight, k))
            self._kick_encoder(encoder)
        flight.num_pending_images = w.num_images
        request.mm_inputs = flight.mm_inputs
        request.is_mm_pipelined = self.config.is_mm_pipelined

    # -- step instances ------------------------------------------------------------------
    def _kick(self, inst: StepInstance) -> None:
        """Start the instance's next step now, unless one is running or nothing is runnable."""
        if inst.is_busy:
            return
        if self.is_fast_forward and inst.role != "prefill" and not inst.reserve_queue:
            stretch = fastforward.try_start(inst, self.now, self.max_model_len)
            if stretch is not None:
                inst.stretch = stretch
                inst.is_busy = True
                self._push_step_end(inst, stretch.ends[-1])
                return
        self._kick_stepped(inst)

    def _kick_stepped(self, inst: StepInstance) -> None:
        scheduler = inst.scheduler
        out = scheduler.schedule()
        while not out.scheduled:
            if not out.preempted_ids:
                return
            out = scheduler.schedule()
        now = self.now
        shape = StepShape.from_scheduler_output(out)
        step_s = inst.step_cost.time_s(shape)
        if out.loads:  # read from the tiers below the pool before the forward pass
            step_s += inst.loader.loaded(out.loads)
        if out.pulls:  # copied from the decode instance's pages before the forward pass
            step_s += inst.puller.pulled(out.pulls)
        if self.is_shared:  # else every step goes at its own pace: nothing to track
            pace = inst.pace
            pace.work_s, pace.since = step_s, now
            pace.neighbour_ratio = (inst.neighbour_step.time_s(shape) / max(step_s, 1e-12)
                                    if inst.neighbour_step is not None and inst.neighbours else 0.0)
            pace.rate = progress_rate(inst)
            step_s /= pace.rate  # as things stand now; re-timed when a sharer or neighbour begins or ends a step
        if shape.num_prefill_tokens:
            flights = self.flights
            for entry in out.scheduled:
                request = entry.request
                if entry.start_pos < request.num_prompt_tokens:
                    flight = flights[request.request_id]
                    if flight.prefill_start is None:
                        flight.prefill_start = now
                        flight.num_cached_tokens = request.num_cached_tokens
                        request.record(EventType.PREFILL_START, now)
            if inst.link is not None:
                self._push_kv(inst, out.scheduled, now, step_s)
        inst.is_busy = True
        inst.out = out
        inst.step_start = now
        inst.num_steps += 1
        inst.busy_s += step_s
        self._push_step_end(inst, now + step_s)
        if self.is_shared:
            self._repace(inst)

    def _token_times(self, inst: StepInstance) -> dict:
        if not self.detail_ids:
            return {}
        flights = self.flights
        return {r.request_id: flights[r.request_id].token_times for r in inst.scheduler.running
                if r.request_id in self.detail_ids}

    def _push_kv(self, inst: StepInstance, scheduled: list, now: float, step_s: float) -> None:
        """Queue the KV of this prefill step's tokens (and, on a request's first chunk, of its
        prefix-cache hit) on the instance's link, layer by layer."""
        sizes, finals = [], []
        for entry in scheduled:
            request = entry.request
            flight = self.flights[request.request_id]
            end = min(entry.start_pos + entry.num_new_tokens, request.num_prompt_tokens)
            sizes.append(self.cost.kv_bytes_sent(flight.kv_sent, end, request.num_prompt_tokens))
            flight.kv_sent = max(flight.kv_sent, end)
            finals.append(flight if end == request.num_prompt_tokens else None)
        for flight, end_s in zip(finals, inst.link.send_layerwise(now, step_s, self.cost.num_layers, sizes)):
            if flight is not None:
                flight.kv_transfer_end = end_s

    def _on_step_end(self, inst: StepInstance) -> None:
        stretch = inst.stretch
        roles = self.roles
        if stretch is not None:
            fastforward.advance(inst, stretch, stretch.num_steps, self._token_times(inst))
            if roles is not None and inst.role == "decode":
                num_seqs = len(stretch.requests)
                for end, step_s in zip(stretch.ends, stretch.step_s):
                    roles.observe_decode_step(end, step_s, num_seqs)
            inst.stretch = None
            inst.is_busy = False
            if inst.handover_pending:
                self.hand_over(inst)
            if inst.reserve_queue:
                self._grant_reservations(inst)
            self._kick(inst)
            return
        now, out = self.now, inst.out
        inst.is_busy, inst.out = False, None
        if self.is_shared:
            self._repace(inst)
        sampled = {e.request.request_id: DUMMY_TOKEN_ID for e in out.scheduled if e.will_sample}
        finished = inst.scheduler.update(out, sampled)
        self._publish_kv_events(inst)
        flights = self.flights
        if roles is not None and inst.role == "decode":
            roles.observe_decode_step(now, now - inst.step_start, len(sampled))
        if inst.role != "decode":
            for entry in out.scheduled:
                request = entry.request
                if entry.will_sample and len(request.output_token_ids) == 1:
                    flight = flights[request.request_id]
                    if flight.first_token is None:
                        flight.first_token = flight.prefill_end = now
                        inst.worker.prefilled(request.request_id)
                        if self.watch is not None:
                            self.watch.on_first_token(flight.index, now - flight.arrived)
                        if roles is not None:
                            roles.observe_ttft(now, now - flight.arrived)
                        if flight.predicted_ttft_s is not None:
                            self.registry.ttft_correction.observe(flight.predicted_ttft_s, now - flight.arrived)
                        request.record(EventType.PREFILL_END, now)
                        request.record(EventType.FIRST_TOKEN, now)
        if self.detail_ids:
            for rid in self.detail_ids.intersection(sampled):
                flights[rid].token_times.append(now)
        for request in finished:
            flight = flights[request.request_id]
            if inst.role == "prefill":
                flight.kv_exposed_s = max(0.0, flight.kv_transfer_end - now)
                self._push(max(flight.kv_transfer_end, now), TRANSFER_DONE, flight)
                if flight.num_output == 1:
                    self._complete(flight, 1)
            else:
                request.record(EventType.FINISHED, now)
                self._complete(flight, len(request.output_token_ids) + flight.num_handed_over)
        if inst.handover_pending:
            self.hand_over(inst)
        if inst.reserve_queue:
            self._grant_reservations(inst)
        self._kick(inst)
        if roles is not None and roles.draining:
            roles.poll(now)

    def _complete(self, flight: Flight, num_output: int) -> None:
        flight.finished = self.now
        self.recorder.complete(flight, num_output)
        rid = flight.request_id
        for inst in (flight.colocated, flight.decode):
            if inst is not None:
                inst.worker.drop(rid)
        del self.flights[rid]
        self.detail_ids.discard(rid)

    def _on_transfer_done(self, flight: Flight) -> None:
        rid = flight.request_id
        prefill, decode = flight.prefill, flight.decode
        self._sync(decode)
        if not self.num_image_tokens:  # the decode request names its blocks by the same tokens
            decode.kv_cache.adopt_block_hashes(rid, prefill.kv_cache.block_hashes(rid))
        prefill.scheduler.release_transfer(rid)
        prefill.worker.drop(rid)
        if flight.num_output == 1:
            decode.scheduler.release_reservation(rid)
            if decode.reserve_queue and not decode.is_busy:
                self._grant_reservations(decode)
        else:
            request = Request(rid, flight.prompt, self._sampling(flight.num_output, flight.key),
                              arrival_time=flight.arrived)
            request.output_token_ids.append(DUMMY_TOKEN_ID)
            request.record(EventType.ARRIVED, self.now)
            decode.scheduler.add_prefilled(request)
        self._kick(decode)
        self._kick(prefill)
        if self.roles is not None and self.roles.draining:
            self.roles.poll(self.now)

    # -- hand-over (sim/roles.py) --------------------------------------------------------
    def hand_over(self, source: StepInstance) -> None:
        """As the router hands a draining decode worker's requests over (router/handover.py):
        each decoding request moves to the least loaded ready decode instance that can reserve
        for it, its KV leaving over the source's link, and continues there once it is out. The
        source hands over between steps (a worker reads the router's messages then). A request
        no target can take stays and finishes on the source (the router would recompute it
        elsewhere)."""
        if source.is_busy:
            self._sync(source)
            source.handover_pending = True
            return
        source.handover_pending = False
        self._retarget_reservations(source)
        for request in list(source.scheduler.running):
            rid = request.request_id
            num_tokens = request.num_tokens - 1
            if not source.scheduler.has_whole_kv(rid):
                continue
            target = self._pick("decode")
            if target is None:
                return
            self._sync(target)
            if target.scheduler.reserve(rid, num_tokens) is None:
                continue
            held = source.scheduler.hold_for_handover(rid)
            target.worker.take(rid)
            self._push(source.link.send(self.now, self.cost.kv_bytes_sent(0, num_tokens, num_tokens)), HANDED_OVER,
                       (self.flights[rid], held, source, target))

    def _retarget_reservations(self, source: StepInstance) -> None:
        """Prompts still waiting at their prefill instance whose KV is due on the draining
        ``source``: reserved on another decode instance instead (the router's ``Retarget``)."""
        for rid in list(source.scheduler.reserved):
            flight = self.flights.get(rid)
            prefill = flight.prefill if flight is not None else None
            if prefill is None or not prefill.scheduler.is_untouched(rid):
                continue
            request = prefill.scheduler.requests[rid]
            target = self._pick("decode")
            if target is None:
                return
            self._sync(target)
            blocks = self._reserve_blocks(target, flight)
            if blocks is None:
                continue
            request.kv_target, request.kv_target_block_ids = target.worker.worker_id, blocks
            request.kv_target_num_cached = flight.kv_sent = flight.num_decode_cached
            source.scheduler.release_reservation(rid)
            source.worker.drop(rid)
            target.worker.take(rid)
            flight.decode = target

    def _on_handed_over(self, flight: Flight, held: Request, source: StepInstance, target: StepInstance) -> None:
        rid = flight.request_id
        source.scheduler.release_transfer(rid)
        source.worker.drop(rid)
        outputs = held.output_token_ids
        flight.num_handed_over += len(outputs) - 1
        request = Request(rid, held.prompt_token_ids + outputs[:-1],
                          self._sampling(held.sampling.max_tokens - len(outputs) + 1, flight.key),
                          arrival_time=flight.arrived)
        request.output_token_ids.append(outputs[-1])
        request.record(EventType.ARRIVED, self.now)
        self._sync(target)
        target.scheduler.add_prefilled(request)
        flight.decode = target
        self._kick(target)
        if self.roles is not None and self.roles.draining:
            self.roles.poll(self.now)

    # -- encode instances ----------------------------------------------------------------
    def _kick_encoder(self, enc: EncodeInstance) -> None:
        if enc.is_busy or not enc.queue:
            return
        num = min(len(enc.queue), enc.max_batch_images)
        enc.batch = [enc.queue.popleft() for _ in range(num)]
        for flight, _ in enc.batch:
            if flight.encode_start is None:
                flight.encode_start = self.now
        step_s = enc.cost.time_s(num * self.workload.tiles_per_image)
        if self.is_shared:
            pace = enc.pace
            pace.work_s, pace.since = step_s, self.now
            pace.rate = progress_rate(enc)
            step_s /= pace.rate
        enc.is_busy = True
        enc.num_steps += 1
        enc.busy_s += step_s
        self._push_encode_end(enc, self.now + step_s)
        if self.is_shared:
            self._repace(enc)

    def _on_encode_end(self, enc: EncodeInstance) -> None:
        enc.is_busy = False
        if self.is_shared:
            self._repace(enc)
        embed_bytes = self.num_image_tokens // self.workload.num_images * self.cost.embed_bytes_per_token
        for flight, k in enc.batch:
            self._push(enc.link.send(self.now, embed_bytes), EMBED_DONE, (flight, k))
            flight.encoders[enc] -= 1
            if flight.encoders[enc] == 0:
                del flight.encoders[enc]
                enc.worker.drop(flight.request_id)
        enc.batch = []
        self._kick_encoder(enc)

    def _on_embed_done(self, flight: Flight, k: int) -> None:
        flight.mm_inputs[k].is_ready = True
        flight.num_pending_images -= 1
        if flight.num_pending_images == 0:
            flight.encode_end = self.now
        consumer = flight.prefill or flight.colocated
        self._sync(consumer)
        self._kick(consumer)
