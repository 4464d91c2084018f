"""The Llama model, top to bottom: RoPE, attention with GQA, SwiGLU, mixture of experts, blocks, the model, its
initialisation. The families are options of it (args.py): q/k/v biases (Qwen2/2.5), q/k RMSNorms over head_dim
(Qwen3, attention.q_norm and k_norm), a sliding window (Mistral v0.1), routed experts in place of the dense
feed-forward (Qwen3-MoE, Mixtral: layers.{i}.moe.router.gate, moe.experts.w1/w2/w3 grouped [E, ...]).

Conventions (shared with Meta's reference checkpoints and torchtitan): module names tok_embeddings, layers.{i}
(attention.wq/wk/wv/wo, feed_forward.w1/w2/w3, attention_norm, ffn_norm), norm, output; RoPE rotates
interleaved pairs (x0, x1), (x2, x3), ... Hugging Face checkpoints use the half-split layout and are permuted
on import and export (see hf.py).
"""

import math
import zlib
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_lite.dtensor import copy_into_shard, local_tensor
from titan_lite.models.llama.args import LlamaArgs
from titan_lite.models.llama.flex import BlockMask, document_block_mask, flex_attend

# ------------------------------------------------------------------------------------------ RoPE


def rope_frequencies(args: LlamaArgs) -> torch.Tensor:
    """Per-pair rotation frequencies (float64), with the args' long-context scaling when configured."""
    head_dim = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
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
    dim, base = args.head_dim, args.rope_theta

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
    """cos and sin of every (position, pair), times the attention factor: shape [max_seq_len, head_dim // 2, 2],
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


# ------------------------------------------------------------------------------------- attention


class LayerCache(Protocol):
    """One layer's view of a generation KV cache (titan_lite.generate): rotates q and k at the cached
    sequence's positions, appends k and v, and attends q [batch, seq, heads, head_dim] to every cached key;
    returns [batch, heads, seq, head_dim]."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class KVCache(Protocol):
    last_only: bool  # compute the last position's logits only (not when ranks hold pieces of the sequence)

    def layer(self, layer_id: int) -> LayerCache: ...


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                      is_causal: bool = False) -> torch.Tensor:
    """SDPA of q [batch, heads, seq, head_dim] against k, v [batch, kv_heads, kv_seq, head_dim], kv_heads dividing
    heads (GQA): each group of heads // kv_heads consecutive query heads shares one K/V head."""
    if k.shape[1] == q.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    if _fused_kernel_takes_gqa(q, k, v, attn_mask, is_causal):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)


def _fused_kernel_takes_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                            is_causal: bool) -> bool:
    """Whether a fused SDPA kernel reads the fewer K/V heads itself. Where none does, enable_gqa falls back to the
    math kernel, which keeps the whole [seq, kv_seq] score matrix: expanding K/V first is then far cheaper."""
    if q.device.type == "cpu":
        return True  # the CPU flash kernel takes GQA, with or without a mask, and is no slower than expanding
    if q.device.type != "cuda":
        return False
    if torch.compiler.is_compiling():
        # SDPAParams cannot be traced: decide by the flash kernel's own conditions (half precision, no mask)
        return attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
    # On CUDA it depends on the kernel (flash: no mask, half precision) and, for the others, the torch version.
    params = torch.backends.cuda.SDPAParams(q, k, v, attn_mask, 0.0, is_causal, True)
    return any(can_use(params) for can_use in (torch.backends.cuda.can_use_flash_attention,
                                                torch.backends.cuda.can_use_efficient_attention,
                                                torch.backends.cuda.can_use_cudnn_attention))


