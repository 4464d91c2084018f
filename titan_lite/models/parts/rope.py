"""Rotary position embeddings: the per-pair frequencies with their long-context scalings (llama3, yarn, linear), the
cos/sin cache (of the rotated channels: all of a head's, or the first rotary_dim) and its application to interleaved
pairs (x0, x1), (x2, x3), ... (Meta's and torchtitan's layout; HF checkpoints use the half-split layout and are
permuted on import and export, models/hf/state_dict.py)."""

import math
from dataclasses import replace

import torch

from titan_lite.models.args import LlamaArgs


def rope_frequencies(args: LlamaArgs) -> torch.Tensor:
    """Per-pair rotation frequencies (float64) of the rotated channels, with the args' long-context scaling when
    configured."""
    dim = args.rotary_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if args.rope_scaling_factor is None:
        return freqs
    scale = {"llama3": _llama3_frequencies, "yarn": _yarn_frequencies, "linear": _linear_frequencies}
    return scale[args.rope_scaling_type](freqs, args)


def _llama3_frequencies(freqs: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by the factor, short ones kept, a smooth blend in between."""
    factor, low, high = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    old_len = args.rope_original_max_seq_len
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, freqs / factor, freqs)  # long wavelengths: fully scaled
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    in_between = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_between, blended, scaled)


def _linear_frequencies(freqs: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """Position interpolation: every frequency divided by the factor."""
    return freqs / args.rope_scaling_factor


def _yarn_frequencies(freqs: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """YaRN's NTK-by-parts: pairs that turn more than beta_fast times over the original context keep their frequency,
    pairs that turn less than beta_slow times are divided by the factor, a linear ramp over the pairs in between."""
    dim, base = args.rotary_dim, args.rope_theta

    def pair_turning(rotations: float) -> float:  # the (fractional) pair index that turns `rotations` times
        return dim * math.log(args.rope_original_max_seq_len / (2 * math.pi * rotations)) / (2 * math.log(base))

    low, high = pair_turning(args.rope_beta_fast), pair_turning(args.rope_beta_slow)
    if args.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return freqs * (1 - ramp) + freqs / args.rope_scaling_factor * ramp


def rope_attention_factor(args: LlamaArgs) -> float:
    """What cos and sin are multiplied by (so q.k by its square): YaRN's attention factor, else 1. Applied to the
    cache, as transformers does, rather than folded into the softmax scale (torchtitan): the logits match its."""
    factor = args.rope_scaling_factor
    if factor is None or args.rope_scaling_type != "yarn":
        return 1.0
    if args.rope_attention_factor is not None:
        return args.rope_attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if args.rope_mscale and args.rope_mscale_all_dim:
        return mscale(factor, args.rope_mscale) / mscale(factor, args.rope_mscale_all_dim)
    return mscale(factor)


def rope_cache(args: LlamaArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos and sin of every (position, pair), times the attention factor: shape [max_seq_len, rotary_dim // 2, 2],
    float32."""
    freqs = rope_frequencies(args)
    angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
    cache = torch.stack([angles.cos(), angles.sin()], dim=-1) * rope_attention_factor(args)
    return cache.to(device=device, dtype=torch.float32)


def apply_rope(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [batch, seq, heads, head_dim] by the cache rows of its positions: [seq, pairs, 2]
    shared by the batch, or [batch, seq, pairs, 2] with positions of their own per sequence (generation).

    Eager: one complex multiplication (the pair (x0, x1) as x0 + i x1, the cache row as cos + i sin), a single
    kernel forward and backward. Compiled: the same arithmetic on real pairs, which inductor fuses into one kernel
    (it generates no code for complex numbers).
    """
    if torch.compiler.is_compiling():
        return apply_rope_real_pairs(x, cache)
    rows = torch.view_as_complex(cache.contiguous())
    rotation = rows[:, :, None, :] if rows.dim() == 3 else rows[None, :, None, :]
    # contiguous: a linear may return a transposed result (2:4 sparse kernels do), and complex views need stride 1
    pairs = torch.view_as_complex(x.float().contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


def apply_rope_real_pairs(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """apply_rope on real pairs: (x0 cos - x1 sin, x0 sin + x1 cos)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    rows = cache if cache.dim() == 4 else cache[None]
    cos, sin = rows[:, :, None, :, 0], rows[:, :, None, :, 1]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def rotate_channels(x: torch.Tensor, cache: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """apply_rope on each head's first rotary_dim channels (all of them: plain RoPE); the others pass through."""
    if rotary_dim == x.shape[-1]:
        return apply_rope(x, cache)
    return torch.cat([apply_rope(x[..., :rotary_dim], cache), x[..., rotary_dim:]], dim=-1)


def local_rope_cache(args: LlamaArgs, device: torch.device | None = None) -> torch.Tensor | None:
    """The sliding layers' own cache (Gemma 3: base rope_local_theta, no scaling), or None where every layer shares
    rope_cache."""
    if args.rope_local_theta is None:
        return None
    return rope_cache(replace(args, rope_theta=args.rope_local_theta, rope_scaling_factor=None), device)
