"""The decode engine's cache: a fixed number of slots, each one sequence whose token at position p sits in cache column
p (no padding), preallocated for every attention layer's keys and values, every latent attention layer's latent and
rope key (DeepSeek-V3) and every Gated DeltaNet layer's conv window and recurrent state; beside it a staging area a
batch of prompts is prefilled into (left-padded), once per prompt, and copied from into the slots its completions
take. A prefill forward and the static-shape decode step read it through their own views (the model's LayerCache,
LatentCache and RecurrentCache protocols)."""

from dataclasses import dataclass, replace

import torch

from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.rope import local_rope_cache, rope_cache, rotate_channels
from titan_lite.models.parts.sdpa import grouped_attention, sink_attention


class SlotCache:
    """`slots` rows of `capacity` columns per layer, and `stage_rows` staging rows of `stage_width` columns, allocated
    at the first prefill (the dtypes and head counts are the layers')."""

    def __init__(self, args: LlamaArgs, slots: int, capacity: int, stage_rows: int, stage_width: int,
                 device: torch.device):
        self.rope = rope_cache(replace(args, max_seq_len=capacity), device)
        self.local_rope = local_rope_cache(replace(args, max_seq_len=capacity), device)
        self.ropes = [args.rope_of(layer) for layer in range(args.n_layers)]
        self.windows = [args.window_of(layer) for layer in range(args.n_layers)]
        self.rotary_dim = args.rotary_dim
        self.slots, self.capacity, self.stage_rows, self.stage_width = slots, capacity, stage_rows, stage_width
        self.keys: dict[int, torch.Tensor] = {}  # [slots, kv_heads, capacity, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.conv_windows: dict[int, torch.Tensor] = {}  # [slots, conv_dim, kernel - 1]
        self.recurrent_states: dict[int, torch.Tensor] = {}  # [slots, value_heads, dk, dv] float32
        self.latents: dict[int, torch.Tensor] = {}  # [slots, capacity, kv_lora_rank], normed
        self.rope_keys: dict[int, torch.Tensor] = {}  # [slots, capacity, 1, qk_rope_head_dim], rotated
        # the same, of the staging area: [stage_rows, kv_heads, stage_width, head_dim], [stage_rows, ...],
        # [stage_rows, stage_width, ...]
        self.stage: tuple[dict[int, torch.Tensor], ...] = ({}, {}, {}, {}, {}, {})

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys.values(), *self.values.values(), *self.conv_windows.values(),
                *self.recurrent_states.values(), *self.latents.values(), *self.rope_keys.values()]

    def copy_staged(self, stage_row: int, rows: torch.Tensor, start: int, length: int) -> None:
        """Slots `rows` [n] take staging row `stage_row`'s prompt (its columns start..start + length: after its left
        padding) at columns 0..length, and its recurrent states."""
        stage_keys, stage_values, stage_convs, stage_states, stage_latents, stage_rope_keys = self.stage
        for table, staged in ((self.keys, stage_keys), (self.values, stage_values)):
            for layer, t in table.items():
                t[rows, :, :length] = staged[layer][stage_row, :, start:start + length]
        for table, staged in ((self.latents, stage_latents), (self.rope_keys, stage_rope_keys)):
            for layer, t in table.items():
                t[rows, :length] = staged[layer][stage_row, start:start + length]
        for table, staged in ((self.conv_windows, stage_convs), (self.recurrent_states, stage_states)):
            for layer, t in table.items():
                t[rows] = staged[layer][stage_row]

    def rows_of(self, positions: torch.Tensor, layer_id: int) -> torch.Tensor:
        rope = self.local_rope if self.ropes[layer_id] == "local" else self.rope
        return rope[positions]