def within_window(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[..., q, k] bool: the keys inside each query's sliding window, key position > query position - window (a query
    sees itself and the window - 1 positions before it, as transformers' Mistral). Combine it with a causal or padding
    mask by `&`: it says nothing about keys after the query."""
    return k_positions[..., None, :] > q_positions[..., :, None] - window


def windowed_causal_mask(seq: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[seq, seq] bool causal mask limited to the sliding window, or None when the window covers the sequence (plain
    causal attention, which SDPA runs without a mask)."""
    if window is None or window >= seq:
        return None
    positions = torch.arange(seq, device=device)
    return (positions[None, :] <= positions[:, None]) & within_window(positions, positions, window)


def block_causal_mask(query_documents: torch.Tensor, query_index: torch.Tensor, key_documents: torch.Tensor,
                      dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The additive SDPA mask of packed documents, [batch, 1, queries, keys]: 0 where a query may attend (a key of its
    own document at or before it), -inf elsewhere. Queries are given by their documents [batch, queries] and global
    indices [queries]; keys are the whole sequence [batch, keys]. Additive in the compute dtype, built once per
    forward: every layer's SDPA then reads (and saves for backward) this one tensor, where a boolean mask would be
    converted again by each call. With a sliding window a query also sees only the window's last keys."""
    keys = torch.arange(key_documents.shape[1], device=key_documents.device)
    allowed = (query_documents[:, :, None] == key_documents[:, None, :]) & (query_index[:, None] >= keys[None, :])
    if window is not None:
        allowed &= within_window(query_index, keys, window)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))[:, None]


@dataclass(frozen=True)
class DocumentSpans:
    """The documents of a batch as (start, end) runs of every row: eager CPU attention attends within each run alone
    (causal SDPA per document), which skips every query-key pair of two documents, where a dense mask computes them
    all and masks them out (Σ len² instead of seq² per row)."""

    rows: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def of(cls, documents: torch.Tensor) -> "DocumentSpans":
        rows = []
        for row in documents.tolist():
            starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
            rows.append(tuple(pairwise([*starts, len(row)])))
        return cls(tuple(rows))


class CausalAttention(nn.Module):
    """softmax(QK^T / sqrt(d)) V with a causal mask (limited to the last `window` positions when one is set), or
    block-causal over packed documents when the forward gets a document mask; a module so context parallel can swap
    it. flex: FlexAttention's block mask on CUDA.

    q: [batch, heads, seq, head_dim]; k, v: [batch, kv_heads, seq, head_dim] with kv_heads dividing heads (GQA).
    """

    def __init__(self, window: int | None = None, flex: bool = False):
        super().__init__()
        self.window = window
        self.flex = flex

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        if mask is None:
            return self.causal(q, k, v)
        if isinstance(mask, BlockMask):
            return flex_attend(q, k, v, mask)
        if isinstance(mask, DocumentSpans):
            return torch.cat([torch.cat([self.causal(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e])
                                         for s, e in row], dim=2)
                              for b, row in enumerate(mask.rows)])
        return grouped_attention(q, k, v, attn_mask=mask)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over one whole sequence (or document), within the sliding window when one is set."""
        window_mask = windowed_causal_mask(q.shape[2], self.window, q.device)
        if window_mask is None:
            return grouped_attention(q, k, v, is_causal=True)
        return grouped_attention(q, k, v, attn_mask=window_mask)

    def document_mask(self, documents: torch.Tensor, dtype: torch.dtype, compiled: bool = False):
        """The mask of documents [batch, seq] for this attention: a FlexAttention block mask (flex, on CUDA), the
        documents' spans (eager on a CPU), else block_causal_mask's dense one (CUDA's kernels, compiled blocks)."""
        if self.flex and documents.device.type == "cuda":
            return document_block_mask(documents, self.window)
        if documents.device.type == "cpu" and not compiled:
            return DocumentSpans.of(documents)
        return block_causal_mask(documents, torch.arange(documents.shape[1], device=documents.device), documents,
                                 dtype, self.window)

    def extra_repr(self) -> str:
        window = [f"window={self.window}"] if self.window is not None else []
        return ", ".join(window + (["flex"] if self.flex else []))


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, layer_id: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.heads_of(layer_id)
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        # Qwen3: one RMSNorm over head_dim, shared by every head, on q and on k.
        self.q_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.inner_attention = CausalAttention(args.sliding_window, flex=args.attn_type == "flex")

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                mask=None) -> torch.Tensor:
        batch, seq, _ = x.shape
        return self.wo(self.head_outputs(x, rope, cache, mask).reshape(batch, seq, -1))

    def head_outputs(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                     mask=None) -> torch.Tensor:
        """Each head's attention output before wo: [batch, seq, heads, head_dim] (a transform may gate heads).
        rope: the cache of every position [max_seq, pairs, 2], or each token's own rows [batch, seq, pairs, 2];
        mask: the packed documents' mask (None: causal)."""
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of the heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cache is not None:
            out = cache.attend(q, k, v)
        else:
            rows = rope if rope.dim() == 4 else rope[:seq]
            q, k = apply_rope(q, rows), apply_rope(k, rows)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            # K/V keep their n_kv_heads: the inner attention expands them, after any gather (context parallel).
            out = self.inner_attention(q, k, v) if mask is None else self.inner_attention(q, k, v, mask)
        return out.transpose(1, 2)


