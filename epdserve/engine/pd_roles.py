"""The prefill and decode side of ``LLMEngine``: what a worker of a P/D pair asks of its engine.

A prefill worker computes a prompt and pushes its KV into blocks a decode worker reserved; the
decode worker starts generating once that KV has landed. ``LLMEngine`` takes these methods
from ``PDRoles``; they work on its scheduler, runner and sequences.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from epdserve.engine.kv_pull import PeerPuller
from epdserve.engine.outputs import check_mm_inputs
from epdserve.errors import InvalidRequestError
from epdserve.request import EventType, MMInput, Request
from epdserve.sampling import SamplingParams
from epdserve.transfer.connector import KVPusher, PushItem, TransferStats
from epdserve.transfer.descriptors import KVEndpoint

if TYPE_CHECKING:
    import torch

    from epdserve.engine.detokenizer import IncrementalDetokenizer
    from epdserve.engine.kv_cache import KVCacheManager
    from epdserve.engine.reload_rule import PrefillRate
    from epdserve.engine.runner import ModelRunner
    from epdserve.engine.scheduler import Scheduler
    from epdserve.models.tokenizer import Tokenizer


class PDRoles:
    """Mixed into ``LLMEngine`` (engine.py), which sets these attributes and methods."""

    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: Tokenizer
    _children: dict[str, list[str]]
    _mm_inputs: dict[str, list[MMInput]]
    kv_cache: KVCacheManager
    bytes_per_block: int
    prefill_rate: PrefillRate
    kv_puller: PeerPuller | None
    handover_pusher: KVPusher | None

    if TYPE_CHECKING:
        @property
        def rank_kv_caches(self) -> list[list[torch.Tensor]]: ...

        @property
        def num_model_kv_heads(self) -> int: ...

        def _add_sequence(self, parent_id: str, request_id: str, index: int, prompt_token_ids: list[int],
                          params: SamplingParams, wait_for_request_id: str | None = None) -> None: ...

        def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer: ...

        def _new_sequence(self, request_id: str, request: Request,
                          detokenizer: IncrementalDetokenizer) -> None: ...

    def add_prefill_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_target: str,
        kv_target_block_ids: list[list[int]],
        mm_inputs: list[MMInput] | None = None,
        is_mm_pipelined: bool = True,
        kv_target_generation: int = 0,
        kv_target_num_cached: int = 0,
    ) -> None:
        """Prefill worker: compute the prompt, sample the first token, push the KV to
        ``kv_target``'s blocks (reservation ``kv_target_generation``, see transfer/fence.py);
        the blocks stay held until the transfer reports done. ``kv_target_num_cached``: leading
        prompt tokens the decode worker holds already (their KV is not pushed)."""
        check_mm_inputs(mm_inputs or [], len(prompt_token_ids))
        self._check_num_cached(kv_target_num_cached, len(prompt_token_ids))
        prefill_params = replace(params, n=1, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        self._add_sequence(request_id, request_id, 0, prompt_token_ids, prefill_params)
        self._children[request_id] = [request_id]
        request = self._sequences[request_id].request
        if mm_inputs:
            request.mm_inputs = mm_inputs
            request.is_mm_pipelined = is_mm_pipelined
            self._mm_inputs[request_id] = mm_inputs
        request.hold_kv_for_transfer = True
        self._set_kv_target(request, kv_target, kv_target_block_ids, kv_target_generation, kv_target_num_cached)

    def _check_num_cached(self, num_cached: int, num_prompt_tokens: int) -> None:
        block_size = self.scheduler.kv_cache.block_size
        if not (0 <= num_cached < max(1, num_prompt_tokens) and num_cached % block_size == 0):
            raise InvalidRequestError(f"kv_target_num_cached must be a multiple of {block_size} below the prompt's "
                                      f"{num_prompt_tokens} tokens, got {num_cached}")

    @staticmethod
    def _set_kv_target(request: Request, target: str, block_ids: list[list[int]], generation: int,
                       num_cached: int) -> None:
        request.kv_target = target
        request.kv_target_block_ids = block_ids
        request.kv_target_generation = generation
        request.kv_target_num_cached = num_cached

    def retarget_prefill(self, request_id: str, kv_target: str, kv_target_block_ids: list[list[int]],
                         kv_target_generation: int, kv_target_num_cached: int = 0) -> bool:
        """Prefill worker: send a queued prompt's KV to another decode worker's blocks instead
        (its decode worker is leaving its role); False once any of it may have been computed or
        pushed (then it goes where it was going)."""
        pusher = self.runner.pusher
        if not self.scheduler.is_untouched(request_id) or (pusher is not None and pusher.is_pushing(request_id)):
            return False
        request = self.scheduler.requests[request_id]
        self._check_num_cached(kv_target_num_cached, request.num_prompt_tokens)
        self._set_kv_target(request, kv_target, kv_target_block_ids, kv_target_generation, kv_target_num_cached)
        return True

    def reserve(
        self, request_id: str, num_prompt_tokens: int, block_hashes: list[bytes] | None = None
    ) -> list[list[int]] | None:
        """Decode worker: blocks for a prompt whose KV a prefill worker will write; the leading
        blocks of ``block_hashes`` (the prompt's prefix-cache keys) found in this worker's
        prefix cache are reused (``num_reserved_cached``)."""
        return self.scheduler.reserve(request_id, num_prompt_tokens, block_hashes)

    def num_reserved_cached(self, request_id: str) -> int:
        """Decode worker: leading prompt tokens of a reservation taken from the prefix cache."""
        return self.scheduler.num_reserved_cached(request_id)

    def start_decode(
        self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams,
        cache_new_blocks: bool = True,
    ) -> None:
        """Decode worker: the reserved request's KV has landed; continue after the first token.
        ``cache_new_blocks=False``: register no block past the hashes the reservation came with
        (a prompt with images: this worker cannot name its blocks itself)."""
        request = Request(
            request_id, list(prompt_token_ids), params, eos_token_ids=self.tokenizer.eos_token_ids,
            cache_new_blocks=cache_new_blocks,
        )
        request.output_token_ids.append(first_token_id)
        request.record(EventType.ARRIVED)
        detokenizer = self._detokenizer(params)
        detokenizer.prime([first_token_id])
        self._new_sequence(request_id, request, detokenizer)
        self.scheduler.add_prefilled(request)

    def is_reserved(self, request_id: str) -> bool:
        """Decode worker: ``request_id`` still holds the blocks ``reserve`` gave it."""
        return request_id in self.scheduler.reserved

    def release_reservation(self, request_id: str) -> None:
        """Decode worker: give a reservation's blocks back (its KV will not land)."""
        self.scheduler.release_reservation(request_id)

    def is_transferring(self) -> bool:
        """Prefill worker: some request's blocks are held while its KV leaves."""
        return bool(self.scheduler.transferring)

    def _pusher_options(self) -> dict:
        """A KV pusher's view of this engine: every rank's pages (rank 0's first), the model's
        KV heads, the staging buffer's size (the most one step pushes) and a recurrent model's
        state tensors."""
        sched = self.scheduler.config
        return {"rank_caches": self.rank_kv_caches, "total_kv_heads": self.num_model_kv_heads,
                "staging_tokens": min(sched.max_num_batched_tokens, sched.max_model_len),
                "state_caches": self.runner.state_caches}

    def attach_kv_pusher(self, layerwise: bool = True) -> KVPusher:
        """Prefill worker: from now on each step pushes the KV of requests with a
        ``kv_target`` to that decode worker (layer by layer, or in bulk after the step).
        With prefix caching over one KV group, a prefix the decode worker holds beyond this
        worker's pool may be copied from its pages (``kv_pull.py``)."""
        pusher = self.runner.attach_pusher(layerwise, **self._pusher_options())
        cache = self.kv_cache
        if cache.enable_prefix_caching and len(cache.groups) == 1 and self.runner.tp is None:
            self.kv_puller = PeerPuller(pusher, self.runner.kv_caches, cache.block_size, self.bytes_per_block,
                                        self.prefill_rate)
            self.scheduler.peer_loader = self.kv_puller
        return pusher

    @property
    def kv_pusher(self) -> KVPusher | None:
        return self.runner.pusher

    # -- handing a running request over to another decode worker (a switch of role) ------
    def pause_for_handover(self, request_id: str) -> list[int] | None:
        """Decode worker: stop generating a running request and keep its KV for
        ``push_handover``; its output tokens so far, or None when it cannot be handed over
        (not running whole, several sequences, or a grammar whose state would not follow)."""
        seq = self._sequences.get(request_id)
        if (seq is None or seq.parent_id != request_id or len(self._children.get(request_id, ())) != 1
                or seq.request.sampling.grammar is not None):
            return None
        request = self.scheduler.hold_for_handover(request_id)
        if request is None:
            return None
        self._sequences.pop(request_id, None)
        self._children.pop(request_id, None)
        self.runner.release(request_id)
        return list(request.output_token_ids)

    def add_handover_peer(self, worker_id: str, endpoint: KVEndpoint, key: bytes) -> None:
        """Decode worker: open the link that hands requests over to decode worker ``worker_id``."""
        if self.handover_pusher is None:
            self.handover_pusher = KVPusher(list(self.runner.kv_caches), self.runner.layer_to_group,
                                            self.scheduler.kv_cache.block_size, layerwise=False,
                                            **self._pusher_options())
        self.handover_pusher.add_peer(worker_id, endpoint, key)

    def push_handover(self, request_id: str, target: str, dst_tables: list[list[int]], generation: int,
                      num_cached: int = 0) -> None:
        """Decode worker: copy a paused request's KV (every computed position, less the
        ``num_cached`` leading ones the target holds) into ``target``'s reserved blocks;
        ``poll_handovers`` reports the end."""
        request = self.scheduler.transferring.get(request_id)
        if request is None:
            raise InvalidRequestError(f"{request_id} is not paused for a hand-over here")
        pusher = self.handover_pusher
        if pusher is None or target not in pusher.links:
            raise InvalidRequestError(f"no link to decode worker {target}")
        num_tokens = request.num_computed_tokens
        block_size = self.scheduler.kv_cache.block_size
        if any(len(t) * block_size < num_tokens for t in dst_tables) or not 0 <= num_cached <= num_tokens:
            raise InvalidRequestError(f"the target's blocks hold fewer than the {num_tokens} positions of {request_id}")
        src_tables = self.scheduler.kv_cache.block_tables(request_id)
        pusher.begin_step([PushItem(request_id, target, num_cached, num_tokens, [list(t) for t in src_tables],
                                    dst_tables, True, generation, num_cached)])
        pusher.end_step()

    def poll_handovers(self) -> list[TransferStats]:
        """Decode worker: hand-overs that ended; the paused request's blocks are freed here."""
        if self.handover_pusher is None:
            return []
        finished = self.handover_pusher.poll()
        for stats in finished:
            self.scheduler.release_transfer(stats.request_id)
        return finished

    def poll_transfers(self) -> list[TransferStats]:
        """Prefill worker: KV transfers that ended; their held blocks are freed here. A
        transfer of a request aborted or failed meanwhile is left out: whoever ended the
        request reports its transfer."""
        if self.runner.pusher is None:
            return []
        sched = self.scheduler
        finished = [s for s in self.runner.pusher.poll()
                    if s.request_id in sched.requests or s.request_id in sched.transferring]
        for stats in finished:
            self.scheduler.release_transfer(stats.request_id)
        return finished
