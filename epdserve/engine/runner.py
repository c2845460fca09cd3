"""Runs one scheduled step on the model: packs tokens, addresses the KV pages, samples.

The KV cache of each layer is one tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (K then V); block ids index it directly, so the scheduler's block tables are the
addresses. The cache starts zeroed: the null block and unwritten slots hold finite values that
attention masks out.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

import torch

from epdserve.engine.failures import describe, is_fatal
from epdserve.engine.grammar import GrammarMasks
from epdserve.engine.kv_cache import KVCacheGroupSpec
from epdserve.engine.sampler import FaultInjectingSampler, Sampler, SampleResult, TokenLogprobs
from epdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from epdserve.faults import FaultPlan
from epdserve.models.layers import paged_attention_cpu
from epdserve.models.layers.attention import AttentionMetadata, GroupAttentionMetadata, forward_context
from epdserve.request import Request
from epdserve.transfer.connector import KVPusher, PushItem

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
    ) -> None:
        """``kv_caches``: pages allocated by the caller (e.g. in shared memory), one tensor per
        layer of the shape above; zero-filled tensors are allocated when None. ``faults``:
        sampling faults to inject (tests)."""
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
        self.sampler: Sampler = (Sampler(seed, device) if faults is None
                                 else FaultInjectingSampler(seed, device, faults))
        self.pusher: KVPusher | None = None  # set on a prefill worker of a P/D pair
        self.grammar: GrammarMasks | None = None  # structured outputs; set by the engine
        if device.type == "cpu":
            paged_attention_cpu.is_available()  # build or load the kernel now, not in the first step

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_caches[0].dtype

    def attach_pusher(self, layerwise: bool = True) -> KVPusher:
        """Push the KV of requests with a ``kv_target`` from every later step."""
        self.pusher = KVPusher(self.kv_caches, self.layer_to_group, self.block_size, layerwise)
        return self.pusher

    def release_kv_pages(self) -> None:
        """Forget the KV pages (their memory is about to go); no step runs after this."""
        self.kv_caches = []

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run the batch's forward pass and sample. An exception in the forward pass
        propagates (it belongs to the whole batch); one in sampling costs only the requests
        whose rows raise (``RunnerOutput.failed``), unless it is fatal."""
        # Single-token entries first: attention runs them as one batch.
        entries = sorted(plan.scheduled, key=lambda e: e.num_new_tokens != 1)
        num_decode = sum(1 for e in entries if e.num_new_tokens == 1)
        input_ids: list[int] = []
        positions: list[int] = []
        for e in entries:
            input_ids += e.request.token_ids_slice(e.start_pos, e.start_pos + e.num_new_tokens)
            positions += range(e.start_pos, e.start_pos + e.num_new_tokens)
        meta = self._metadata(entries, num_decode)
        ids_t = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        if self.pusher is not None:
            self.pusher.begin_step(self._push_items(entries))
            meta.on_layer_written = self.pusher.save_layer
        embeds = self._input_embeds(entries, ids_t)
        with forward_context(meta):
            hidden = self.model(ids_t, pos_t) if embeds is None else self.model(ids_t, pos_t, input_embeds=embeds)
        if self.pusher is not None:
            self.pusher.end_step()

        sample_rows, sample_entries, offset = [], [], 0
        for e in entries:
            offset += e.num_new_tokens
            if e.will_sample:
                sample_rows.append(offset - 1)
                sample_entries.append(e)
        out = RunnerOutput({}, {}, len(input_ids))
        if sample_rows:
            requests = [e.request for e in sample_entries]
            # Plain greedy rows need only an argmax: no float32 copy of [N, vocab] logits.
            logits = self.model.compute_logits(hidden[sample_rows], float32=self.sampler.needs_float32(requests))
            self._sample(logits, requests, out)
        return out

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

    def _input_embeds(self, entries: list[ScheduledRequest], ids_t: torch.Tensor) -> torch.Tensor | None:
        """Token embeddings with image positions taken from their encoder rows; None when the
        step has no image token (the model embeds the ids itself)."""
        embeds: torch.Tensor | None = None
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
                if embeds is None:
                    embeds = self.model.embed(ids_t)
                rows = mm.embeds[first:last]
                if positions is None:
                    dst = base + mm.offset + lo - start
                    embeds[dst : dst + (last - first)] = rows.to(embeds.dtype)
                else:
                    index = torch.tensor(
                        [base + mm.offset + p - start for p in positions[first:last]], device=embeds.device
                    )
                    embeds.index_copy_(0, index, rows.to(device=embeds.device, dtype=embeds.dtype))
            base += e.num_new_tokens
        return embeds

    def _metadata(
        self, entries: list[ScheduledRequest], num_decode: int
    ) -> AttentionMetadata:
        bs = self.block_size
        context_lens = [e.start_pos + e.num_new_tokens for e in entries]
        max_blocks = max(-(-n // bs) for n in context_lens)
        groups = []
        for group in self.groups:
            gid = group.group_id
            slots: list[int] = []
            for e in entries:
                table = e.block_tables[gid]
                slots += [table[p // bs] * bs + p % bs for p in range(e.start_pos, e.start_pos + e.num_new_tokens)]
            padded = [e.block_tables[gid][:max_blocks] + [0] * (max_blocks - len(e.block_tables[gid][:max_blocks])) for e in entries]
            groups.append(
                GroupAttentionMetadata(
                    slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                    block_tables=torch.tensor(padded, dtype=torch.long, device=self.device),
                )
            )
        return AttentionMetadata(
            num_decode_seqs=num_decode,
            query_lens=[e.num_new_tokens for e in entries],
            context_lens=context_lens,
            decode_context_lens=torch.tensor(context_lens[:num_decode], dtype=torch.long, device=self.device),
            block_size=bs,
            groups=groups,
            layer_to_group=self.layer_to_group,
            kv_caches=self.kv_caches,
        )

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
    """Per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
    shapes: list[tuple[int, ...]] = [()] * num_layers
    for group in groups:
        for layer in group.layer_ids:
            shapes[layer] = (2, num_blocks, block_size, group.num_kv_heads, group.head_dim)
    return shapes