# --------------------------------------------------------------------------------------- RMSNorm


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (same parameter, same values); eager float32 on CPU runs _RMSNormFunction, since torch's CPU
    rms_norm is a composite of five ops whose autograd saves and re-reads more than the few passes below.
    Accelerators have a fused kernel and compiled code fuses the composite itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plain = not isinstance(x, DTensor) and not isinstance(self.weight, DTensor)
        if plain and x.device.type == "cpu" and x.dtype == self.weight.dtype == torch.float32 and \
                not torch.compiler.is_compiling():
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
            return _RMSNormFunction.apply(x, self.weight, eps)
        return super().forward(x)


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) per row, saving only (x, rstd)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        return (x * rstd).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        x_hat = x * rstd
        grad_weight = (grad * x_hat).flatten(0, -2).sum(0) if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, grad_weight, None
        g = grad * weight
        # d/dx of x_hat * w: rstd * (g - x_hat * mean(g * x_hat)) along the row
        row_mean = (g * x_hat).mean(-1, keepdim=True)
        return g.sub_(x_hat.mul_(row_mean)).mul_(rstd), grad_weight, None


# ------------------------------------------------------------------------------------------- MLP


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# ---------------------------------------------------------------------------- mixture of experts


def grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm computes x @ weight[e].T here: on CUDA sm90+ in bfloat16 (elsewhere on CUDA torch
    falls back to a loop with a host sync per expert, pytorch #161407, no faster than ours), and on the CPU (torch
    2.9+) when every row stride is a multiple of 16 bytes, eagerly or in bfloat16 (compiled code checks its inputs
    against the CUDA kernel's bfloat16-only rule); otherwise grouped_mm loops over the experts."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype or isinstance(weight, DTensor):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if x.device.type != "cpu" or (torch.compiler.is_compiling() and x.dtype != torch.bfloat16):
        return False
    return all(width * x.element_size() % 16 == 0 for width in weight.shape[1:])


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of x [tokens, in] grouped by expert (counts [E] consecutive rows each) times their expert's
    weight [E, out, in], transposed: [tokens, out]. One kernel where it runs (grouped_mm_runs), else a loop."""
    if grouped_mm_runs(x, weight):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    groups = x.split(counts.tolist())
    # unbind, not weight[e]: indexing's backward writes a whole [E, out, in] gradient per expert
    return torch.cat([group @ w.T for group, w in zip(groups, weight.unbind(0), strict=True)])


class GroupedExperts(nn.Module):
    """E SwiGLU experts held as grouped weights, torchtitan's layout: w1 (gate) and w3 (up) [E, hidden, dim], w2
    (down) [E, dim, hidden]; expert e of an HF checkpoint is w1[e] = gate_proj, w3[e] = up_proj, w2[e] = down_proj.

    The interface expert parallelism wraps: forward(x, counts) takes the routed tokens x [N, dim] already grouped by
    expert (counts[e] consecutive rows for expert e, e over the experts this module holds) and returns each row's
    expert output [N, dim] in the same order. It knows nothing of routing: EP shards the E dimension of w1/w2/w3 and
    moves the rows to their experts' ranks (all-to-all) before this call and back after it. A transform that adapts
    the experts (LoRA) overrides `project`, which applies one projection to the grouped rows."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.project("w1", x, counts)) * self.project("w3", x, counts)
        return self.project("w2", h, counts)

    def project(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Projection `name` (w1, w2 or w3) of each group of rows by its expert's weight."""
        return grouped_mm(x, local_tensor(getattr(self, name)), counts)

    def extra_repr(self) -> str:
        n_experts, hidden, dim = self.w1.shape
        return f"experts={n_experts}, dim={dim}, hidden={hidden}"


class Router(nn.Module):
    """Token-choice top-k routing (Qwen3-MoE, Mixtral): a linear to E logits, softmax in float32, the k most
    probable experts, their probabilities renormalised to sum 1 when norm_topk_prob."""

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, dim] -> (probabilities [tokens, E] float32, top-k weights [tokens, k] in x's dtype, top-k
        expert ids [tokens, k])."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(logits.dtype), experts


def load_balancing_loss(expert_counts: torch.Tensor, prob_sums: torch.Tensor, tokens: float) -> torch.Tensor:
    """transformers' load_balancing_loss_func (Switch Transformer): E * sum_e f_e * P_e, f_e = top-k assignments to
    expert e per token, P_e = its mean router probability, over `tokens` tokens whose expert_counts and prob_sums
    [..., E] are given; one value per leading index."""
    n_experts = expert_counts.shape[-1]
    return n_experts * ((expert_counts / tokens) * (prob_sums / tokens)).sum(-1)


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on the block's output whose backward also backpropagates `scale` x aux (an aux loss term computed
    inside the block): each MoE layer adds its term to the objective wherever it runs, pipeline stages included."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


