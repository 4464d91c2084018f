"""DeepSeek-V3's multi-head latent attention, the mixer of the "latent_attention" layers (projections named as
transformers', so the HF mapping is a rename; the one-matrix query q_proj and o_proj are wq and wo, as in the other
attention): the query's low-rank path (q_a_proj, q_a_layernorm, q_b_proj; or one q_proj), the compressed
key-value latent with the rope key shared by every head (kv_a_proj_with_mqa, kv_a_layernorm), its per-head
expansion (kv_b_proj) into the keys' nope part and the values, the softmax scale with YaRN's mscale, on the causal
kernel (packed documents block-causal; context parallel swaps it for its all-gather of the expanded K/V);
generation caches the latent and the rope key only, expanded at every step."""

import math

import torch
from torch import nn

from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.cache import LatentCache
from titan_lite.models.parts.causal import CausalAttention
from titan_lite.models.parts.norms import RMSNorm
from titan_lite.models.parts.rope import apply_rope
from titan_lite.models.parts.sdpa import grouped_attention

LATENT_NORM_EPS = 1e-6  # transformers hard-codes it for q_a_layernorm and kv_a_layernorm (not rms_norm_eps)


def check_latent_shapes(args: LlamaArgs, source: str = "model args") -> None:
    """A ConfigError in one line where latent attention's widths cannot be built."""
    widths = {"kv_lora_rank": args.kv_lora_rank, "qk_nope_head_dim": args.qk_nope_head_dim,
              "qk_rope_head_dim": args.qk_rope_head_dim, "v_head_dim": args.v_head_dim}
    for key, value in widths.items():
        if value < 1:
            raise ConfigError(f"{source}: 'latent_attention' layers need {key} of at least 1; got {value}")
    if args.qk_rope_head_dim % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim {args.qk_rope_head_dim} is odd; rotary embeddings rotate "
                          "pairs of channels")
    if args.q_lora_rank is not None and args.q_lora_rank < 1:
        raise ConfigError(f"{source}: q_lora_rank is {args.q_lora_rank}; expected at least 1, or null for q_proj")
    if args.attn_type == "flex":
        raise ConfigError(f"{source}: attn_type 'flex' does not take latent attention (DeepSeek-V3) yet; use "
                          "attn_type 'sdpa'")
    if args.sliding_window is not None:
        raise ConfigError(f"{source}: latent attention (DeepSeek-V3) attends to the whole causal past; drop "
                          "sliding_window")


def latent_softmax_scale(args: LlamaArgs) -> float:
    """(qk_nope + qk_rope)^-1/2, times mscale^2 under YaRN with mscale_all_dim (m = 0.1 mscale_all_dim ln(factor)
    + 1), as transformers' yarn_apply_mscale."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    factor = args.rope_scaling_factor
    if factor is None or not args.rope_mscale_all_dim:
        return scale
    mscale = 1.0 if factor <= 1 else 0.1 * args.rope_mscale_all_dim * math.log(factor) + 1.0
    return scale * mscale * mscale


class LatentAttention(nn.Module):
    """Multi-head latent attention: head h's query [q_nope_h | rope(q_rope_h)] against keys [k_nope_h | rope(k_rope)]
    (k_rope one head for all), values v_h; k_nope and v are kv_b_proj of the normed latent. The scale's factor over
    the kernel's default is folded into q, so every kernel keeps its default scale."""

    def __init__(self, args: LlamaArgs, layer_id: int):
        super().__init__()
        self.nope, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.rank = args.kv_lora_rank
        qk, heads = self.nope + self.rope_dim, args.n_heads
        if args.q_lora_rank is None:
            self.wq = nn.Linear(args.dim, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(args.dim, self.rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(heads * self.v_dim, args.dim, bias=False)
        # the rope key's hook point: tensor parallel sums its gradient over the ranks' heads (identity otherwise)
        self.rope_key = nn.Identity()
        self.q_scale = latent_softmax_scale(args) / qk ** -0.5
        self.inner_attention = CausalAttention()

    def query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq"):
            return self.wq(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def expand(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [batch, seq, heads, nope + rope] and values [batch, seq, heads, v] of the normed latent [batch, seq,
        rank] and the rotated rope key [batch, seq, 1, rope]."""
        kv = self.kv_b_proj(latent).unflatten(-1, (-1, self.nope + self.v_dim))
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1), v

    def forward(self, x: torch.Tensor, rope: torch.Tensor, cache: LatentCache | None = None,
                mask=None) -> torch.Tensor:
        """x [batch, seq, dim]; rope: the cache of every position [max_seq, pairs, 2] or each token's own rows
        [batch, seq, pairs, 2]; mask: the packed documents' mask (None: causal); cache: generation's latent cache."""
        batch, seq, _ = x.shape
        q_nope, q_rope = self.query(x).unflatten(-1, (-1, self.nope + self.rope_dim)).split(
            [self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_layernorm(latent), self.rope_key(k_rope[:, :, None])
        if cache is not None:
            q_rope = cache.rotate(q_rope)
            latent, k_rope = cache.keep_latent(latent, cache.rotate(k_rope))
        else:
            rows = rope if rope.dim() == 4 else rope[:seq]
            q_rope, k_rope = apply_rope(q_rope, rows), apply_rope(k_rope, rows)
        k, v = self.expand(latent, k_rope)
        q = torch.cat([q_nope, q_rope], dim=-1) * self.q_scale
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            out = grouped_attention(q, k, v, attn_mask=cache.mask)
        else:
            out = self.inner_attention(q, k, v) if mask is None else self.inner_attention(q, k, v, mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    @property
    def mask_key(self) -> None:
        """Windowless: one document mask shared with the layers of full attention."""
        return None

    def document_mask(self, documents: torch.Tensor, dtype: torch.dtype, compiled: bool = False):
        """The packed documents' mask its kernel takes (context parallel's builds its own rows)."""
        inner = self.inner_attention
        if isinstance(inner, CausalAttention):
            return inner.document_mask(documents, dtype, compiled=compiled)
        return inner.document_mask(documents, dtype)

    def extra_repr(self) -> str:
        return f"kv_lora_rank={self.rank}, qk_nope={self.nope}, qk_rope={self.rope_dim}, v={self.v_dim}"
