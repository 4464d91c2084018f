"""Scaled dot-product attention with grouped K/V heads (GQA): the fused kernels where they read the fewer heads
themselves, else K/V expanded first."""

import torch
import torch.nn.functional as F


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


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """Attention with a learned sink logit per head (gpt-oss) in each softmax's denominator: softmax over
    [QK^T / sqrt(d) | sink], the sink's column dropped before the product with V. Eager math (no fused kernel takes
    a sink), as transformers' eager gpt-oss attention; attn_mask boolean (True: attend) or additive; sinks [heads]."""
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if is_causal:
        attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    logits = torch.cat([scores, sink], dim=-1)
    # the max subtracted keeps half-precision exp in range (transformers does the same)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v