@dataclass
class Routing:
    """One MoE forward's routing of tokens [N] with k choices each: `order` sorts the N*k (token, choice) pairs by
    expert (stable), `counts` [E] are the pairs per expert, `weights` [N, k] the gate weights, `probs` [N, E]."""

    probs: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, probs: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> "Routing":
        flat = experts.flatten()
        counts = torch.bincount(flat, minlength=probs.shape[-1])
        return cls(probs, weights, experts, torch.argsort(flat, stable=True), counts)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """The rows each expert computes, grouped by expert: [N * k, dim]."""
        return x[self.order // self.weights.shape[1]]

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Each token's gate-weighted sum of its k experts' outputs [N, dim], from the grouped outputs."""
        per_choice = self.unsort(expert_out).view(*self.weights.shape, -1)
        return (per_choice * self.weights[..., None]).sum(1)

    def unsort(self, grouped: torch.Tensor) -> torch.Tensor:
        """Grouped rows back in (token, choice) order: [N * k, ...]."""
        return grouped[torch.argsort(self.order)]


class MoE(nn.Module):
    """The routed feed-forward of a mixture-of-experts layer: router, then each token's top-k SwiGLU experts, the
    output their gate-weighted sum (Qwen3-MoE has no shared expert).

    Training adds transformers' load-balancing loss (load_balancing_loss) per sequence and layer, times
    `aux_loss_scale` (set by the trainer: router_aux_loss_coef over the sequences and MoE layers it averages, 0 = off);
    when the sequence is split over context-parallel ranks (`cp_group`), its expert counts are summed over them.
    `tokens_per_expert` and `aux_loss_sum` accumulate the routed load and the unscaled loss over a step, for metrics.
    """

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.router = Router(args.dim, args.n_experts, args.moe_top_k, args.moe_norm_topk_prob)
        self.experts = GroupedExperts(args.dim, args.moe_ffn_dim, args.n_experts)
        self.aux_loss_scale = 0.0
        self.cp_group = None
        self._without_first: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's sums but its first forward
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        routing = Routing.of(*self.router(x.reshape(-1, dim)))
        out = routing.combine(self.experts(routing.dispatch(x.reshape(-1, dim)), routing.counts))
        out = out.view(batch, seq, dim)
        if self.training and torch.is_grad_enabled():
            aux = self.sequence_aux_losses(routing, batch) if self.aux_loss_scale else None
            self.record(routing.counts, aux)
            if aux is not None:
                out = _AddAuxLossGrad.apply(out, aux.sum(), self.aux_loss_scale)
        return out

    def sequence_aux_losses(self, routing: Routing, batch: int) -> torch.Tensor:
        """load_balancing_loss of each sequence [batch] (this rank's share of it under context parallel)."""
        n_experts = routing.probs.shape[-1]
        choices = routing.experts.view(batch, -1)
        with torch.no_grad():
            counts = torch.zeros(batch, n_experts, device=choices.device).scatter_add_(
                1, choices, torch.ones_like(choices, dtype=torch.float32))
            tokens = routing.experts.shape[0] // batch
            if self.cp_group is not None:
                torch.distributed.all_reduce(counts, group=self.cp_group)
                tokens *= torch.distributed.get_world_size(self.cp_group)
        prob_sums = routing.probs.view(batch, -1, n_experts).sum(1)
        return load_balancing_loss(counts, prob_sums, tokens)

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_loss_sum.zero_()
        self._without_first = None

    @torch.compiler.disable
    def record(self, counts: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Add this forward's load (and aux loss) to the step's sums, except when activation checkpointing recomputes
        the forward inside the backward pass."""
        if torch._C._current_graph_task_id() != -1:
            return
        counts = counts.detach().to(self.tokens_per_expert.dtype)
        aux = aux.detach().sum() if aux is not None else torch.zeros_like(self.aux_loss_sum)
        if self._without_first is None:
            self._without_first = (self.tokens_per_expert.clone(), self.aux_loss_sum.clone())
        else:
            self._without_first[0].add_(counts)
            self._without_first[1].add_(aux)
        self.tokens_per_expert += counts
        self.aux_loss_sum += aux

    def discard_first_forward(self) -> None:
        """Take the step's first forward out of its sums: a pipeline stage's first run adds one forward, on
        placeholder activations, to infer shapes. The sums are rebuilt without it rather than it subtracted: the
        placeholders are uninitialised memory, whose aux loss may be NaN."""
        if self._without_first is not None:
            self.tokens_per_expert.copy_(self._without_first[0])
            self.aux_loss_sum.copy_(self._without_first[1])
            self._without_first = None


# ----------------------------------------------------------------------------------------- block


class TransformerBlock(nn.Module):
    """Attention, then the feed-forward: dense (feed_forward) or, in the MoE layers of an MoE model, routed (moe)."""

    def __init__(self, args: LlamaArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim_of(layer_id))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LayerCache | None = None,
                mask=None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, cache=cache, mask=mask)
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return h + mlp(self.ffn_norm(h))


# ----------------------------------------------------------------------------------------- model


class Llama(nn.Module):
    """A decoder-only Llama. Pipeline stages set tok_embeddings, norm or output to None and drop layers."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A dict keyed by the global layer id, so names stay stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_embeddings()
        self.register_buffer("rope_cache", rope_cache(args), persistent=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, *, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [batch, seq] (or hidden states on a later pipeline stage) -> logits or hidden states.

        `cache` (generation only, see titan_lite.generate): attention reads and extends the cache's keys and
        values at its positions (it holds their rotary rows: the blocks get no rope), and only the last position's
        logits are computed when its `last_only` says so. Training never passes one.
        `positions` and `documents` (packed documents, attn_mask_type block_causal): every input token's RoPE
        position [batch, seq] and the document id of every key position [batch, kv_seq] (the whole sequence under
        context parallel); each token attends only within its document. The mask is built once, for every layer.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope, mask = self.rope_cache, None
        if documents is not None:
            rope, mask = self.rope_cache[positions], self.document_mask(documents, h)
        for key, layer in self.layers.items():
            if cache is not None:
                h = layer(h, None, cache.layer(int(key)))
            else:
                h = layer(h, rope) if mask is None else layer(h, rope, mask=mask)
        if cache is not None and cache.last_only:
            h = h[:, -1:]
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def document_mask(self, documents: torch.Tensor, h: torch.Tensor):
        """The mask of documents for this model's attention (plain or context parallel), in the compute dtype."""
        block = next(iter(self.layers.values()), None)
        if block is None:
            return None
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
        inner = block.attention.inner_attention
        if isinstance(inner, CausalAttention):  # compiled blocks (torch.compile's wrapper) take tensor masks only
            return inner.document_mask(documents, dtype, compiled=hasattr(block, "_orig_mod"))
        return inner.document_mask(documents, dtype)

    def tie_embeddings(self) -> None:
        """Where the args tie them, make the output head share the embedding's parameter. Moving a model to real
        memory (`to_empty`) gives each module a tensor of its own, so materialising calls this again."""
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter from a generator seeded by (seed, parameter name).

        Each parameter's full tensor is drawn and this rank keeps its own shard, so the initial model is the
        same whatever the parallel layout: a sharded run starts exactly where a single-process run does. A module
        that owns the init of its parameters (a transform's adapter, say) declares it with `param_init()`.
        """
        device = buffer_device or self.rope_cache.device
        self.rope_cache = rope_cache(self.args, device)
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_stats()
        seen: set[int] = set()  # a tied head shares the embedding's parameter: initialise it once, as the embedding
        for module_name, module in self.named_modules():
            owned = module.param_init() if hasattr(module, "param_init") else {}
            for local_name, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                name = canonical_name(f"{module_name}.{local_name}" if module_name else local_name)
                # a transform's own (small) parameters are drawn on the CPU: an adapter then starts the same on
                # every device (a CUDA generator draws other numbers), at no cost worth counting
                draw_on = torch.device("cpu") if local_name in owned else device
                full = torch.empty(param.shape, dtype=param.dtype, device=draw_on)
                generator = torch.Generator(device=draw_on).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                if local_name in owned:
                    owned[local_name](full, generator)
                else:
                    init_parameter(name, full, self.args, generator)
                copy_into_shard(param, full.to(device))

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (tied weights counted once); optionally without the input embedding."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and self.tok_embeddings is not None:
            total -= self.tok_embeddings.weight.numel()
        return total


_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name without compile/checkpoint wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def init_parameter(name: str, tensor: torch.Tensor, args: LlamaArgs, generator: torch.Generator) -> None:
    """torchtitan-style init: unit-normal embeddings, std 0.02 projections scaled down with depth on the
    residual outputs, dim^-0.5 output head, ones for norms."""
    if name.endswith("norm.weight"):
        tensor.fill_(1.0)
        return
    if name.endswith(".bias"):
        tensor.zero_()
        return
    if name == "tok_embeddings.weight":
        std = args.dim ** -0.5 if args.tie_word_embeddings else 1.0
        nn.init.normal_(tensor, 0.0, std, generator=generator)
        return
    if name == "output.weight":
        std = args.dim ** -0.5
        nn.init.trunc_normal_(tensor, 0.0, std, -3 * std, 3 * std, generator=generator)
        return
    std = 0.02
    if name.startswith("layers.") and name.endswith(("wo.weight", "w2.weight", "w3.weight", "experts.w2",
                                                     "experts.w3")):
        layer_id = int(name.split(".")[1])
        std = 0.02 / math.sqrt(2 * (layer_id + 1))
    nn.init.trunc_normal_(tensor, 0.0, std, -2 * std, 2 * std, generator=generator)
