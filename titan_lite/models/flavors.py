"""The named flavors (sizes) of the decoder with their published shapes, and flavor_args."""

from dataclasses import replace

from titan_lite.errors import did_you_mean
from titan_lite.models.args import LlamaArgs

_QWEN3 = dict(family="qwen3", qk_norm=True, explicit_head_dim=128, vocab_size=151936, rope_theta=1000000.0,
              norm_eps=1e-6)
_QWEN2 = dict(family="qwen2", qkv_bias=True, rope_theta=1000000.0)
# Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json: every layer MoE (decoder_sparse_step 1, no mlp_only_layers),
# 128 experts, top 8 renormalised, router_aux_loss_coef 0.001; intermediate_size is the (unused) dense width.
_QWEN3_MOE = dict(_QWEN3, family="qwen3_moe", n_experts=128, moe_top_k=8, moe_norm_topk_prob=True,
                  router_aux_loss_coef=0.001)
_QWEN3_5 = dict(family="qwen3_5", qk_norm=True, attn_output_gate=True, norm_unit_offset=True,
                rope_partial_factor=0.25, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                linear_n_key_heads=4, linear_n_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32)
# Qwen3.5-MoE: every layer routed (softmax top-k, renormalised) beside a sigmoid-gated shared expert; no dense width
_QWEN3_5_MOE = dict(_QWEN3_5, family="qwen3_5_moe", ffn_dim=0, moe_norm_topk_prob=True, router_aux_loss_coef=0.001)
# The published Qwen3.5-MoE sizes (shapes from third-party copies of the release configs, THUDM/slime's scripts and
# loader tests, as /work/shared/reference/families_2026.md section 5 lists them): head_dim 256, 16 linear key heads,
# key/value head width 128, vocab 248,320, rope_theta 1e7, untied, three Gated DeltaNet layers per attention layer.
_QWEN3_5_MOE_RELEASE = dict(_QWEN3_5_MOE, explicit_head_dim=256, vocab_size=248320, rope_theta=10000000.0,
                            norm_eps=1e-6, linear_n_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                            max_seq_len=262144)

# The dense sizes share those shapes (families_2026.md section 5: THUDM/slime's 27B script; transformers 5.24's
# Qwen3_5TextConfig defaults, which it documents as "Qwen3.5-9B style")
_QWEN3_5_RELEASE = dict(_QWEN3_5, explicit_head_dim=256, vocab_size=248320, rope_theta=10000000.0, norm_eps=1e-6,
                        linear_n_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, max_seq_len=262144)


def _qwen3_5_schedule(n_layers: int) -> list[str]:
    return (["linear_attention"] * 3 + ["full_attention"]) * (n_layers // 4)


# gpt-oss's parts (openai/gpt-oss-20b's config.json, bf16): sinks, all four attention biases, the biased top-k-then-
# softmax router, clamped SwiGLU experts with biases, sliding (even layers) and full attention, YaRN without truncation
_GPT_OSS = dict(family="gpt_oss", qkv_bias=True, attn_sinks=True, attn_out_bias=True, moe_router="topk_softmax",
                moe_router_bias=True, expert_act="clamped_swiglu", expert_bias=True, rope_theta=150000.0,
                rope_scaling_type="yarn", rope_truncate=False)
# The shapes both gpt-oss releases share: head_dim 64 (not dim / heads), experts of width 2880, top 4, a 128-token
# window in the even layers, YaRN x32 over 4096 positions (max_position_embeddings 131072)
_GPT_OSS_RELEASE = dict(dim=2880, n_heads=64, n_kv_heads=8, explicit_head_dim=64, vocab_size=201088, ffn_dim=2880,
                        moe_top_k=4, moe_ffn_dim=2880, router_aux_loss_coef=0.001, sliding_window=128,
                        rope_scaling_factor=32.0, rope_original_max_seq_len=4096, max_seq_len=131072, **_GPT_OSS)
# Gemma 3 (text): five sliding layers to one full, a rope base per layer type, GeGLU, sandwich (1 + w) norms
_GEMMA3 = dict(family="gemma3_text", qk_norm=True, norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
               ffn_activation="gelu_tanh", tie_word_embeddings=True, norm_eps=1e-6, rope_theta=1000000.0,
               rope_local_theta=10000.0, layer_types=["sliding_attention"] * 5 + ["full_attention"])
# DeepSeek-V3's parts (deepseek-ai/DeepSeek-V3's config.json): latent attention in every layer (head_dim as
# transformers' DeepseekV3Config sets it: the rope key's width), the group-limited sigmoid router with its correction
# bias moved by torchtitan's default load_balance_coeff, the report's sequence-wise aux loss weight (0.0001)
_DEEPSEEK_V3 = dict(family="deepseek_v3", moe_router="sigmoid_group", moe_norm_topk_prob=True, norm_eps=1e-6,
                    moe_shared_experts=1, moe_load_balance_coeff=1e-3, router_aux_loss_coef=0.0001)
_DEEPSEEK_V3_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        explicit_head_dim=64)