class PrefillView:
    """A batch of left-padded prompts [batch, width] into the first staging rows, from an empty cache: each token
    attends to its own prompt's tokens up to itself (within a window). `last_only` False: every position's logits
    (sequence parallelism holds the sequence in pieces, the last one's on the last rank)."""

    def __init__(self, cache: SlotCache, real: torch.Tensor, last_only: bool = True):
        self.cache, self.real, self.last_only = cache, real, last_only
        self.positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        width = real.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=real.device).tril()
        self.masks = {}
        for w in set(cache.windows):
            visible = real[:, None, :] & causal
            if w is not None:
                visible &= self.positions[:, :, None] - self.positions[:, None, :] < w
            # a padding query sees itself (a softmax over nothing would be NaN)
            self.masks[w] = (visible | torch.eye(width, dtype=torch.bool, device=real.device))[:, None]

    def layer(self, layer_id: int) -> "PrefillLayer":
        return PrefillLayer(self, layer_id)


@dataclass
class PrefillLayer:
    view: PrefillView
    layer_id: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        c, (batch, width) = self.view.cache, self.view.real.shape
        q, k, v = _rotated(c, self.layer_id, self.view.positions, q, k, v)
        keys, values = c.stage[0], c.stage[1]
        if self.layer_id not in keys:
            shape = (c.stage_rows, k.shape[1], c.stage_width, k.shape[3])
            keys[self.layer_id] = k.new_zeros(shape)
            values[self.layer_id] = v.new_zeros(shape)
            c.keys[self.layer_id] = k.new_zeros((c.slots, k.shape[1], c.capacity, k.shape[3]))
            c.values[self.layer_id] = v.new_zeros((c.slots, k.shape[1], c.capacity, k.shape[3]))
        keys[self.layer_id][:batch, :, :width], values[self.layer_id][:batch, :, :width] = k, v
        return _attention(q, k, v, self.view.masks[c.windows[self.layer_id]], sinks)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """A latent attention layer's rope channels [batch, width, heads, rope] rotated at the prompts' positions."""
        return rotate_channels(x, self.view.cache.rows_of(self.view.positions, self.layer_id), x.shape[-1])

    def keep_latent(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the prompts' latent [batch, width, rank] and rotated rope key [batch, width, 1, rope]; the prompts'
        own (an empty cache holds nothing before them)."""
        c, (batch, width) = self.view.cache, self.view.real.shape
        latents, rope_keys = c.stage[4], c.stage[5]
        if self.layer_id not in latents:
            latents[self.layer_id] = latent.new_zeros((c.stage_rows, c.stage_width, latent.shape[-1]))
            rope_keys[self.layer_id] = k_rope.new_zeros((c.stage_rows, c.stage_width, *k_rope.shape[2:]))
            c.latents[self.layer_id] = latent.new_zeros((c.slots, c.capacity, latent.shape[-1]))
            c.rope_keys[self.layer_id] = k_rope.new_zeros((c.slots, c.capacity, *k_rope.shape[2:]))
        latents[self.layer_id][:batch, :width], rope_keys[self.layer_id][:batch, :width] = latent, k_rope
        return latent, k_rope

    @property
    def mask(self) -> torch.Tensor:
        """[batch, 1, width, width]: each prompt token sees its own prompt's up to itself (a padding one itself)."""
        return self.view.masks[self.view.cache.windows[self.layer_id]]

    @property
    def real(self) -> torch.Tensor:
        return self.view.real

    def states(self) -> tuple[None, None]:
        return None, None  # a prompt starts from a zero conv window and state (its padding keeps them zero)

    def keep_states(self, conv_window: torch.Tensor, state: torch.Tensor) -> None:
        c, batch = self.view.cache, conv_window.shape[0]
        convs, states = c.stage[2], c.stage[3]
        if self.layer_id not in convs:
            convs[self.layer_id] = conv_window.new_zeros((c.stage_rows, *conv_window.shape[1:]))
            states[self.layer_id] = state.new_zeros((c.stage_rows, *state.shape[1:]))
            c.conv_windows[self.layer_id] = conv_window.new_zeros((c.slots, *conv_window.shape[1:]))
            c.recurrent_states[self.layer_id] = state.new_zeros((c.slots, *state.shape[1:]))
        convs[self.layer_id][:batch], states[self.layer_id][:batch] = conv_window, state


class DecodeView:
    """One token per slot at each slot's own position, written into column `position` of its row; attention over
    the first `end` columns (the whole capacity for a compiled step: one static shape). `width` > 1 (a sequence
    parallel degree): each slot's token comes last in [slots, width], after width - 1 padding tokens that are
    cached nowhere and whose outputs are dropped (their queries see the slot's columns, so nothing is NaN)."""

    def __init__(self, cache: SlotCache, positions: torch.Tensor, end: int, width: int = 1):
        self.cache, self.end, self.last_only = cache, end, width == 1
        self.positions = positions[:, None].expand(-1, width)  # [slots, width]
        columns = torch.arange(end, device=positions.device)
        self.masks = {w: _visible(positions[:, None], columns, w)[:, None] for w in set(cache.windows)}
        self.real = torch.zeros(positions.shape[0], width, dtype=torch.bool, device=positions.device)
        self.real[:, -1] = True
        self.slot_ids = torch.arange(positions.shape[0], device=positions.device)

    def layer(self, layer_id: int) -> "DecodeLayer":
        return DecodeLayer(self, layer_id)


@dataclass
class DecodeLayer:
    view: DecodeView
    layer_id: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        view, c = self.view, self.view.cache
        q, k, v = _rotated(c, self.layer_id, view.positions, q, k, v)
        keys, values = c.keys[self.layer_id], c.values[self.layer_id]
        keys[view.slot_ids, :, view.positions[:, -1]] = k[:, :, -1]
        values[view.slot_ids, :, view.positions[:, -1]] = v[:, :, -1]
        end = view.end
        return _attention(q, keys[:, :, :end], values[:, :, :end], view.masks[c.windows[self.layer_id]], sinks)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """A latent attention layer's rope channels [slots, width, heads, rope] rotated at each slot's position."""
        return rotate_channels(x, self.view.cache.rows_of(self.view.positions, self.layer_id), x.shape[-1])

    def keep_latent(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each slot's new latent and rope key (its last token's) into column `position`; the first `end`
        columns of every slot's."""
        view, c = self.view, self.view.cache
        latents, rope_keys = c.latents[self.layer_id], c.rope_keys[self.layer_id]
        latents[view.slot_ids, view.positions[:, -1]] = latent[:, -1]
        rope_keys[view.slot_ids, view.positions[:, -1]] = k_rope[:, -1]
        return latents[:, :view.end], rope_keys[:, :view.end]

    @property
    def mask(self) -> torch.Tensor:
        """[slots, 1, 1, end]: the columns up to each slot's position (the same for a width's padding queries)."""
        return self.view.masks[self.view.cache.windows[self.layer_id]]

    @property
    def real(self) -> torch.Tensor:
        return self.view.real

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.view.cache
        return c.conv_windows[self.layer_id], c.recurrent_states[self.layer_id]

    def keep_states(self, conv_window: torch.Tensor, state: torch.Tensor) -> None:
        c = self.view.cache
        c.conv_windows[self.layer_id].copy_(conv_window)
        c.recurrent_states[self.layer_id].copy_(state)


def _visible(q_positions: torch.Tensor, k_columns: torch.Tensor, window: int | None) -> torch.Tensor:
    """[..., q, k] bool: the columns at or before each query's position (column = position), within its window."""
    before = q_positions[..., None] - k_columns
    visible = before >= 0
    return visible if window is None else visible & (before < window)


def _rotated(c: SlotCache, layer_id: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k rotated at `positions` [batch, seq], then q, k, v as [batch, heads, seq, head_dim]."""
    rows = c.rows_of(positions, layer_id)
    q, k = rotate_channels(q, rows, c.rotary_dim), rotate_channels(k, rows, c.rotary_dim)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               sinks: torch.Tensor | None) -> torch.Tensor:
    if sinks is not None:
        return sink_attention(q, k, v, sinks, attn_mask=mask)
    return grouped_attention(q, k, v, attn_mask=mask)
