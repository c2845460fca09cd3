"""What the engine sees of a model: its shape (``ModelSpec``) and how loading fails."""

from __future__ import annotations

from dataclasses import dataclass

from epdserve.errors import EpdserveError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "lfm2")


class ModelLoadError(EpdserveError):
    """A model could not be loaded; the message is one line, meant for the user."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only model, independent of the checkpoint format.

    Counts are totals over all tensor-parallel ranks. ``sliding_windows[i]`` is the window
    W of layer i in tokens (a query at position p attends to keys p-W+1 .. p), or None
    for full attention. ``state_shapes[i]`` is the shape of the recurrent state one request
    keeps for layer i, a layer without KV (LFM2's short convolution: (channels, kernel - 1)),
    or None for an attention layer; empty when every layer attends.
    """

    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    state_shapes: tuple[tuple[int, ...] | None, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"unsupported architecture {self.architecture!r}")
        for field_name in (
            "num_layers",
            "hidden_size",
            "vocab_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, field_name) <= 0:
                raise ModelLoadError(f"model config has {field_name}={getattr(self, field_name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if len(self.sliding_windows) != self.num_layers:
            raise ModelLoadError(
                f"{len(self.sliding_windows)} sliding windows given for {self.num_layers} layers"
            )
        if any(window is not None and window <= 0 for window in self.sliding_windows):
            raise ModelLoadError(f"sliding windows must be positive: {self.sliding_windows}")
        if not self.eos_token_ids:
            raise ModelLoadError("model has no end-of-sequence token")
        if self.state_shapes:
            if len(self.state_shapes) != self.num_layers:
                raise ModelLoadError(f"{len(self.state_shapes)} state shapes given for {self.num_layers} layers")
            if any(shape is not None and window is not None
                   for shape, window in zip(self.state_shapes, self.sliding_windows)):
                raise ModelLoadError("a layer with recurrent state has no sliding window")

    @property
    def has_recurrent_state(self) -> bool:
        """Some layers keep a per-request state instead of KV (see ``state_shapes``)."""
        return any(shape is not None for shape in self.state_shapes)

    @property
    def is_hybrid(self) -> bool:
        """True when some layers use a sliding window and others full attention."""
        return len(set(self.sliding_windows)) > 1