def _gemma3(n_layers: int, **shape) -> LlamaArgs:
    """A Gemma 3 (text) size: sliding_window_pattern 6 over n_layers (layer i full when (i + 1) % 6 == 0)."""
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n_layers)]
    return LlamaArgs(**{**_GEMMA3, "n_layers": n_layers, "layer_types": layer_types, **shape})


# The release configs' text shapes (google/gemma-3-{1b,4b,12b,27b}-pt config.json; the 4B-27B text_config names only
# what differs from Gemma3TextConfig's defaults: 262,208 tokens, head_dim 256, query_pre_attn_scalar 256): the 4B-27B
# full layers' rope is linear scaling by 8 (128K context), the 1B's unscaled (32K).
_GEMMA3_LONG = dict(vocab_size=262208, sliding_window=1024, max_seq_len=131072, rope_scaling_type="linear",
                    rope_scaling_factor=8.0)
_MISTRAL = dict(family="mistral", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336)
_LLAMA31_ROPE = dict(rope_theta=500000.0, rope_scaling_factor=8.0, rope_original_max_seq_len=8192)
_LLAMA32_ROPE = dict(rope_theta=500000.0, rope_scaling_factor=32.0, rope_original_max_seq_len=8192)

FLAVORS: dict[str, LlamaArgs] = {
    # torchtitan's debug model: ~6M parameters, the bundled 2048-token tokenizer.
    "debugmodel": LlamaArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, ffn_dim=768, rope_theta=500000.0),
    # The debug model with GQA (4 query heads per KV head), for structured-pruning examples on a CPU.
    "debugmodel_gqa": LlamaArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=4, vocab_size=2048, ffn_dim=768,
                                rope_theta=500000.0),
    # The debug model with tied embeddings, like Llama 3.2 1B/3B and SmolLM2: the embedding's std is dim^-0.5, so the
    # blocks, not a large embedding, carry the prediction (the pruning-quality example in docs/pruning.md trains it).
    "debugmodel_tied": LlamaArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, ffn_dim=768, rope_theta=500000.0,
                                 tie_word_embeddings=True),
    # For tests: small enough for multi-process parity runs on a CPU; GQA, 4 layers for pipeline splits.
    "tiny": LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=192, rope_theta=10000.0),
    # Shaped like HuggingFaceTB/SmolLM2-135M.
    "smollm2_135M": LlamaArgs(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, ffn_dim=1536,
                              rope_theta=100000.0, tie_word_embeddings=True),
    # Llama 3.2
    "1B": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                    tie_word_embeddings=True, **_LLAMA32_ROPE),
    "3B": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                    tie_word_embeddings=True, **_LLAMA32_ROPE),
    # Llama 3.1
    "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                    **_LLAMA31_ROPE),
    # What train_configs/llama3_8b_sheared.toml materialises (26 layers, 24 query / 8 KV heads of width 128, dim
    # 3686, intermediate 8602: 4.20B parameters), for continued pre-training of the result.
    "8B_sheared": LlamaArgs(dim=3686, n_layers=26, n_heads=24, n_kv_heads=8, vocab_size=128256, ffn_dim=8602,
                            explicit_head_dim=128, **_LLAMA31_ROPE),
    # Llama-3.1-Minitron-4B-Width's shapes (Llama 3.1 8B width-pruned: hidden 4096 -> 3072, intermediate 14336 ->
    # 9216, every head kept at width 128): the student of train_configs/llama3_8b_minitron.toml (4.51B parameters).
    "8B_minitron_width": LlamaArgs(dim=3072, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=9216,
                                   explicit_head_dim=128, **_LLAMA31_ROPE),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672,
                     **_LLAMA31_ROPE),
    "405B": LlamaArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248,
                      **_LLAMA31_ROPE),
    # Llama 2
    "llama2_7B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, vocab_size=32000, ffn_dim=11008, rope_theta=10000.0),
    # Qwen3 dense (Qwen/Qwen3-*/config.json): q/k norms, head_dim 128 on every size, tied embeddings up to 4B.
    "qwen3_0.6B": LlamaArgs(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_word_embeddings=True,
                            **_QWEN3),
    "qwen3_1.7B": LlamaArgs(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=6144, tie_word_embeddings=True,
                            **_QWEN3),
    "qwen3_4B": LlamaArgs(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=9728, tie_word_embeddings=True,
                          **_QWEN3),
    "qwen3_8B": LlamaArgs(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, **_QWEN3),
    "qwen3_14B": LlamaArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17408, **_QWEN3),
    "qwen3_32B": LlamaArgs(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_dim=25600, **_QWEN3),
    # Qwen3-MoE (Qwen/Qwen3-*-A*B/config.json): 30.53B parameters, 3.35B active per token (30B-A3B); 235.09B and
    # 22.19B (235B-A22B).
    "qwen3_30B_A3B": LlamaArgs(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144, moe_ffn_dim=768,
                               **_QWEN3_MOE),
    "qwen3_235B_A22B": LlamaArgs(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288, moe_ffn_dim=1536,
                                 **_QWEN3_MOE),
    # Qwen2.5 base models (Qwen/Qwen2.5-*/config.json): q/k/v biases; tied embeddings on the small sizes.
    "qwen2.5_0.5B": LlamaArgs(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, vocab_size=151936, ffn_dim=4864,
                              norm_eps=1e-6, tie_word_embeddings=True, **_QWEN2),
    "qwen2.5_7B": LlamaArgs(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, vocab_size=152064, ffn_dim=18944,
                            norm_eps=1e-6, **_QWEN2),
    "qwen2.5_72B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=152064, ffn_dim=29568,
                             norm_eps=1e-5, **_QWEN2),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of width 14336 in every layer, top 2 (46.70B parameters, 12.88B active).
    "mixtral_8x7B": LlamaArgs(family="mixtral", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                              ffn_dim=14336, rope_theta=1000000.0, n_experts=8, moe_top_k=2, moe_ffn_dim=14336,
                              moe_norm_topk_prob=True, router_aux_loss_coef=0.02),
    # Mistral 7B v0.3 (and v0.2's shape with vocab 32768); v0.1 attends to a sliding window of 4096 positions.
    "mistral_7B": LlamaArgs(vocab_size=32768, rope_theta=1000000.0, **_MISTRAL),
    "mistral_7B_v0.1": LlamaArgs(vocab_size=32000, rope_theta=10000.0, sliding_window=4096, **_MISTRAL),
    # For tests, shaped like "tiny": a Qwen3 (q/k norms, head_dim 32 != dim / heads, tied), a Qwen2.5 (q/k/v biases)
    # and a Mistral whose window (8) is shorter than the tests' sequences.
    "tiny_qwen3": LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=192,
                            family="qwen3", qk_norm=True, explicit_head_dim=32, tie_word_embeddings=True,
                            rope_theta=1000000.0, norm_eps=1e-6),
    "tiny_qwen2": LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=192, norm_eps=1e-6,
                            **_QWEN2),
    "tiny_mistral": LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=192,
                              family="mistral", sliding_window=8, rope_theta=10000.0),
    # A Qwen3-MoE shaped like the debug model for CPU examples: 8 experts of width 256, top 2, every layer MoE
    # (12.1M parameters, 5.0M active).
    "debugmodel_moe": LlamaArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, ffn_dim=768, rope_theta=1000000.0,
                                norm_eps=1e-6, family="qwen3_moe", qk_norm=True, n_experts=8, moe_top_k=2,
                                moe_ffn_dim=256, moe_norm_topk_prob=True, router_aux_loss_coef=0.001),
    # For tests, shaped like "tiny_qwen3": 8 experts of width 32, top 2, layer 1 dense (mlp_only_layers).
    "tiny_moe": LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=192,
                          family="qwen3_moe", qk_norm=True, explicit_head_dim=32, rope_theta=1000000.0, norm_eps=1e-6,
                          n_experts=8, moe_top_k=2, moe_ffn_dim=32, moe_norm_topk_prob=True, moe_dense_layers=[1],
                          router_aux_loss_coef=0.001),
    # torchtitan's flavors with FlexAttention and block-causal masks (last, so a config.json matches the plain ones)
    "debugmodel_flex_attn": LlamaArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, ffn_dim=768,
                                      rope_theta=500000.0, attn_type="flex", attn_mask_type="block_causal"),
    "8B_flex": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                         attn_type="flex", attn_mask_type="block_causal", **_LLAMA31_ROPE),
    # Qwen3.5 dense for the CPU (not a published size): three Gated DeltaNet layers before each gated attention
    "debugmodel_qwen3_5": LlamaArgs(dim=256, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=768,
                                    explicit_head_dim=64, rope_theta=10000000.0, norm_eps=1e-6, **_QWEN3_5),
    # For the parallelism tests, shaped like "tiny": three Gated DeltaNet layers (2 key heads, 4 value heads) before
    # one gated attention, chunks of 16 steps so a 64-token sequence crosses chunks
    "tiny_qwen3_5": LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=192,
                              explicit_head_dim=32, rope_theta=10000000.0, norm_eps=1e-6,
                              **{**_QWEN3_5, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                                 "linear_n_key_heads": 2, "linear_n_value_heads": 4, "linear_key_head_dim": 16,
                                 "linear_value_head_dim": 16}, linear_chunk_size=16),
    # Qwen/Qwen3.5-27B (26.90B parameters, text only, untied) and the 9B-style class defaults (8.95B), as
    # families_2026.md section 5 counts them
    "qwen3_5_27B": LlamaArgs(dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, ffn_dim=17408,
                             **{**_QWEN3_5_RELEASE, "layer_types": _qwen3_5_schedule(64), "linear_n_value_heads": 48}),
    "qwen3_5_9B": LlamaArgs(dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, ffn_dim=12288,
                            **{**_QWEN3_5_RELEASE, "layer_types": _qwen3_5_schedule(32), "linear_n_value_heads": 32}),
    # Qwen3.5-MoE for the CPU (not a published size): the dense debug model's mixers in 4 layers, 8 experts of width
    # 128, top 2, and a shared expert of width 256 in every layer
    "debugmodel_qwen3_5_moe": LlamaArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2048,
                                        explicit_head_dim=64, rope_theta=10000000.0, norm_eps=1e-6, n_experts=8,
                                        moe_top_k=2, moe_ffn_dim=128, moe_shared_ffn_dim=256,
                                        **{**_QWEN3_5_MOE, "layer_types": _qwen3_5_schedule(4)}),
    # Qwen/Qwen3.5-35B-A3B, -122B-A10B and -397B-A17B (_QWEN3_5_MOE_RELEASE's sources): 34.66B parameters (3.45B
    # active), 122.1B (9.77B) and 396.3B (17.35B), as families_2026.md counts them (3.46B active for the first)
    "qwen3_5_35B_A3B": LlamaArgs(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, n_experts=256, moe_top_k=8,
                                 moe_ffn_dim=512, moe_shared_ffn_dim=512,
                                 **{**_QWEN3_5_MOE_RELEASE, "layer_types": _qwen3_5_schedule(40),
                                    "linear_n_value_heads": 32}),
    "qwen3_5_122B_A10B": LlamaArgs(dim=3072, n_layers=48, n_heads=32, n_kv_heads=2, n_experts=256, moe_top_k=8,
                                   moe_ffn_dim=1024, moe_shared_ffn_dim=1024,
                                   **{**_QWEN3_5_MOE_RELEASE, "layer_types": _qwen3_5_schedule(48),
                                      "linear_n_value_heads": 64}),
    "qwen3_5_397B_A17B": LlamaArgs(dim=4096, n_layers=60, n_heads=32, n_kv_heads=2, n_experts=512, moe_top_k=10,
                                   moe_ffn_dim=1024, moe_shared_ffn_dim=1024,
                                   **{**_QWEN3_5_MOE_RELEASE, "layer_types": _qwen3_5_schedule(60),
                                      "linear_n_value_heads": 64}),
    # gpt-oss for the CPU (not a published size): 8 experts, top 2, a 64-token window in the even layers
    "debugmodel_gpt_oss": LlamaArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=2048, ffn_dim=256,
                                    n_experts=8, moe_top_k=2, moe_ffn_dim=256, router_aux_loss_coef=0.001,
                                    sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2,
                                    rope_scaling_factor=4.0, rope_original_max_seq_len=512, **_GPT_OSS),
    # For tests, shaped like "tiny": gpt-oss's parts with 4 experts of width 32, top 2, a 16-token window
    "tiny_gpt_oss": LlamaArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=2048, ffn_dim=32, n_experts=4,
                              moe_top_k=2, moe_ffn_dim=32, router_aux_loss_coef=0.001, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention"] * 2, rope_scaling_factor=4.0,
                              rope_original_max_seq_len=512, **_GPT_OSS),
    # openai/gpt-oss-20b and gpt-oss-120b (config.json): 20.9B / 3.6B active and 116.8B / 5.1B active parameters
    "gpt_oss_20b": LlamaArgs(n_layers=24, n_experts=32, layer_types=["sliding_attention", "full_attention"] * 12,
                             **_GPT_OSS_RELEASE),
    "gpt_oss_120b": LlamaArgs(n_layers=36, n_experts=128, layer_types=["sliding_attention", "full_attention"] * 18,
                              **_GPT_OSS_RELEASE),
    # Gemma 3 (text) for the CPU (not a published size): a 64-token window under 256-token sequences
    "gemma3_1B": _gemma3(26, dim=1152, n_heads=4, n_kv_heads=1, ffn_dim=6912, explicit_head_dim=256,
                         vocab_size=262144, sliding_window=512, query_pre_attn_scalar=256.0, max_seq_len=32768),
    "gemma3_4B": _gemma3(34, dim=2560, n_heads=8, n_kv_heads=4, ffn_dim=10240, explicit_head_dim=256,
                         query_pre_attn_scalar=256.0, **_GEMMA3_LONG),
    "gemma3_12B": _gemma3(48, dim=3840, n_heads=16, n_kv_heads=8, ffn_dim=15360, explicit_head_dim=256,
                          query_pre_attn_scalar=256.0, **_GEMMA3_LONG),
    "gemma3_27B": _gemma3(62, dim=5376, n_heads=32, n_kv_heads=16, ffn_dim=21504, explicit_head_dim=128,
                          query_pre_attn_scalar=168.0, **_GEMMA3_LONG),
    # For the multi-process tests: two sliding layers (window 8) and a full one per three, untied (pipeline stages)
    "tiny_gemma3": LlamaArgs(**{**_GEMMA3, "dim": 64, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 2048,
                                "ffn_dim": 192, "explicit_head_dim": 32, "sliding_window": 8,
                                "query_pre_attn_scalar": 24.0, "tie_word_embeddings": False,
                                "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                "sliding_attention"]}),
    "debugmodel_gemma3": LlamaArgs(dim=256, n_layers=6, n_heads=4, n_kv_heads=1, vocab_size=2048, ffn_dim=768,
                                   explicit_head_dim=64, sliding_window=64, query_pre_attn_scalar=64.0, **_GEMMA3),
    # DeepSeek-V3 / R1 (deepseek-ai/DeepSeek-V3's config.json, without its FP8 quantization): 61 layers, the first 3
    # dense, 256 experts top 8 in 8 groups (4 kept) plus one shared, YaRN x40 with mscale_all_dim 1: 671.03B
    # parameters, 37.55B active with the embedding and head (the report: 671B / 37B; its MTP layer not counted)
    "deepseek_v3_671B": LlamaArgs(dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_dim=18432, n_experts=256,
                                  moe_top_k=8, moe_ffn_dim=2048, moe_dense_layers=[0, 1, 2], moe_n_group=8,
                                  moe_topk_group=4, moe_routed_scaling=2.5, rope_theta=10000.0,
                                  rope_scaling_type="yarn", rope_scaling_factor=40.0, rope_original_max_seq_len=4096,
                                  rope_mscale=1.0, rope_mscale_all_dim=1.0, layer_types=["latent_attention"] * 61,
                                  **_DEEPSEEK_V3_MLA, **_DEEPSEEK_V3),
    # Kimi K2 (families_2026.md's shapes: 64 heads, 384 experts top 8 in one group, layer 0 dense, scaling 2.827,
    # rope_theta 50000; its long-context rope scaling not verified, left out): 1.026T parameters, 32.86B active
    # (published 1T / 32B)
    "kimi_k2_1T": LlamaArgs(dim=7168, n_layers=61, n_heads=64, vocab_size=163840, ffn_dim=18432, n_experts=384,
                            moe_top_k=8, moe_ffn_dim=2048, moe_dense_layers=[0], moe_routed_scaling=2.827,
                            rope_theta=50000.0, layer_types=["latent_attention"] * 61, **_DEEPSEEK_V3_MLA,
                            **_DEEPSEEK_V3),
    # DeepSeek-V3 for the CPU (not a published size): 4 layers (layer 0 dense), 8 experts top 2 in 4 groups (2 kept)
    # plus one shared, latent rank 64
    "debugmodel_deepseek_v3": LlamaArgs(dim=256, n_layers=4, n_heads=8, vocab_size=2048, ffn_dim=768, n_experts=8,
                                        moe_top_k=2, moe_ffn_dim=128, moe_dense_layers=[0], moe_n_group=4,
                                        moe_topk_group=2, moe_routed_scaling=2.5, rope_theta=10000.0,
                                        layer_types=["latent_attention"] * 4, q_lora_rank=128, kv_lora_rank=64,
                                        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, explicit_head_dim=16,
                                        **_DEEPSEEK_V3),
}


def flavor_args(flavor: str) -> LlamaArgs:
    """A fresh copy of a flavor's args; unknown names raise KeyError listing the known ones."""
    if flavor not in FLAVORS:
        raise KeyError(f"unknown model flavor '{flavor}'{did_you_mean(flavor, list(FLAVORS))}; known: "
                       f"{', '.join(FLAVORS)}")
    return replace(FLAVORS[flavor])
