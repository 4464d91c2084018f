"""The decoder's arguments (LlamaArgs: the shapes, the rope, the per-layer schedule of mixers and feed-forwards)."""

from dataclasses import dataclass


@dataclass
class LlamaArgs:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int | None = None  # None = n_heads (no GQA)
    vocab_size: int = 2048
    ffn_dim: int = 768  # SwiGLU hidden size (HF `intermediate_size`)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Long-context RoPE scaling, as transformers' rope types; factor None disables it. rope_scaling_type: "llama3"
    # (Llama 3.1's frequency bands, low/high_freq_factor), "yarn" (frequencies blended from the original to the
    # original / factor over the pairs between beta_fast and beta_slow rotations in the original context; cos and sin
    # times an attention factor) or "linear" (every frequency / factor, i.e. positions / factor).
    rope_scaling_factor: float | None = None
    rope_scaling_type: str = "llama3"
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True  # yarn: the ramp's ends rounded outwards to whole pairs
    # yarn's multiplier of cos and sin; None = 0.1 ln(factor) + 1, or the ratio of the two when (DeepSeek's) mscale
    # and mscale_all_dim are given
    rope_attention_factor: float | None = None
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False
    # Per-layer widths after structured pruning (None = uniform). Lengths equal n_layers.
    layer_n_heads: list[int] | None = None
    layer_n_kv_heads: list[int] | None = None
    layer_ffn_dims: list[int] | None = None
    # Per-head width when it is not dim // n_heads (structured pruning keeps head_dim while dim or n_heads shrink).
    explicit_head_dim: int | None = None
    # Family options of the one decoder. `family` is the Hugging Face model_type an export writes (llama, qwen2, qwen3,
    # mistral); the others change the computation: q/k/v biases (Qwen2/2.5), an RMSNorm over head_dim on each head's
    # q and k after projection and before RoPE (Qwen3), and attention to the last `sliding_window` positions only
    # (Mistral v0.1; None = the whole causal past).
    family: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # The mixer of each layer, as config.json's layer_types names it (parts/mixers.py: "full_attention",
    # "sliding_attention", "linear_attention"); None derives it from the options: every layer sliding when
    # sliding_window is set, else every layer full.
    layer_types: list[str] | None = None
    # Qwen3.5's attention: a doubled wq whose second half of each head's rows is a sigmoid gate on that head's output
    # (attn_output_gate), RoPE on the first rope_partial_factor of each head's channels, and RMSNorms of the (1 + w)
    # form, w starting at 0 (norm_unit_offset; every norm but the Gated DeltaNet's output norm).
    attn_output_gate: bool = False
    rope_partial_factor: float = 1.0
    norm_unit_offset: bool = False
    # Gemma 3: four norms a block (sandwich_norms: the mixer's and the feed-forward's outputs normed too, before each
    # residual add), the embedding times sqrt(dim) rounded to its dtype (embed_scale), the softmax scale
    # query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5), the dense feed-forward's gate activation ("silu":
    # SwiGLU; "gelu_tanh": GeGLU) and the sliding layers' own rope base (rope_local_theta, unscaled; None: every layer
    # the rope above).
    sandwich_norms: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    ffn_activation: str = "silu"
    rope_local_theta: float | None = None
    # The Gated DeltaNet mixer of the "linear_attention" layers (parts/gated_deltanet.py): key and value heads (each
    # key head serves linear_n_value_heads / linear_n_key_heads consecutive value heads), their widths, the causal
    # conv's kernel and the chunk length of the chunked delta rule.
    linear_n_key_heads: int = 0
    linear_n_value_heads: int = 0
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    linear_chunk_size: int = 64
    # torchtitan's attention options: the kernel (sdpa; flex: FlexAttention on CUDA) and the mask (causal, or
    # block_causal: packed documents attend only within themselves).
    attn_type: str = "sdpa"
    attn_mask_type: str = "causal"
    # Mixture of experts (Qwen3-MoE, Mixtral): with n_experts > 0 the feed-forward of each MoE layer is a router over
    # n_experts SwiGLU experts of width moe_ffn_dim (HF moe_intermediate_size); each token goes to its moe_top_k most
    # probable experts (num_experts_per_tok), their weights renormalised to sum 1 when moe_norm_topk_prob. Layer i is
    # MoE when (i + 1) % moe_sparse_step == 0 and i is not in moe_dense_layers (HF decoder_sparse_step,
    # mlp_only_layers); the other layers keep a dense feed-forward of ffn_dim. Training adds router_aux_loss_coef x
    # transformers' load-balancing loss. moe_shared_ffn_dim (HF shared_expert_intermediate_size; None = none): each
    # MoE layer also runs a SwiGLU shared expert of that width on every token, scaled by the sigmoid of a learned
    # linear gate (Qwen3.5-MoE's shared_expert and shared_expert_gate).
    n_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_dim: int = 0
    moe_norm_topk_prob: bool = False
    moe_sparse_step: int = 1
    moe_dense_layers: list[int] | None = None
    router_aux_loss_coef: float = 0.0
    moe_shared_ffn_dim: int | None = None
    # gpt-oss's parts: a learned logit per head in each softmax's denominator (attn_sinks, attention.sinks), a bias on
    # wo as well as on q/k/v (attn_out_bias), the router kind ("softmax_topk": softmax over every logit then the top
    # k; "topk_softmax": the top k logits, then a softmax over them alone), a bias on the router's logits
    # (moe_router_bias), and the experts' activation ("swiglu", or "clamped_swiglu": gate clamped to <= limit, up to
    # [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)) with biases on w1/w3/w2 (expert_bias).
    attn_sinks: bool = False
    attn_out_bias: bool = False
    moe_router: str = "softmax_topk"
    moe_router_bias: bool = False
    expert_act: str = "swiglu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V3's multi-head latent attention (the "latent_attention" layers, parts/mla.py): queries through a
    # rank-q_lora_rank bottleneck (None: one q_proj), keys and values expanded per head from one kv_lora_rank latent,
    # each head's key [nope part | one rope key shared by every head], the head widths, and the multi-token
    # prediction layers a release keeps beyond n_layers (num_nextn_predict_layers: skipped on load).
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_mtp_layers: int = 0
    # the checkpoint's layout of the rope channels (transformers' rope_interleave): pairs (2i, 2i+1), titan_lite's
    # own, or rotate-half pairs (i, i + rope / 2), permuted on import and export
    rope_interleave: bool = True
    # DeepSeek-V3's router ("sigmoid_group", parts/group_router.py): sigmoid scores, a correction bias used only to
    # choose experts, the top-k within the moe_topk_group best of moe_n_group expert groups, the weights times
    # moe_routed_scaling; moe_shared_experts SwiGLUs of moe_ffn_dim each on every token (one fused feed-forward);
    # training moves the correction bias by moe_load_balance_coeff toward balance each step (torchtitan's
    # load_balance_coeff, the aux-loss-free rule; 0 = frozen).
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scaling: float = 1.0
    moe_shared_experts: int = 0
    moe_load_balance_coeff: float = 0.0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """The channels of each head RoPE rotates (all of them unless the rotation is partial; latent attention: the
        rope key's)."""
        if self.is_latent:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.rope_partial_factor)

    def attention_shapes(self) -> list[tuple[int, int, int, int | None]]:
        """(query heads, score width, value width, window) of every softmax-attention layer, what the FLOPs'
        attention term counts: latent attention scores over qk_nope + qk_rope and weighs v_head_dim values."""
        shapes = []
        for layer, kind in enumerate(self.schedule):
            if kind == "linear_attention":
                continue
            heads = self.heads_of(layer)[0]
            if kind == "latent_attention":
                shapes.append((heads, self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim, None))
            else:
                shapes.append((heads, self.head_dim, self.head_dim, self.window_of(layer)))
        return shapes

    @property
    def is_latent(self) -> bool:
        """Whether some layer's mixer is DeepSeek-V3's multi-head latent attention."""
        return "latent_attention" in self.schedule

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer's mixer is a recurrent Gated DeltaNet rather than attention."""
        return "linear_attention" in self.schedule

    def heads_of(self, layer: int) -> tuple[int, int]:
        """(query heads, kv heads) of one layer."""
        q = self.layer_n_heads[layer] if self.layer_n_heads else self.n_heads
        kv = self.layer_n_kv_heads[layer] if self.layer_n_kv_heads else self.kv_heads
        return q, kv

    def layer_type(self, layer: int) -> str:
        """The mixer kind of one layer (the schedule's entry, or the one the options imply)."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    @property
    def schedule(self) -> list[str]:
        """Every layer's mixer kind, given or derived."""
        return [self.layer_type(i) for i in range(self.n_layers)]

    def window_of(self, layer: int) -> int | None:
        """The sliding window one layer attends within (None: the whole causal past)."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def rope_of(self, layer: int) -> str:
        """Which rope cache a layer rotates with: "local" (a sliding layer with a base of its own) or "global"."""
        local = self.rope_local_theta is not None and self.layer_type(layer) == "sliding_attention"
        return "local" if local else "global"

    def ffn_dim_of(self, layer: int) -> int:
        return self.layer_ffn_dims[layer] if self.layer_ffn_dims else self.ffn_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer's feed-forward is routed experts (Qwen3-MoE's rule) rather than a dense SwiGLU."""
        return self.n_experts > 0 and (layer + 1) % self.moe_sparse_step == 0 and \
            layer not in (self.moe_dense_layers or [])

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe_layer(i)]

    def inactive_param_count(self) -> int:
        """Parameters a token does not use: the experts outside its top-k in every MoE layer."""
        per_expert = 3 * self.dim * self.moe_ffn_dim + (2 * self.moe_ffn_dim + self.dim if self.expert_bias else 0)
        return len(self.moe_layers) * (self.n_experts - self.moe_top_k) * per_expert


# The rope types a model can train with; transformers' "dynamic" is refused where it is read (hf/rope.py, the config).
ROPE_SCALING_TYPES = ("llama3", "yarn", "linear")
ROUTER_KINDS = ("softmax_topk", "topk_softmax", "sigmoid_group")
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu")
