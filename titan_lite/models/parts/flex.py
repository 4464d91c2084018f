"""FlexAttention for packed documents on CUDA: the block mask of a batch's documents and the compiled kernel.

Untested on a GPU in this project (its CI has none); on every other device the model attends with SDPA and an
explicit mask, which the tests check against documents run one at a time."""

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

_compiled_flex_attention = None


def document_block_mask(documents: torch.Tensor, window: int | None = None) -> BlockMask:
    """The block-causal mask of documents [batch, seq]: query q sees key k when both are in one document, k <= q (and,
    with a sliding window, q - k < window)."""
    batch, seq = documents.shape

    def same_document_causal(b, h, q, k):
        allowed = (documents[b, q] == documents[b, k]) & (q >= k)
        return allowed if window is None else allowed & (q - k < window)

    return create_block_mask(same_document_causal, batch, None, seq, seq, device=documents.device)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """FlexAttention of q [batch, heads, seq, head_dim] against k, v [batch, kv_heads, seq, head_dim] (GQA), compiled
    once per process (uncompiled FlexAttention materialises the whole score matrix)."""
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
