"""The decode engine's cache: a fixed number of slots, each one sequence whose token at position p sits in cache
column p (no padding), preallocated for every attention layer's keys and values and every Gated DeltaNet layer's
conv window and recurrent state, beside a one-row staging cache a prompt is prefilled into once and copied from into
the slots its completions take. A prefill forward and the static-shape decode step read it through their own views
(the model's LayerCache and RecurrentCache protocols)."""

from dataclasses import dataclass, replace

import torch

from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.rope import local_rope_cache, rope_cache, rotate_channels
from titan_lite.models.parts.sdpa import grouped_attention, sink_attention


class SlotCache:
    """`slots` rows of `capacity` columns per layer (row `slots` is the staging row), allocated by `allocate`."""

    def __init__(self, args: LlamaArgs, slots: int, capacity: int, device: torch.device):
        self.rope = rope_cache(replace(args, max_seq_len=capacity), device)
        self.local_rope = local_rope_cache(replace(args, max_seq_len=capacity), device)
        self.ropes = [args.rope_of(layer) for layer in range(args.n_layers)]
        self.windows = [args.window_of(layer) for layer in range(args.n_layers)]
        self.rotary_dim = args.rotary_dim
        self.slots, self.capacity = slots, capacity
        self.keys: dict[int, torch.Tensor] = {}  # [slots + 1, kv_heads, capacity, head_dim]
        self.values: dict[int, torch.Tensor] = {}
        self.conv_windows: dict[int, torch.Tensor] = {}  # [slots + 1, conv_dim, kernel - 1]
        self.recurrent_states: dict[int, torch.Tensor] = {}  # [slots + 1, value_heads, dk, dv] float32

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys.values(), *self.values.values(), *self.conv_windows.values(),
                *self.recurrent_states.values()]

    def copy_staged(self, rows: torch.Tensor, length: int) -> None:
        """Copy the staging row's first `length` columns (and recurrent states) into `rows` [n] of the slots."""
        staging = self.slots
        for table in (self.keys, self.values):
            for t in table.values():
                t[rows, :, :length] = t[staging, :, :length].clone()
        for table in (self.conv_windows, self.recurrent_states):
            for t in table.values():
                t[rows] = t[staging].clone()

    def rows_of(self, positions: torch.Tensor, layer_id: int) -> torch.Tensor:
        rope = self.local_rope if self.ropes[layer_id] == "local" else self.rope
        return rope[positions]


class PrefillView:
    """A prompt's forward [1, length] into the staging row, from an empty cache: causal attention among its tokens."""

    last_only = True

    def __init__(self, cache: SlotCache, length: int, device: torch.device):
        self.cache, self.length = cache, length
        positions = torch.arange(length, device=device)
        self.positions = positions[None]
        self.masks = {w: _visible(positions, positions, w)[None, None] for w in set(cache.windows)}
        self.real = torch.ones(1, length, dtype=torch.bool, device=device)

    def layer(self, layer_id: int) -> "PrefillLayer":
        return PrefillLayer(self, layer_id)


@dataclass
class PrefillLayer:
    view: PrefillView
    layer_id: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        c, n = self.view.cache, self.view.length
        q, k, v = _rotated(c, self.layer_id, self.view.positions, q, k, v)
        if self.layer_id not in c.keys:
            shape = (c.slots + 1, k.shape[1], c.capacity, k.shape[3])
            c.keys[self.layer_id] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            c.values[self.layer_id] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        c.keys[self.layer_id][c.slots, :, :n], c.values[self.layer_id][c.slots, :, :n] = k[0], v[0]
        return _attention(q, k, v, self.view.masks[c.windows[self.layer_id]], sinks)

    @property
    def real(self) -> torch.Tensor:
        return self.view.real

    def states(self) -> tuple[None, None]:
        return None, None  # a prompt starts from a zero conv window and state

    def keep_states(self, conv_window: torch.Tensor, state: torch.Tensor) -> None:
        c = self.view.cache
        if self.layer_id not in c.conv_windows:
            c.conv_windows[self.layer_id] = conv_window.new_zeros((c.slots + 1, *conv_window.shape[1:]))
            c.recurrent_states[self.layer_id] = state.new_zeros((c.slots + 1, *state.shape[1:]))
        c.conv_windows[self.layer_id][c.slots], c.recurrent_states[self.layer_id][c.slots] = conv_window[0], state[0]


class DecodeView:
    """One token per slot [slots, 1] at each slot's own position, written into column `position` of its row;
    attention over the first `end` columns (the whole capacity for a compiled step: one static shape)."""

    last_only = True

    def __init__(self, cache: SlotCache, positions: torch.Tensor, end: int):
        self.cache, self.end = cache, end
        self.positions = positions  # [slots]
        columns = torch.arange(end, device=positions.device)
        self.masks = {w: _visible(positions[:, None], columns, w)[:, None] for w in set(cache.windows)}
        self.real = torch.ones(positions.shape[0], 1, dtype=torch.bool, device=positions.device)
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
        q, k, v = _rotated(c, self.layer_id, view.positions[:, None], q, k, v)
        keys, values = c.keys[self.layer_id], c.values[self.layer_id]
        keys[view.slot_ids, :, view.positions] = k[:, :, 0]
        values[view.slot_ids, :, view.positions] = v[:, :, 0]
        n, end = q.shape[0], view.end
        return _attention(q, keys[:n, :, :end], values[:n, :, :end], view.masks[c.windows[self.layer_id]], sinks)

    @property
    def real(self) -> torch.Tensor:
        return self.view.real

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        c, n = self.view.cache, self.view.positions.shape[0]
        return c.conv_windows[self.layer_id][:n], c.recurrent_states[self.layer_id][:n]

    def keep_states(self, conv_window: torch.Tensor, state: torch.Tensor) -> None:
        c, n = self.view.cache, self.view.positions.shape[0]
        c.conv_windows[self.layer_id][:n].copy_(conv_window)
        c.recurrent_states[self.layer_id][:n].copy_(state)


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
