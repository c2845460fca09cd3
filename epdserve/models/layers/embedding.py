"""Token embedding and LM head with the vocabulary split across tensor-parallel ranks.

Rank r owns token ids [r * V_rank, (r + 1) * V_rank), V_rank = ceil(vocab_size / tp_size);
rows past ``vocab_size`` on the last rank are padding, kept at zero.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from epdserve.models.layers.packed_linear import linear


class VocabParallelEmbedding(nn.Module):
    """[T] int64 token ids -> [T, embedding_dim] embeddings."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_embeddings_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.num_embeddings_per_rank
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_rank, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding has {loaded_weight.shape[0]} rows, expected {self.num_embeddings}")
        num_rows = self.vocab_end - self.vocab_start
        param.data[:num_rows].copy_(loaded_weight.narrow(0, self.vocab_start, num_rows))
        param.data[num_rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        is_local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * is_local
        y = F.embedding(local_ids, self.weight) * is_local.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """[N, hidden] -> [N, vocab_size] logits; may share its weight with the embedding."""

    packed_weight: torch.Tensor | None = None  # set by packed_linear.prepack_model

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Use ``embedding``'s weight (same parameter object) as the output projection."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError("tied embedding and LM head must have the same shard shape")
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.packed_weight)
        if self.tp_size == 1:
            return logits
        shards = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(shards, logits)
        return torch.cat(shards, dim=-1)[..., : self.num_embeddings]
