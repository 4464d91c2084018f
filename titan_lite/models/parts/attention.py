"""The attention mixer (attention.wq/wk/wv/wo): GQA, q/k/v biases (Qwen2/2.5), q/k RMSNorms over head_dim (Qwen3,
attention.q_norm/k_norm), a sliding window (Mistral, the "sliding_attention" layers), RoPE on q and k (on the first
rotary_dim channels of each head only, Qwen3.5), a sigmoid output gate from a doubled wq (Qwen3.5), a learned sink
logit per head and a bias on wo (gpt-oss, attention.sinks, attention.wo.bias), a softmax scale of
query_pre_attn_scalar ** -0.5 (Gemma 3). It declares
what packed documents need (`document_mask`, shared by the mixers of one `mask_key`) and its window."""

import torch
from torch import nn

from titan_lite.dtensor import local_tensor
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.cache import LayerCache
from titan_lite.models.parts.causal import CausalAttention
from titan_lite.models.parts.norms import make_norm
from titan_lite.models.parts.rope import rotate_channels


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads; `window` limits it to the last `window` positions. Generation
    caches every position's keys and values (titan_lite.generate's KVCache, a mask per window)."""

    def __init__(self, args: LlamaArgs, layer_id: int, window: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads = args.heads_of(layer_id)
        self.head_dim = args.head_dim
        self.window = window
        self.rotary_dim = args.rotary_dim
        # Qwen3.5: each head's rows of wq are [query | gate], the gate's sigmoid scaling that head's output.
        self.output_gate = args.attn_output_gate
        q_width = self.n_heads * self.head_dim * (2 if self.output_gate else 1)
        self.wq = nn.Linear(args.dim, q_width, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=args.attn_out_bias)
        if args.attn_sinks and args.attn_type == "flex":
            raise ConfigError("model args: attn_type 'flex' does not take attention sinks (gpt-oss) yet; use "
                              "attn_type 'sdpa'")
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if args.attn_sinks else None
        # Qwen3: one RMSNorm over head_dim, shared by every head, on q and on k.
        self.q_norm = make_norm(self.head_dim, args) if args.qk_norm else None
        self.k_norm = make_norm(self.head_dim, args) if args.qk_norm else None
        # Gemma 3's softmax scale, query_pre_attn_scalar ** -0.5 for head_dim ** -0.5: folded into q (after its norm)
        # so every kernel (SDPA, flex, context parallel's, the generation cache's) keeps its default scale.
        scalar = args.query_pre_attn_scalar
        self.q_scale = None if scalar is None else (self.head_dim / scalar) ** 0.5
        self.inner_attention = CausalAttention(window, flex=args.attn_type == "flex")

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
        q, gate = self.wq(x).view(batch, seq, -1, self.head_dim), None
        if self.output_gate:
            q, gate = q.unflatten(2, (-1, 2)).unbind(3)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.q_scale is not None:
            q = q * self.q_scale
        # the sinks of this rank's heads (tensor parallel shards them by head, like wq's rows)
        sinks = {} if self.sinks is None else {"sinks": local_tensor(self.sinks)}
        if cache is not None:
            out = cache.attend(q, k, v, **sinks)
        else:
            rows = rope if rope.dim() == 4 else rope[:seq]
            q, k = rotate_channels(q, rows, self.rotary_dim), rotate_channels(k, rows, self.rotary_dim)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            # K/V keep their n_kv_heads: the inner attention expands them, after any gather (context parallel).
            out = self.inner_attention(q, k, v, **sinks) if mask is None else self.inner_attention(q, k, v, mask,
                                                                                                   **sinks)
        out = out.transpose(1, 2)
        return out if gate is None else out * torch.sigmoid(gate)

    @property
    def mask_key(self) -> int | None:
        """Mixers with one key share one document mask per forward: attention's depends on its window only."""
        return self.window

    def document_mask(self, documents: torch.Tensor, dtype: torch.dtype, compiled: bool = False):
        """The mask of packed documents [batch, seq] this mixer's kernel takes (context parallel's kernel builds its
        own); `compiled`: the block is compiled, which takes tensor masks only."""
        inner = self.inner_attention
        if isinstance(inner, CausalAttention):
            return inner.document_mask(documents, dtype, compiled=compiled)
        return inner.document_mask(documents, dtype)
