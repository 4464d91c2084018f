"""The KV cache of batched generation: every attention layer's keys and values in slots, every Gated DeltaNet
layer's conv window and recurrent state (Qwen3.5), every latent attention layer's latent and rope key (DeepSeek-V3),
which slots hold real tokens, their rotary rows and the attention mask of the slots a forward opens; and its size,
for DRY_RUN's plan."""

from dataclasses import dataclass, replace

import torch

from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.masks import within_window
from titan_lite.models.parts.rope import local_rope_cache, rope_cache, rotate_channels
from titan_lite.models.parts.sdpa import grouped_attention, sink_attention


class KVCache:
    """Keys and values of every layer for a batch, in slots 0..capacity-1, with which slots hold real tokens.

    `step(tokens_real, positions)` opens the next slots for a forward: it records their rotary rows and the
    attention masks (each new query sees the real keys up to its own slot, and itself; in a layer with a sliding
    window only those within the window of its position), one per window the layers' mixers have. `last_only`: the
    model computes the logits of the last slot only (not under sequence parallelism, where a rank holds a piece of the
    sequence).
    """

    def __init__(self, args: LlamaArgs, batch: int, capacity: int, device: torch.device, last_only: bool = True):
        self.rope = rope_cache(replace(args, max_seq_len=capacity), device)
        self.local_rope = local_rope_cache(replace(args, max_seq_len=capacity), device)  # Gemma 3's sliding layers'
        self.ropes = [args.rope_of(layer) for layer in range(args.n_layers)]
        self.capacity = capacity
        self.windows = [args.window_of(layer) for layer in range(args.n_layers)]  # each layer's mixer's window
        self.last_only = last_only
        self.real = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.positions = torch.zeros(batch, capacity, dtype=torch.long, device=device)
        self.rotary_dim = args.rotary_dim
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        # Gated DeltaNet layers: the last kernel - 1 pre-conv qkv columns [batch, conv_dim, kernel - 1] and the state
        # [batch, value_heads, dk, dv] (float32), absent until the layer's first forward
        self.conv_windows: dict[int, torch.Tensor] = {}
        self.recurrent_states: dict[int, torch.Tensor] = {}
        # latent attention layers (DeepSeek-V3): the normed latent [batch, capacity, kv_lora_rank] and the rotated
        # rope key [batch, capacity, 1, qk_rope_head_dim], not the expanded keys and values
        self.latents: dict[int, torch.Tensor] = {}
        self.rope_keys: dict[int, torch.Tensor] = {}
        self.start = self.end = 0
        self.rows, self.local_rows, self.masks = None, None, {}

    def step(self, real: torch.Tensor, positions: torch.Tensor) -> "KVCache":
        """Open slots for a [batch, seq] forward: `real` marks real tokens, `positions` their rotary positions."""
        seq = real.shape[1]
        self.start, self.end = self.end, self.end + seq
        if self.end > self.capacity:
            raise ValueError(f"KV cache of {self.capacity} slots is full")
        self.real[:, self.start:self.end] = real
        self.positions[:, self.start:self.end] = positions
        self.rows = self.rope[positions]
        self.local_rows = None if self.local_rope is None else self.local_rope[positions]
        self.masks = {window: self.visible(positions, window) for window in set(self.windows)}
        return self

    def visible(self, positions: torch.Tensor, window: int | None) -> torch.Tensor:
        """The open slots' mask [batch, 1, seq, end] for layers attending within `window` (None: no window)."""
        slots = torch.arange(self.end, device=positions.device)
        queries = slots[self.start:, None]
        visible = self.real[:, None, :self.end] & (slots[None, :] <= queries)[None]
        if window is not None:
            visible &= within_window(positions, self.positions[:, :self.end], window)
        return (visible | (slots[None, :] == queries)[None])[:, None]

    def layer(self, layer_id: int) -> "LayerView":
        return LayerView(self, layer_id)


