"""One engine instance: model, KV cache, scheduler, runner, and the step loop.

    plan = scheduler.schedule(); out = runner.execute(plan); scheduler.update(plan, out)

A request with ``n > 1`` becomes n sequences; sequences 1..n-1 wait until sequence 0 has
computed the prompt, then find its prompt blocks in the prefix cache.

A step isolates failures: an exception while scheduling, running, sampling or detokenizing
fails only the requests it involves (their blocks and transfer holds are freed, and the step
reports them as ``RequestOutput`` with ``error`` set); the engine goes on serving the rest.
Fatal errors (``failures.is_fatal``) propagate.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from epdserve.config import EngineArgs, EngineConfig, resolve_device_name, resolve_dtype_name
from epdserve.engine.detokenizer import FaultInjectingDetokenizer, IncrementalDetokenizer
from epdserve.engine.failures import describe, is_fatal
from epdserve.engine.grammar import GrammarMasks
from epdserve.engine.host_memory import keep_freed_memory
from epdserve.engine.kv_cache import KVCacheManager, make_group_specs
from epdserve.engine.kv_offload import KVOffload
from epdserve.engine.outputs import (
    ERROR_FINISH_REASON,
    Completion,
    EngineLoad,
    RequestOutput,
    check_mm_inputs,
)
from epdserve.engine.pd_roles import PDRoles
from epdserve.engine.reload_rule import PrefillRate
from epdserve.engine.runner import ModelRunner, kv_cache_shapes, state_cache_shapes
from epdserve.engine.sampler import TokenLogprobs
from epdserve.engine.scheduler import Scheduler, SchedulerOutput
from epdserve.engine.tp import TPGroup, local_kv_heads
from epdserve.errors import ConfigError, InvalidRequestError
from epdserve.faults import FaultKind, FaultPlan
from epdserve.models.loader import LoadedModel, load_model
from epdserve.request import EventType, MMInput, Request, RequestStatus
from epdserve.sampling import SamplingParams
from epdserve.transfer.connector import KVPusher, TransferStats
from epdserve.transfer.shm_pool import SharedKVPool
from epdserve.validate import RequestLimits, check_prompt_ids

KVCacheAllocator = Callable[[list[tuple[int, ...]], torch.dtype], list[torch.Tensor]]
log = logging.getLogger("epdserve.engine")


@dataclass
class _Sequence:
    parent_id: str
    index: int
    request: Request
    detokenizer: IncrementalDetokenizer


def _check_recurrent_state(architecture: str, tp_size: int) -> None:
    """A model with recurrent state runs at tensor-parallel size 1 for now."""
    if tp_size > 1:
        raise ConfigError(f"{architecture} keeps a recurrent state per request, and tensor-parallel ranks hold no "
                          "state slots yet (its layers shard the conv channels, the ranks would need their share of "
                          "the state): use --tensor-parallel-size 1")


class LLMEngine(PDRoles):
    def __init__(
        self,
        args: EngineArgs,
        loaded: LoadedModel | None = None,
        kv_cache_allocator: KVCacheAllocator | None = None,
        share_rank_pages: bool = False,
        state_cache_allocator: KVCacheAllocator | None = None,
    ) -> None:
        """``kv_cache_allocator(shapes, dtype)`` places the KV pages (e.g. in shared memory).
        ``share_rank_pages``: at tensor parallelism, the other ranks' pages are shared memory
        this process owns and reads (``rank_kv_caches``: what a P/D worker pushes and lands).
        ``state_cache_allocator(shapes, dtype)`` places a recurrent model's state tensors."""
        keep_freed_memory()  # the process's freed activations stay for the next step
        device_name = resolve_device_name(args.device)
        dtype = getattr(torch, resolve_dtype_name(args.dtype, device_name))
        device = torch.device(device_name)
        tp_size = args.tensor_parallel_size
        if tp_size < 1:
            raise ConfigError(f"--tensor-parallel-size must be at least 1, got {tp_size}")
        owns_tp = loaded is None and tp_size > 1
        if loaded is None:
            tp = TPGroup(args.model, str(dtype).removeprefix("torch."), device_name, tp_size) if tp_size > 1 else None
            error = ""
            try:
                loaded = load_model(args.model, dtype, tp.device if tp else device, 0, tp_size)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                if tp is None:
                    raise
            if tp is not None:
                tp.check_ready(error)  # raises when any rank (this one included) failed
            loaded.tp = tp
        elif loaded.tp_size != tp_size:
            raise ConfigError(f"the loaded model has tensor-parallel size {loaded.tp_size}, not {tp_size}")
        try:
            self._build(args, loaded, kv_cache_allocator, dtype, device, share_rank_pages, state_cache_allocator)
        except BaseException:
            if owns_tp and loaded.tp is not None:
                loaded.tp.close()  # the ranks this engine started go with it
            raise

    def _build(self, args: EngineArgs, loaded: LoadedModel, kv_cache_allocator: KVCacheAllocator | None,
               dtype: torch.dtype, device: torch.device, share_rank_pages: bool = False,
               state_cache_allocator: KVCacheAllocator | None = None) -> None:
        tp_size = loaded.tp_size
        self.loaded = loaded
        device = loaded.tp.device if loaded.tp is not None else device
        spec = self.loaded.spec
        self.tokenizer = self.loaded.tokenizer
        if spec.has_recurrent_state:
            _check_recurrent_state(spec.architecture, tp_size)
        # Each rank holds its KV heads (all of them at TP 1); the block tables are shared.
        groups = make_group_specs(spec.sliding_windows, local_kv_heads(spec.num_kv_heads, tp_size), spec.head_dim,
                                  spec.state_shapes)
        dtype_bytes = torch.tensor([], dtype=dtype).element_size()
        bytes_per_block = sum(g.bytes_per_block(args.block_size, dtype_bytes) for g in groups)
        self.config: EngineConfig = args.resolve(spec.max_position_embeddings, bytes_per_block)
        cache = self.config.cache
        self._faults = FaultPlan.from_specs(args.faults)  # None without injected faults
        self._hung_ids: set[str] = set()  # sequences a hang-step fault has already delayed
        # A state group (recurrent layers) has one slot per request the scheduler may run at once.
        num_state_slots = self.config.scheduler.max_num_seqs if spec.has_recurrent_state else 0
        self.kv_cache = KVCacheManager(groups, cache.num_blocks, cache.block_size, cache.enable_prefix_caching,
                                       num_state_slots=num_state_slots)
        if cache.enable_prefix_caching and self.kv_cache.prefix_caching_off_reason is not None:
            log.info("prefix caching is off for %s: %s", spec.name, self.kv_cache.prefix_caching_off_reason)
        self.scheduler = Scheduler(self.config.scheduler, self.kv_cache)
        shapes = kv_cache_shapes(groups, spec.num_layers, cache.num_blocks, cache.block_size)
        kv_caches = kv_cache_allocator(shapes, dtype) if kv_cache_allocator is not None else None
        state_caches = None
        if state_cache_allocator is not None and num_state_slots:
            state_caches = state_cache_allocator(state_cache_shapes(groups, spec.num_layers, num_state_slots), dtype)
        self.runner = ModelRunner(
            self.loaded.model, groups, spec.num_layers, cache.num_blocks, cache.block_size,
            dtype, device, self.config.seed, kv_caches, self._faults, num_state_slots, state_caches,
        )
        self.runner.grammar = GrammarMasks(self.tokenizer, spec.vocab_size)
        self.rank_pools: list[SharedKVPool] = []  # share_rank_pages: ranks 1..N-1's pages
        if loaded.tp is not None:
            self.runner.tp = loaded.tp
            if share_rank_pages:
                if device.type != "cpu":
                    raise ConfigError("P/D at tensor-parallel size > 1 keeps every rank's KV pages in host memory "
                                      "(shared with rank 0); on an accelerator it is not supported yet")
                layer_shapes = [tuple(s[3:]) for s in shapes]
                self.rank_pools = [SharedKVPool.create(cache.num_blocks, cache.block_size, layer_shapes, dtype,
                                                       "epdserve-kv-rank") for _ in range(tp_size - 1)]
                loaded.tp.attach_kv([p.name for p in self.rank_pools], shapes, dtype, self.runner.layer_to_group,
                                    cache.block_size)
            else:
                loaded.tp.allocate_kv(shapes, dtype, self.runner.layer_to_group, cache.block_size)
        self.prefill_rate = PrefillRate()  # measured prefill seconds per prompt token
        self.bytes_per_block = bytes_per_block  # KV of one block, every layer and group
        self.kv_offload: KVOffload | None = None
        self.kv_puller = None  # P/D prefill: kv_pull.PeerPuller, set with the KV pusher
        self.handover_pusher: KVPusher | None = None  # P/D decode: hands running requests over (a switch)
        if args.kv_tiers.enabled:
            self.kv_offload = self._open_kv_store(args)
        self._sequences: dict[str, _Sequence] = {}
        self._children: dict[str, list[str]] = {}
        self._mm_inputs: dict[str, list[MMInput]] = {}  # by the id the request was added with
        self.last_plan: SchedulerOutput | None = None  # what the last step scheduled
        self.last_model_s = 0.0  # wall time of the last step's ModelRunner.execute (s)
        self._ids = itertools.count()

    def _open_kv_store(self, args: EngineArgs) -> KVOffload:
        """The tiers below the pool (``kv_offload.py``): one full-attention group with prefix caching."""
        cache = self.kv_cache
        if not cache.enable_prefix_caching:
            raise ConfigError("the KV tiers below the pool need prefix caching (this model or --no-prefix-caching "
                              "turns it off)")
        if len(cache.groups) != 1:
            raise ConfigError("the KV tiers below the pool take models with one KV cache group")
        if self.loaded.tp is not None:
            raise ConfigError("the KV tiers below the pool take tensor-parallel size 1 (each rank holds its own KV heads)")
        offload = KVOffload.open(args.kv_tiers, self.loaded.spec.name, self.runner.kv_caches, cache.pools[0],
                                 cache.block_size, self.prefill_rate)
        cache.on_free = offload.on_free
        self.scheduler.prefix_loader = offload
        return offload

    def poll_kv_store(self) -> None:
        """Release the pages whose write-down finished (each step does this; an idle worker calls it)."""
        if self.kv_offload is not None:
            self.kv_offload.poll()

    def close(self) -> None:
        """Stop the KV store's writer (pending writes are dropped) and the hand-over links; the
        engine runs no step after."""
        if self.kv_offload is not None:
            self.kv_offload.close()
            self.kv_offload = None
        if self.handover_pusher is not None:
            self.handover_pusher.close()
            self.handover_pusher = None
        for pool in self.rank_pools:
            pool.close()  # unlinked; the ranks' mappings go with them
        self.rank_pools = []

    @property
    def tp_size(self) -> int:
        return self.loaded.tp_size

    @property
    def num_model_kv_heads(self) -> int:
        """The model's KV heads over all ranks."""
        return self.loaded.spec.num_kv_heads

    @property
    def rank_kv_caches(self) -> list[list[torch.Tensor]]:
        """Every tensor-parallel rank's pages, rank 0's first (``share_rank_pages``)."""
        return [self.runner.kv_caches, *(pool.layers for pool in self.rank_pools)]

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # -- requests ------------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if not prompt:
            raise InvalidRequestError("prompt must not be empty")
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """The edge's prompt rule (``validate.check_prompt_ids``), then this engine's own: the
        prompt's KV blocks fit the cache."""
        limits = RequestLimits(vocab_size=self.loaded.spec.vocab_size, max_model_len=self.max_model_len)
        check_prompt_ids(prompt_token_ids, limits)
        self.check_fits_kv_cache(len(prompt_token_ids))

    def check_fits_kv_cache(self, num_prompt_tokens: int) -> None:
        """The prompt and its first output token fit this engine's whole KV cache (else no
        amount of waiting lets it run here)."""
        kv = self.kv_cache
        if not kv.can_ever_hold_prompt(num_prompt_tokens):
            raise InvalidRequestError(
                f"prompt needs {kv.num_blocks_for_prompt(num_prompt_tokens)} KV blocks, the cache has {kv.num_blocks - 1}"
            )

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        mm_inputs: list[MMInput] | None = None,
        is_mm_pipelined: bool = True,
    ) -> str:
        """``mm_inputs``: the prompt's images (spans and embeddings, see ``MMInput``); an image
        whose embedding is not ready holds back the tokens from its span on
        (``mark_image_ready``)."""
        self.validate_prompt(prompt_token_ids)
        check_mm_inputs(mm_inputs or [], len(prompt_token_ids))
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._children:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        child_ids: list[str] = []
        self._children[request_id] = child_ids
        try:
            for index, (child_id, child_params) in enumerate(params.split(request_id)):
                leader = child_ids[0] if child_ids else None
                self._add_sequence(request_id, child_id, index, prompt_token_ids, child_params, leader)
                request = self._sequences[child_id].request
                request.mm_inputs = mm_inputs or []  # one list: siblings see the same readiness
                request.is_mm_pipelined = is_mm_pipelined
                child_ids.append(child_id)
        except Exception:
            del self._children[request_id]  # all or nothing: no sequence of a refused request runs
            for child_id in child_ids:
                self._drop_sequence(child_id)
            raise
        if mm_inputs:
            self._mm_inputs[request_id] = mm_inputs
        return request_id

    def mm_inputs(self, request_id: str) -> list[MMInput] | None:
        """The images of a live request (by the id it was added with), or None."""
        return self._mm_inputs.get(request_id)

    def mark_image_ready(self, request_id: str, image_index: int, embeds: object = None) -> bool:
        """Image ``image_index``'s embedding is in place (``embeds``: its rows, unless already
        set); False when the request is gone."""
        mm_inputs = self._mm_inputs.get(request_id)
        if mm_inputs is None or not 0 <= image_index < len(mm_inputs):
            return False
        mm = mm_inputs[image_index]
        if embeds is not None:
            mm.embeds = embeds
        mm.is_ready = mm.embeds is not None
        return mm.is_ready

    def _add_sequence(
        self,
        parent_id: str,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        wait_for_request_id: str | None = None,
    ) -> None:
        if request_id in self._sequences:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id,
            list(prompt_token_ids),
            params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            wait_for_request_id=wait_for_request_id,
        )
        request.record(EventType.ARRIVED)
        self._sequences[request_id] = _Sequence(parent_id, index, request, self._detokenizer(params))
        self.scheduler.add_request(request)

    def _new_sequence(self, request_id: str, request: Request, detokenizer: IncrementalDetokenizer) -> None:
        """A request of one sequence whose prompt is already computed (``start_decode``)."""
        self._sequences[request_id] = _Sequence(request_id, 0, request, detokenizer)
        self._children[request_id] = [request_id]

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer:
        if self._faults is not None and self._faults.has(FaultKind.DETOK_ERROR, params.seed):
            return FaultInjectingDetokenizer(self.tokenizer, params, self._faults)
        return IncrementalDetokenizer(self.tokenizer, params)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (queued, running, reserved, transferring)."""
        self._mm_inputs.pop(request_id, None)
        child_ids = self._children.pop(request_id, None) or [request_id]
        for child_id in child_ids:
            self._drop_sequence(child_id)
        if request_id in self.scheduler.transferring:
            self.scheduler.release_transfer(request_id)

    def _drop_sequence(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._sequences.pop(request_id, None)
        self.runner.release(request_id, aborted=True)

    def live_request_ids(self) -> list[str]:
        """Every request this engine holds, by the id it came with: queued, running, reserved
        (decode) and transferring (prefill)."""
        return [*self._children, *self.scheduler.reserved, *self.scheduler.transferring]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def last_num_scheduled(self) -> int:
        """Requests the last step ran (0: all waiting, e.g. for images)."""
        return len(self.last_plan.scheduled) if self.last_plan is not None else 0

    def load(self) -> EngineLoad:
        """Queue lengths and KV block use, as a worker reports its load."""
        sched, cache = self.scheduler, self.kv_cache
        free_slots = cache.num_free_slots()
        return EngineLoad(len(sched.running), len(sched.waiting), len(sched.reserved), len(sched.transferring),
                          cache.num_free_blocks(), cache.num_used_blocks(),
                          0 if free_slots is None else cache.num_state_slots - free_slots)

    # -- KV pages ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.runner.kv_dtype

    @property
    def kv_caches(self) -> Sequence[torch.Tensor]:
        """The KV pages, one tensor per layer (see runner.py); the sequence is read-only."""
        return tuple(self.runner.kv_caches)

    @property
    def state_caches(self) -> Sequence[torch.Tensor] | None:
        """A recurrent model's state tensors, one per layer (``[num_slots, *state_shape]``,
        empty for an attention layer); None for a model without state."""
        return None if self.runner.state_caches is None else tuple(self.runner.state_caches)

    @property
    def kv_layer_to_group(self) -> Sequence[int]:
        """Per layer, the KV cache group whose block tables address its pages."""
        return tuple(self.runner.layer_to_group)

    @property
    def num_kv_groups(self) -> int:
        return len(self.kv_cache.groups)

    def kv_bytes_by_group(self, stats: TransferStats) -> dict[str, int]:
        """A transfer's bytes by KV cache group name (``KVCacheGroupSpec.name``)."""
        return {g.name: b for g, b in zip(self.kv_cache.groups, stats.kv_bytes_by_group)}

    def record_kv_events(self) -> None:
        """Note the prefix-cache blocks stored and removed from now on (``take_kv_events``)."""
        self.kv_cache.record_events()

    def take_kv_events(self) -> list[tuple[str, str, list[bytes]]]:
        """(kind, tier, block hashes) of the blocks stored and removed since the last call,
        oldest first (``router/prefix_index.py`` reads them)."""
        events = [(kind, "pool", hashes) for kind, hashes in self.kv_cache.take_events()]
        if self.kv_offload is not None:
            events += [(e.kind, e.tier, list(e.block_hashes)) for e in self.kv_offload.take_events()]
        return events

    def release_kv_pages(self) -> None:
        """Drop the engine's references to its KV pages (before their memory is unmapped);
        the engine runs no step after this."""
        self.close()  # the KV store's writer reads the pages
        self.runner.release_kv_pages()

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one batch; the outputs it produced, and one error output
        per request that failed in it (see the module docstring)."""
        failed: dict[str, RequestOutput] = {}  # by the id the request was added with
        try:
            plan = self.scheduler.schedule()
        except Exception as e:
            if is_fatal(e):
                raise
            self.last_plan = SchedulerOutput()
            # schedule() moves requests between queues and allocates their blocks in one
            # pass: once it raised, no one request can be blamed and the queues may be
            # half-updated, so every queued and running request fails. Transfers and
            # reservations are held apart from the queues and stay.
            log.exception("scheduling failed")
            for request in self.scheduler.drop_queued():
                self._fail(request.request_id, describe(e, "scheduling"), failed)
            return list(failed.values())
        self.last_plan = plan
        if self.kv_offload is not None:
            self.kv_offload.poll()
        if plan.is_empty:
            return []
        for entry in plan.scheduled:
            if entry.start_pos == entry.request.num_cached_tokens and not entry.request.output_token_ids:
                entry.request.record(EventType.PREFILL_START)
        try:
            if self._faults is not None:
                self._inject_step_faults(plan)
            if plan.pulls:
                for request_id in self.kv_puller.apply(plan.pulls):
                    self._fail(request_id, "its decode worker's reservation ended while its prefix was "
                                           "copied from there", failed)
                if failed:  # their pages are not valid: they leave the step
                    plan.scheduled = [e for e in plan.scheduled if e.request.request_id not in failed]
                    if not plan.scheduled:
                        return list(failed.values())
            if plan.loads:
                self.kv_offload.apply(plan.loads)
            model_start = time.perf_counter()
            out = self.runner.execute(plan)
            self.last_model_s = time.perf_counter() - model_start
            if all(entry.start_pos < entry.request.num_prompt_tokens for entry in plan.scheduled):
                self.prefill_rate.observe(plan.num_batched_tokens, self.last_model_s)
            for request_id, message in out.failed.items():  # no token for them in ``out``
                self._fail(request_id, message, failed)
            self.scheduler.update(plan, out.sampled_token_ids)
        except Exception as e:
            if is_fatal(e):
                raise
            # One forward pass computes the whole batch together (and update() advances the
            # whole batch's state in one pass): an exception there cannot be pinned on one
            # request, and the KV written for any of them may be partial. The batch fails.
            log.exception("model step failed")
            for entry in plan.scheduled:
                self._fail(entry.request.request_id, describe(e, "running the model"), failed)
            return list(failed.values())
        outputs = []
        for entry in plan.scheduled:
            request = entry.request
            token_id = out.sampled_token_ids.get(request.request_id)
            if token_id is None or request.request_id not in self._sequences:
                continue  # a chunk that samples nothing, or failed in this step
            if len(request.output_token_ids) == 1:
                request.record(EventType.PREFILL_END)
                request.record(EventType.FIRST_TOKEN)
            try:
                outputs.append(self._process_token(request, token_id, out.logprobs.get(request.request_id)))
            except Exception as e:
                if is_fatal(e):
                    raise
                log.exception("detokenizing %s failed", request.request_id)
                self._fail(request.request_id, describe(e, "detokenizing"), failed)
        if failed:
            outputs = [o for o in outputs if o.request_id not in failed] + list(failed.values())
        return outputs

    def _fail(self, request_id: str, message: str, failed: dict[str, RequestOutput]) -> None:
        """End the request that sequence ``request_id`` belongs to, all its sequences, with
        ``message``: abort it (blocks, transfer hold and KV push released) and record its
        error output in ``failed``."""
        seq = self._sequences.get(request_id)
        parent_id = seq.parent_id if seq is not None else request_id
        if parent_id in failed:
            return
        log.warning("request %s failed: %s", parent_id, message)
        self.abort(parent_id)
        failed[parent_id] = RequestOutput(
            request_id=parent_id, index=0, new_text="", new_token_ids=[], new_logprobs=[], finished=True,
            finish_reason=ERROR_FINISH_REASON, num_prompt_tokens=seq.request.num_prompt_tokens if seq else 0,
            num_cached_tokens=seq.request.num_cached_tokens if seq else 0, error=message,
        )

    def _inject_step_faults(self, plan: SchedulerOutput) -> None:
        """``fatal`` and ``hang-step`` faults (tests) of the requests in this step."""
        assert self._faults is not None
        for entry in plan.scheduled:
            request = entry.request
            seed, num_output = request.sampling.seed, len(request.output_token_ids)
            if self._faults.find(FaultKind.FATAL, seed, num_output) is not None:
                raise torch.OutOfMemoryError(f"injected fatal fault (seed {seed}) for {request.request_id}")
            hang = self._faults.find(FaultKind.HANG_STEP, seed, num_output)
            if hang is not None and request.request_id not in self._hung_ids:
                self._hung_ids.add(request.request_id)
                log.warning("injected hang: the step of %s sleeps %g s", request.request_id, hang.seconds)
                time.sleep(hang.seconds)

    def _process_token(self, request: Request, token_id: int, logprob: TokenLogprobs | None) -> RequestOutput:
        seq = self._sequences[request.request_id]
        result = seq.detokenizer.add_token(token_id, is_last=request.is_finished)
        if result.stopped and not request.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            request.record(EventType.FINISHED)
            self._forget(seq)
        return RequestOutput(
            request_id=seq.parent_id,
            index=seq.index,
            new_text=result.new_text,
            new_token_ids=[token_id],
            new_logprobs=[logprob] if logprob is not None else [],
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prefill_start=request.first_event_time(EventType.PREFILL_START) or 0.0,
            prefill_end=request.first_event_time(EventType.PREFILL_END) or 0.0,
            tier_load=request.tier_load if len(request.output_token_ids) == 1 else None,  # with the first token
        )

    def _forget(self, seq: _Sequence) -> None:
        self._sequences.pop(seq.request.request_id, None)
        self.runner.release(seq.request.request_id)
        siblings = self._children.get(seq.parent_id, [])
        if all(s not in self._sequences for s in siblings):
            self._children.pop(seq.parent_id, None)
            self._mm_inputs.pop(seq.parent_id, None)

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[Completion]]:
        """Run every prompt to completion, batched; one list of n completions per prompt."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results = {rid: [Completion(rid, i) for i in range(sp.n)] for rid, sp in zip(ids, params_list)}
        while self.has_unfinished():
            for out in self.step():
                c = results[out.request_id][out.index]
                c.text += out.new_text
                c.token_ids += out.new_token_ids
                c.logprobs += out.new_logprobs
                c.finish_reason = out.finish_reason
                c.num_prompt_tokens = out.num_prompt_tokens
                c.num_cached_tokens = out.num_cached_tokens
                if out.error is not None:
                    for sibling in results[out.request_id]:
                        sibling.finish_reason, sibling.error = out.finish_reason, out.error
        return [results[rid] for rid in ids]

