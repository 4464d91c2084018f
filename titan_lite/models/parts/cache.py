"""The generation cache's interface the mixers call (titan_lite.generate implements it): one layer's view of the
keys and values (or of a recurrent layer's conv window and state, or of a latent attention layer's latent), and the
cache of every layer."""

from typing import Protocol

import torch


class LayerCache(Protocol):
    """One layer's view of a generation KV cache (titan_lite.generate): rotates q and k at the cached
    sequence's positions, appends k and v, and attends q [batch, seq, heads, head_dim] to every cached key;
    returns [batch, heads, seq, head_dim]; sinks [heads]: gpt-oss's sink logits."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor: ...


class RecurrentCache(Protocol):
    """One Gated DeltaNet layer's view of the cache: which open slots hold real tokens [batch, seq], and its conv
    window and recurrent state (None before its first forward)."""

    real: torch.Tensor

    def states(self) -> tuple[torch.Tensor | None, torch.Tensor | None]: ...

    def keep_states(self, conv_window: torch.Tensor, state: torch.Tensor) -> None: ...


class LatentCache(Protocol):
    """One latent attention layer's view of the cache (DeepSeek-V3): rotates rope channels [batch, seq, heads, rope]
    at the open slots' positions, appends the normed latent [batch, seq, rank] and the rotated rope key [batch, seq,
    1, rope] and returns every cached slot's; `mask` [batch, 1, seq, slots] says which slots each query sees."""

    mask: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor: ...

    def keep_latent(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class KVCache(Protocol):
    last_only: bool  # compute the last position's logits only (not when ranks hold pieces of the sequence)

    def layer(self, layer_id: int) -> LayerCache: ...