@dataclass
class LayerView:
    """One layer's access to the cache (the model's LayerCache protocol)."""

    cache: KVCache
    layer_id: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        c = self.cache
        rows = c.local_rows if c.ropes[self.layer_id] == "local" else c.rows
        q = rotate_channels(q, rows, c.rotary_dim).transpose(1, 2)
        k = rotate_channels(k, rows, c.rotary_dim).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.layer_id not in c.keys:
            shape = (k.shape[0], k.shape[1], c.capacity, k.shape[3])
            c.keys[self.layer_id] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            c.values[self.layer_id] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        keys, values = c.keys[self.layer_id], c.values[self.layer_id]
        keys[:, :, c.start:c.end], values[:, :, c.start:c.end] = k, v
        mask = c.masks[c.windows[self.layer_id]]
        if sinks is not None:
            return sink_attention(q, keys[:, :, :c.end], values[:, :, :c.end], sinks, attn_mask=mask)
        return grouped_attention(q, keys[:, :, :c.end], values[:, :, :c.end], attn_mask=mask)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """A latent attention layer's rope channels [batch, seq, heads, rope] rotated at the open slots' positions."""
        return rotate_channels(x, self.cache.rows, x.shape[-1])

    def keep_latent(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the open slots' latent and rotated rope key; every cached slot's (the model expands them)."""
        c = self.cache
        if self.layer_id not in c.latents:
            c.latents[self.layer_id] = latent.new_zeros(latent.shape[0], c.capacity, latent.shape[-1])
            c.rope_keys[self.layer_id] = k_rope.new_zeros(k_rope.shape[0], c.capacity, *k_rope.shape[2:])
        latents, rope_keys = c.latents[self.layer_id], c.rope_keys[self.layer_id]
        latents[:, c.start:c.end], rope_keys[:, c.start:c.end] = latent, k_rope
        return latents[:, :c.end], rope_keys[:, :c.end]

    @property
    def mask(self) -> torch.Tensor:
        """The open slots' mask over every slot so far [batch, 1, seq, end] (this layer's window)."""
        return self.cache.masks[self.cache.windows[self.layer_id]]

    @property
    def real(self) -> torch.Tensor:
        """[batch, seq] which of the open slots hold real tokens (a recurrent layer zeroes the others' inputs)."""
        return self.cache.real[:, self.cache.start:self.cache.end]

    def states(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A recurrent layer's (conv window, state) so far; None before its first forward."""
        return self.cache.conv_windows.get(self.layer_id), self.cache.recurrent_states.get(self.layer_id)

    def keep_states(self, conv_window: torch.Tensor, state: torch.Tensor) -> None:
        self.cache.conv_windows[self.layer_id], self.cache.recurrent_states[self.layer_id] = conv_window, state


def kv_cache_bytes(args: LlamaArgs, rows: int, capacity: int, element_bytes: int, tp: int = 1) -> int:
    """Keys and values of every attention layer for `rows` sequences of `capacity` slots, each rank holding 1/tp of the
    KV heads (what a KVCache allocates; a latent attention layer's latent and rope key, unsharded), plus its mask and
    bookkeeping; each Gated DeltaNet layer's conv window and float32 state, whatever the capacity."""
    attention = [layer for layer in range(args.n_layers) if args.layer_type(layer) != "linear_attention"]
    per_slot = sum(args.kv_lora_rank + args.qk_rope_head_dim if args.layer_type(layer) == "latent_attention" else
                   2 * args.heads_of(layer)[1] // tp * args.head_dim for layer in attention)
    key_dim, value_dim = args.linear_n_key_heads * args.linear_key_head_dim, \
        args.linear_n_value_heads * args.linear_value_head_dim
    # the conv window holds every channel (qkv and the conv are replicated under TP), the state this rank's heads
    per_recurrent = (2 * key_dim + value_dim) * (args.linear_conv_kernel - 1) * element_bytes + \
        args.linear_key_head_dim * value_dim // tp * 4
    recurrent = (args.n_layers - len(attention)) * per_recurrent
    return rows * (capacity * (per_slot * element_bytes + capacity + 9) + recurrent)


def latent_expansion_bytes(args: LlamaArgs, rows: int, slots: int, element_bytes: int, tp: int = 1) -> int:
    """What a latent attention layer (DeepSeek-V3) expands from every cached slot at each forward, one layer at a
    time: kv_b_proj's output [k_nope | v] and the keys [k_nope | k_rope] per head, the heads split over TP (0 without
    latent attention)."""
    if not args.is_latent:
        return 0
    width = 2 * args.qk_nope_head_dim + args.v_head_dim + args.qk_rope_head_dim
    return rows * slots * args.n_heads // tp * width * element_bytes
