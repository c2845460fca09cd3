"""Causal depthwise convolution over a short window, with each request's state in a slot.

A short-convolution layer (LFM2) mixes each channel of a token with the same channel of the
``kernel_size - 1`` tokens before it. Between steps a request keeps exactly those inputs, per
layer and per channel: its state, ``[channels, kernel_size - 1]``, oldest first. The engine
keeps the states of all requests in one tensor per layer, ``[num_slots, channels,
kernel_size - 1]``, and gives each request one slot for its whole life (the "state" KV cache
group); the step's ``StateMetadata``, installed with ``state_context`` next to the attention
metadata, says which slot each sequence of the batch uses. Without a context (a model run on
its own) the input is one sequence starting from a zero state.

One sequence of one step, kernel 3 (state s0 s1, new inputs x0..x3)::

    window   s0 s1 x0 x1 x2 x3
    out y0 = w . (s0 s1 x0)   y1 = w . (s1 x0 x1)  ...  y3 = w . (x1 x2 x3)
    state after the step:  x2 x3

A slot starts zeroed: the forward pass clears the slot of every sequence whose first chunk it
computes (``zero_fresh_slots``), so a slot handed over from a finished request carries nothing.

Tensor parallelism splits the channels: rank r holds channels [r * C / tp, (r + 1) * C / tp)
of the weight, of the state and of the activations around it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from epdserve.models.layers.linear import divide


@dataclass
class StateMetadata:
    """Where the sequences of one step keep their recurrent state. Sequences are in the
    attention layout (decode sequences, one token each, first)."""

    num_decode_seqs: int
    query_lens: list[int]
    slot_ids: dict[int, torch.Tensor]  # state group id -> [num_seqs] int64: each sequence's slot
    layer_to_group: list[int]
    state_caches: list[torch.Tensor]  # per layer: [num_slots, *state shape] (empty for other layers)


_context: StateMetadata | None = None


@contextlib.contextmanager
def state_context(metadata: StateMetadata | None) -> Iterator[None]:
    global _context
    previous, _context = _context, metadata
    try:
        yield
    finally:
        _context = previous


def get_state_context() -> StateMetadata | None:
    return _context


def zero_fresh_slots(meta: StateMetadata, context_lens: list[int]) -> None:
    """Clear the slots of the sequences that start at position 0 in this step, in every layer
    of their group: a fresh request's state is zero, whatever the slot held before."""
    fresh = [i for i, (context_len, query_len) in enumerate(zip(context_lens, meta.query_lens))
             if context_len == query_len]
    if not fresh:
        return
    for group_id, slots in meta.slot_ids.items():
        rows = slots[torch.tensor(fresh, dtype=torch.long, device=slots.device)]
        for layer, layer_group in enumerate(meta.layer_to_group):
            if layer_group == group_id:
                meta.state_caches[layer].index_fill_(0, rows, 0)


class ShortConv(nn.Module):
    """[T, channels] -> [T, channels]: each channel convolved with its own ``kernel_size``
    taps over the token and the ones before it (of the same sequence)."""

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        bias: bool,
        layer_idx: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"a convolution kernel has at least one tap, got {kernel_size}")
        self.tp_rank = tp_rank
        self.channels = divide(channels, tp_size)  # this rank's
        self.kernel_size = kernel_size
        self.layer_idx = layer_idx
        # [channels, 1, kernel_size]: F.conv1d's depthwise layout, and the checkpoint's.
        self.weight = nn.Parameter(torch.empty(self.channels, 1, kernel_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.channels, dtype=dtype, device=device), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    @property
    def state_shape(self) -> tuple[int, int]:
        """One request's state in this layer on this rank."""
        return self.channels, self.kernel_size - 1

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """This rank's channels of a full weight ([channels, 1, kernel] or [channels, kernel])
        or bias."""
        rows = loaded_weight.narrow(0, self.tp_rank * self.channels, self.channels)
        param.data.copy_(rows.reshape(param.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        meta = get_state_context()
        if meta is None:  # one sequence from a zero state: pad the kernel's reach with zeros
            num_tokens = x.shape[0]
            y = F.conv1d(x.t()[None], self.weight, self.bias, padding=self.kernel_size - 1, groups=self.channels)
            return y[0, :, :num_tokens].t()
        cache = meta.state_caches[self.layer_idx]
        slots = meta.slot_ids[meta.layer_to_group[self.layer_idx]]
        out = torch.empty_like(x)
        num_decode = meta.num_decode_seqs
        if num_decode:
            rows = slots[:num_decode]
            window = torch.cat([cache.index_select(0, rows), x[:num_decode, :, None].to(cache.dtype)], dim=2)
            out[:num_decode] = F.conv1d(window.to(x.dtype), self.weight, self.bias, groups=self.channels)[:, :, 0]
            cache.index_copy_(0, rows, window[:, :, 1:])
        start = num_decode
        for i in range(num_decode, len(meta.query_lens)):  # prefill chunks, one by one
            num_tokens = meta.query_lens[i]
            end = start + num_tokens
            row = slots[i : i + 1]
            # [1, channels, kernel - 1 + n]: the state, then the chunk's inputs.
            window = torch.cat([cache.index_select(0, row), x[None, start:end].transpose(1, 2).to(cache.dtype)], dim=2)
            out[start:end] = F.conv1d(window.to(x.dtype), self.weight, self.bias, groups=self.channels)[0].t()
            cache.index_copy_(0, row, window[:, :, num_tokens:])
            start = end
        return out
