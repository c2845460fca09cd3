"""One step's forward pass, the same on every tensor-parallel rank: the inputs as plain lists
(``StepInputs``, what rank 0 sends its followers) and ``run_forward`` on a rank's own pages
(and, for a model with recurrent state, its state tensors)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from epdserve.models.layers.attention import AttentionMetadata, GroupAttentionMetadata, forward_context
from epdserve.models.layers.short_conv import StateMetadata, state_context, zero_fresh_slots


@dataclass
class StepInputs:
    """What every rank needs to run one step's forward pass."""

    input_ids: list[int]
    positions: list[int]
    num_decode: int  # the first num_decode sequences have one query token each
    query_lens: list[int]
    context_lens: list[int]
    slots: list[list[int]]  # per paged KV cache group: the page slot of each token
    block_tables: list[list[list[int]]]  # per paged group, per sequence, padded to one length
    sample_rows: list[int]  # rows of the batch whose logits are needed
    float32_logits: bool
    image_rows: list[tuple[list[int], torch.Tensor]]  # (batch rows, their embedding rows)
    # Per state group (by group id): each sequence's state slot (empty: no recurrent state).
    state_slots: dict[int, list[int]] = field(default_factory=dict)


@torch.inference_mode()
def run_forward(
    model: torch.nn.Module, inputs: StepInputs, kv_caches: list[torch.Tensor], layer_to_group: list[int],
    block_size: int, device: torch.device, on_layer_written: Callable[[int], None] | None = None,
    state_caches: list[torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """One step's forward pass on this rank's pages; the logits of the rows to sample (None:
    no row samples). Every TP rank runs it with the same inputs (``tp.py``). ``state_caches``:
    per layer, the recurrent state of every slot (``short_conv.py``), for a model that has it."""
    ids_t = torch.tensor(inputs.input_ids, dtype=torch.long, device=device)
    pos_t = torch.tensor(inputs.positions, dtype=torch.long, device=device)
    meta = AttentionMetadata(
        num_decode_seqs=inputs.num_decode,
        query_lens=inputs.query_lens,
        context_lens=inputs.context_lens,
        decode_context_lens=torch.tensor(inputs.context_lens[: inputs.num_decode], dtype=torch.long, device=device),
        block_size=block_size,
        groups=[GroupAttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                                       block_tables=torch.tensor(tables, dtype=torch.long, device=device))
                for slots, tables in zip(inputs.slots, inputs.block_tables)],
        layer_to_group=layer_to_group,
        kv_caches=kv_caches,
        on_layer_written=on_layer_written,
    )
    state = None
    if inputs.state_slots:
        if state_caches is None:
            raise RuntimeError("the step carries recurrent-state slots but this rank holds no state tensors")
        state = StateMetadata(
            num_decode_seqs=inputs.num_decode,
            query_lens=inputs.query_lens,
            slot_ids={group_id: torch.tensor(slots, dtype=torch.long, device=device)
                      for group_id, slots in inputs.state_slots.items()},
            layer_to_group=layer_to_group,
            state_caches=state_caches,
        )
        zero_fresh_slots(state, inputs.context_lens)
    embeds = None
    if inputs.image_rows:
        embeds = model.embed(ids_t)
        for rows, values in inputs.image_rows:
            index = torch.tensor(rows, dtype=torch.long, device=embeds.device)
            embeds.index_copy_(0, index, values.to(device=embeds.device, dtype=embeds.dtype))
    with forward_context(meta), state_context(state):
        hidden = model(ids_t, pos_t) if embeds is None else model(ids_t, pos_t, input_embeds=embeds)
    if not inputs.sample_rows:
        return None
    return model.compute_logits(hidden[inputs.sample_rows], float32=inputs.float32_logits)
