"""Runs one scheduled step on the model: packs tokens, addresses the KV pages, samples.

The KV cache of each layer is one tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (K then V); block ids index it directly, so the scheduler's block tables are the
addresses. The cache starts zeroed: the null block and unwritten slots hold finite values that
attention masks out. A layer of no paged group (a recurrent layer) has an empty tensor there,
``[2, num_blocks, block_size, 0, 0]``.

A model with recurrent state (a "state" KV cache group) also has, per layer of that group, one
tensor ``[num_slots, *state_shape]`` (``state_caches``; empty for the other layers): a request's
slot id (its state group's one-entry block table) indexes it directly.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from epdserve.engine.failures import describe, is_fatal
from epdserve.engine.forward import StepInputs, run_forward
from epdserve.engine.grammar import GrammarMasks
from epdserve.engine.kv_cache import KVCacheGroupSpec
from epdserve.engine.sampler import FaultInjectingSampler, Sampler, SampleResult, TokenLogprobs
from epdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from epdserve.faults import FaultPlan
from epdserve.models.layers import paged_attention_cpu
from epdserve.request import Request
from epdserve.transfer.connector import KVPusher, PushItem

if TYPE_CHECKING:
    from epdserve.engine.tp import TPGroup

log = logging.getLogger("epdserve.engine")


@dataclass(frozen=True)
class RunnerOutput:
    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    num_tokens: int
    # Requests whose sampling raised (request id -> message): no token for them this step.
    failed: dict[str, str] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        groups: list[KVCacheGroupSpec],
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        kv_caches: list[torch.Tensor] | None = None,
        faults: FaultPlan | None = None,
        num_state_slots: int = 0,
        state_caches: list[torch.Tensor] | None = None,
    ) -> None:
        """``kv_caches``: pages allocated by the caller (e.g. in shared memory), one tensor per
        layer of the shape above; zero-filled tensors are allocated when None. ``faults``:
        sampling faults to inject (tests). ``num_state_slots``: slots of the state tensors
        (``KVCacheManager.num_state_slots``; 0 without state groups); ``state_caches``: those
        tensors allocated by the caller (e.g. in shared memory), zero-filled when None."""
        self.model = model
        self.groups = groups
        self.block_size = block_size
        self.device = device
        self.layer_to_group = [0] * num_layers
        for group in groups:
            for layer in group.layer_ids:
                self.layer_to_group[layer] = group.group_id
        if kv_caches is None:
            kv_caches = [
                torch.zeros(shape, dtype=dtype, device=device)
                for shape in kv_cache_shapes(groups, num_layers, num_blocks, block_size)
            ]
        self.kv_caches = kv_caches
        self.paged_groups = [g for g in groups if g.is_paged]
        self.state_groups = [g for g in groups if not g.is_paged]
        self.state_caches: list[torch.Tensor] | None = state_caches
        if self.state_groups and state_caches is None:
            self.state_caches = [
                torch.zeros(shape, dtype=dtype, device=device)
                for shape in state_cache_shapes(groups, num_layers, num_state_slots)
            ]
        self.sampler: Sampler = (Sampler(seed, device) if faults is None
                                 else FaultInjectingSampler(seed, device, faults))
        self.pusher: KVPusher | None = None  # set on a prefill worker of a P/D pair
        self.tp: TPGroup | None = None  # tensor parallelism: the other ranks (set by the engine)
        self.grammar: GrammarMasks | None = None  # structured outputs; set by the engine
        if device.type == "cpu":
            paged_attention_cpu.is_available()  # build or load the kernel now, not in the first step

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_caches[0].dtype

    def attach_pusher(self, layerwise: bool = True, **options) -> KVPusher:
        """Push the KV of requests with a ``kv_target`` from every later step (``options``: the
        pusher's tensor-parallel ones)."""
        self.pusher = KVPusher(self.kv_caches, self.layer_to_group, self.block_size, layerwise, **options)
        return self.pusher

    def release_kv_pages(self) -> None:
        """Forget the KV pages (their memory is about to go); no step runs after this."""
        self.kv_caches = []
        self.state_caches = None if self.state_caches is None else []

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run the batch's forward pass and sample. An exception in the forward pass
        propagates (it belongs to the whole batch); one in sampling costs only the requests
        whose rows raise (``RunnerOutput.failed``), unless it is fatal. With tensor
        parallelism the step's inputs go to the other ranks first (``tp.py``)."""
        # Single-token entries first: attention runs them as one batch.
        entries = sorted(plan.scheduled, key=lambda e: e.num_new_tokens != 1)
        requests = [e.request for e in entries if e.will_sample]
        # Plain greedy rows need only an argmax: no float32 copy of [N, vocab] logits.
        inputs = self._inputs(entries, bool(requests) and self.sampler.needs_float32(requests))
        if self.tp is not None:
            self.tp.step(inputs)
        on_layer_written = None
        if self.pusher is not None:
            self.pusher.begin_step(self._push_items(entries))
            on_layer_written = self.pusher.save_layer
        logits = run_forward(self.model, inputs, self.kv_caches, self.layer_to_group, self.block_size, self.device,
                             on_layer_written, self.state_caches)
        if self.pusher is not None:
            self.pusher.end_step()
        out = RunnerOutput({}, {}, len(inputs.input_ids))
        if logits is not None:
            self._sample(logits, requests, out)
        return out

    def _inputs(self, entries: list[ScheduledRequest], float32_logits: bool) -> StepInputs:
        """The step's forward-pass inputs as plain lists (what every TP rank needs)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for e in entries:
            input_ids += e.request.token_ids_slice(e.start_pos, e.start_pos + e.num_new_tokens)
            positions += range(e.start_pos, e.start_pos + e.num_new_tokens)
            if e.will_sample:
                sample_rows.append(len(input_ids) - 1)
        context_lens = [e.start_pos + e.num_new_tokens for e in entries]
        max_blocks = max(-(-n // bs) for n in context_lens)
        slots, tables = [], []
        for group in self.paged_groups:
            gid = group.group_id
            group_slots: list[int] = []
            group_tables = []
            for e in entries:
                table = e.block_tables[gid]
                group_slots += [table[p // bs] * bs + p % bs
                                for p in range(e.start_pos, e.start_pos + e.num_new_tokens)]
                row = table[:max_blocks]
                group_tables.append(row + [0] * (max_blocks - len(row)))
            slots.append(group_slots)
            tables.append(group_tables)
        # A state group's table is the request's one slot.
        state_slots = {g.group_id: [e.block_tables[g.group_id][0] for e in entries] for g in self.state_groups}
        return StepInputs(input_ids, positions, sum(1 for e in entries if e.num_new_tokens == 1),
                          [e.num_new_tokens for e in entries], context_lens, slots, tables, sample_rows,
                          float32_logits, self._image_rows(entries), state_slots)

    def _sample(self, logits: torch.Tensor, requests: list[Request], out: RunnerOutput) -> None:
        """Sample the batch at once; if that raises, each row alone, failing the rows that
        raise again. A seeded row drawn before the batch raised draws once more from its
        generator, so its token can differ from a run without the failure (still seeded)."""
        if self.grammar is not None and self.grammar.constrained(requests):
            failed = self.grammar.apply(logits, requests)
            if failed:
                for i, message in failed.items():
                    out.failed[requests[i].request_id] = message
                keep = [i for i in range(len(requests)) if i not in failed]
                if not keep:
                    return
                logits, requests = logits[keep], [requests[i] for i in keep]
        try:
            self._collect(requests, self.sampler(logits, requests), out)
            return
        except Exception as e:
            if is_fatal(e):
                raise
            log.warning("sampling a batch of %d failed (%s: %s); sampling row by row",
                        len(requests), type(e).__name__, e)
        for i, request in enumerate(requests):
            try:
                self._collect([request], self.sampler(logits[i : i + 1], [request]), out)
            except Exception as e:
                if is_fatal(e):
                    raise
                log.exception("sampling %s failed", request.request_id)
                out.failed[request.request_id] = describe(e, "sampling")

    def _collect(self, requests: list[Request], result: SampleResult, out: RunnerOutput) -> None:
        for request, token_id, lp in zip(requests, result.token_ids, result.logprobs):
            if self.grammar is not None and (error := self.grammar.accept(request, token_id)) is not None:
                out.failed[request.request_id] = error
                continue
            out.sampled_token_ids[request.request_id] = token_id
            if lp is not None:
                out.logprobs[request.request_id] = lp

    @staticmethod
    def _image_rows(entries: list[ScheduledRequest]) -> list[tuple[list[int], torch.Tensor]]:
        """The batch rows that take an image's encoder rows instead of a token embedding,
        with those rows; empty when the step has no image token (the model embeds the ids)."""
        out: list[tuple[list[int], torch.Tensor]] = []
        base = 0  # batch row of the entry's first token
        for e in entries:
            start, end = e.start_pos, e.start_pos + e.num_new_tokens
            for mm in e.request.mm_inputs:
                if mm.end <= start or mm.offset >= end:
                    continue
                # Image tokens of this span inside [start, end): rows first..last of its embedding.
                lo, hi = max(start, mm.offset) - mm.offset, min(end, mm.end) - mm.offset
                positions = mm.embed_positions
                if positions is None:
                    first, last = lo, hi
                else:
                    first, last = bisect.bisect_left(positions, lo), bisect.bisect_left(positions, hi)
                if first == last:
                    continue
                if mm.embeds is None:
                    raise RuntimeError(f"image embedding of {e.request.request_id} used before it arrived")
                if positions is None:
                    dst = base + mm.offset + lo - start
                    rows = list(range(dst, dst + (last - first)))
                else:
                    rows = [base + mm.offset + p - start for p in positions[first:last]]
                out.append((rows, mm.embeds[first:last]))
            base += e.num_new_tokens
        return out

    def release(self, request_id: str, aborted: bool = False) -> None:
        """Forget a finished request; an aborted one also stops its KV transfer."""
        self.sampler.release(request_id)
        if self.grammar is not None:
            self.grammar.release(request_id)
        if aborted and self.pusher is not None:
            self.pusher.abort(request_id)

    @staticmethod
    def _push_items(entries: list[ScheduledRequest]) -> list[PushItem]:
        items = []
        for e in entries:
            request = e.request
            if request.kv_target is None:
                continue
            # The first chunk also carries the prompt's prefix-cache hit; what the decode worker
            # holds already (``kv_target_num_cached``) is never sent.
            start = 0 if e.start_pos == request.num_cached_tokens else e.start_pos
            skip = request.kv_target_num_cached
            end = e.start_pos + e.num_new_tokens
            items.append(
                PushItem(
                    request.request_id, request.kv_target, min(max(start, skip), end), end,
                    e.block_tables, request.kv_target_block_ids, e.will_sample,
                    request.kv_target_generation, skip,
                )
            )
        return items


def kv_cache_shapes(
    groups: list[KVCacheGroupSpec], num_layers: int, num_blocks: int, block_size: int
) -> list[tuple[int, ...]]:
    """Per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]; no heads for a layer of
    no paged group (empty, the same rank, so every layer's pages address alike)."""
    shapes: list[tuple[int, ...]] = [(2, num_blocks, block_size, 0, 0)] * num_layers
    for group in groups:
        if not group.is_paged:
            continue
        for layer in group.layer_ids:
            shapes[layer] = (2, num_blocks, block_size, group.num_kv_heads, group.head_dim)
    return shapes


def state_cache_shapes(groups: list[KVCacheGroupSpec], num_layers: int, num_slots: int) -> list[tuple[int, ...]]:
    """Per layer: [num_slots, *state_shape] for a layer of a state group, else [0]."""
    shapes: list[tuple[int, ...]] = [(0,)] * num_layers
    for group in groups:
        if group.is_paged:
            continue
        for layer in group.layer_ids:
            shapes[layer] = (num_slots, *group.state_shape)
    return shapes
