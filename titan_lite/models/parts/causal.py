"""The attention kernel of a mixer: softmax(QK^T / sqrt(d)) V over rotated q, k and v, causal (within a sliding
window when one is set) or block-causal over packed documents; SDPA with an explicit mask or per-document spans,
FlexAttention's block mask on CUDA."""

import torch
from torch import nn

from titan_lite.models.parts.flex import BlockMask, document_block_mask, flex_attend
from titan_lite.models.parts.masks import DocumentSpans, block_causal_mask, windowed_causal_mask
from titan_lite.models.parts.sdpa import grouped_attention, sink_attention


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """sinks [heads]: gpt-oss's sink logits (eager math; the attention module refuses flex with them)."""
        if mask is None:
            return self.causal(q, k, v, sinks)
        if isinstance(mask, BlockMask):
            return flex_attend(q, k, v, mask)
        if isinstance(mask, DocumentSpans):
            return torch.cat([torch.cat([self.causal(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e], v[b:b + 1, :, s:e],
                                                     sinks)
                                         for s, e in row], dim=2)
                              for b, row in enumerate(mask.rows)])
        return self.attend(q, k, v, mask, sinks)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention over one whole sequence (or document), within the sliding window when one is set."""
        window_mask = windowed_causal_mask(q.shape[2], self.window, q.device)
        if window_mask is None:
            if sinks is not None:
                return sink_attention(q, k, v, sinks, is_causal=True)
            return grouped_attention(q, k, v, is_causal=True)
        return self.attend(q, k, v, window_mask, sinks)

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               sinks: torch.Tensor | None) -> torch.Tensor:
        if sinks is not None:
            return sink_attention(q, k, v, sinks, attn_mask=mask)
        return grouped_attention(q, k, v, attn_mask=mask)

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
