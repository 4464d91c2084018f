"""Per-rank peak device memory of a planned job: parameters, gradients, optimizer, activations, FSDP buffers."""

import itertools
from dataclasses import dataclass, field

from titan_lite.models.args import LlamaArgs

GIB = 1024**3
FP32 = 4
# Activation-checkpoint policy of one transformer block.
NO_AC, FULL_AC, OP_AC = "none", "full", "op"


@dataclass(frozen=True)
class ActivationShape:
    """What sizes one microbatch's activations on this rank."""

    tokens: int  # microbatch size x sequence length / context-parallel degree
    compute_bytes: int  # bytes per element of the compute dtype (2 for bf16)
    tp: int = 1  # tensor (and sequence) parallel degree
    cp: int = 1  # context parallel degree: K/V are all-gathered over it
    loss_parallel: bool = False  # logits stay vocab-sharded over TP
    seq_len: int = 0  # whole sequence length; sizes the attention mask of context parallel
    # RMSNorm saves (input, rstd): accelerators' fused kernel and the model's eager CPU function; torch's composite
    # (compiled or DTensor inputs on CPU) also saves x * rstd.
    fused_rms_norm: bool = True
    # The eager cross entropy (titan_lite/loss.py): it saves the probabilities in the logits' dtype and makes the
    # logits' gradient in place from them, where F.cross_entropy (compiled, or loss parallel) saves a float32
    # log-softmax copy and allocates two more in backward.
    chunked_loss: bool = False
    # Packed documents (attn_mask_type block_causal): "sdpa" (an additive mask in the compute dtype), "spans" (eager
    # CPU: causal attention per document, no mask) or "flex" (FlexAttention's block mask, CUDA); None: causal.
    document_mask: str | None = None
    ep: int = 1  # expert parallel degree: an MoE layer's experts split over this many ranks
    device_type: str = "cuda"  # the planned device's kind (which SDPA kernels it has)


def _rms_norm_bytes(args: LlamaArgs, tokens: int, s: ActivationShape) -> int:
    if args.norm_unit_offset:  # the (1 + w) form (Qwen3.5, Gemma 3) saves its float32 input, rstd and x * rstd
        return tokens * args.dim * 2 * FP32 + tokens * FP32
    saved = tokens * args.dim * s.compute_bytes + tokens * FP32  # input, rstd
    if not s.fused_rms_norm:
        saved += tokens * args.dim * FP32
    return saved


def _sink_attention_bytes(args: LlamaArgs, layer_id: int, s: ActivationShape) -> int:
    """gpt-oss's eager sink attention (models/parts/sdpa.py) saves q, k and v expanded to every query head, its
    output, the softmax's probabilities over [scores | sink] (seq x (seq + 1) per head, in the compute dtype: the
    window masks them, it does not shorten them), the row max's int64 indices and the boolean mask, heads split
    over TP."""
    heads = args.heads_of(layer_id)[0] // s.tp
    seq = s.seq_len or s.tokens
    rows = s.tokens // seq
    saved = 4 * s.tokens * heads * args.head_dim * s.compute_bytes
    return saved + rows * heads * seq * (seq + 1) * s.compute_bytes + s.tokens * heads * 8 + seq * seq


def _attention_core_bytes(args: LlamaArgs, layer_id: int, s: ActivationShape) -> int:
    """SDPA saves q, k and v (n_kv_heads: SDPA expands GQA itself), its output and the fp32 log-sum-exp, heads
    split over TP; under CP k and v are the all-gathered whole sequence. gpt-oss's sink attention: its own count."""
    if args.attn_sinks:
        return _sink_attention_bytes(args, layer_id, s)
    if args.layer_type(layer_id) == "latent_attention":
        return latent_attention_bytes(args, s)
    q_heads, kv_heads = args.heads_of(layer_id)
    q_width, kv_width = q_heads * args.head_dim // s.tp, kv_heads * args.head_dim // s.tp
    kv_tokens = s.tokens * s.cp
    saved = (s.tokens * q_width * 2 + kv_tokens * kv_width * 2) * s.compute_bytes
    saved += s.tokens * (q_heads // s.tp) * FP32
    if args.qk_norm:  # Qwen3's q/k RMSNorms save their inputs (the projections' outputs) and a float32 rstd per head
        saved += s.tokens * (q_width + kv_width) * s.compute_bytes + s.tokens * (q_heads + kv_heads) // s.tp * FP32
    if s.cp > 1 and s.document_mask is None:
        # this rank's causal mask rows as an additive bias, RoPE rows of its global positions, the gather order
        local_seq = s.seq_len // s.cp
        saved += local_seq * s.seq_len * s.compute_bytes + local_seq * args.head_dim * FP32 + s.seq_len * 8
    return saved


def _latent_norm_bytes(tokens: int, width: int, s: ActivationShape) -> int:
    """A latent norm (q_a_layernorm, kv_a_layernorm) beside its saved input: the float32 rstd per row, and torch's
    composite's float32 x * rstd where the norm is not fused."""
    return tokens * FP32 + (0 if s.fused_rms_norm else tokens * width * FP32)


def latent_attention_bytes(args: LlamaArgs, s: ActivationShape) -> int:
    """DeepSeek-V3's latent attention (models/parts/mla.py) without AC, after the attention norm's gathered output:
    the query's low-rank path (q_a_proj's output as its norm's input, the normed rank as q_b_proj's), kv_a_proj's
    output (the latent norm's input is a view of it), the normed latent (kv_b_proj's input), the attention kernel's
    and wo's input (SDPA's output, v_head_dim wide per head). RoPE's complex product keeps only the cache's rows. The
    down-projections and latent norms are replicated over TP on the gathered sequence, the up-projections' heads
    split (the latent plan of parallel/tensor_parallel.py); under CP the keys and values are the all-gathered
    sequence."""
    c, tokens = s.compute_bytes, s.tokens
    heads, rank, rope = args.n_heads // s.tp, args.kv_lora_rank, args.qk_rope_head_dim
    saved = 0
    if args.q_lora_rank is not None:
        saved += 2 * tokens * args.q_lora_rank * c + _latent_norm_bytes(tokens, args.q_lora_rank, s)
    saved += tokens * (rank + rope) * c + _latent_norm_bytes(tokens, rank, s) + tokens * rank * c
    saved += tokens * heads * args.v_head_dim * c + _latent_kernel_bytes(args, s)
    if s.cp > 1 and s.document_mask is None:
        local_seq = s.seq_len // s.cp
        saved += local_seq * s.seq_len * c + local_seq * rope * FP32 + s.seq_len * 8
    return saved


def _latent_kernel_bytes(args: LlamaArgs, s: ActivationShape) -> int:
    """What SDPA keeps of latent attention's q, k (qk_nope + qk_rope wide) and v (v_head_dim): a fused kernel (the
    accelerators' memory-efficient one) the scaled queries, the keys [k_nope | k_rope], the values as a view of
    kv_b_proj's expanded output (all of it kept) and a float32 log-sum-exp; on a CPU, whose flash kernel needs one
    width for q, k and v, the math kernel: its scaled copies of q and k, a contiguous copy of v and the
    probabilities per head."""
    c, tokens, heads = s.compute_bytes, s.tokens, args.n_heads // s.tp
    qk, v = args.qk_nope_head_dim + args.qk_rope_head_dim, args.v_head_dim
    kv_tokens = tokens * s.cp
    if s.device_type == "cpu" and qk != v:
        return (tokens * heads * qk + kv_tokens * heads * (qk + v) + tokens * heads * (s.seq_len or tokens)) * c
    expanded = kv_tokens * heads * v if s.cp > 1 else tokens * heads * (args.qk_nope_head_dim + v)
    return (tokens * heads * qk + kv_tokens * heads * qk + expanded) * c + tokens * heads * FP32


def latent_op_ac_bytes(args: LlamaArgs, layer_id: int, s: ActivationShape) -> int:
    """A latent attention block under op-level AC: its input, every other aten.mm output in the block's order (q_a,
    q_b or q_proj, kv_a, kv_b, wo, then w1, w3, w2; in an MoE layer the router's float32 logits and the shared
    experts' w1, w3, w2: the routed experts' grouped matmuls are no aten.mm), SDPA's output and log-sum-exp, and
    under TP the reduce-scatter outputs of wo and w2."""
    c, tokens, dim = s.compute_bytes, s.tokens, args.dim
    heads, qk = args.n_heads // s.tp, args.qk_nope_head_dim + args.qk_rope_head_dim
    query = [tokens * heads * qk * c] if args.q_lora_rank is None else \
        [tokens * args.q_lora_rank * c, tokens * heads * qk * c]
    mms = [*query, tokens * (args.kv_lora_rank + args.qk_rope_head_dim) * c,
           tokens * heads * (args.qk_nope_head_dim + args.v_head_dim) * c, tokens * dim * c]
    if args.is_moe_layer(layer_id):
        shared = args.moe_ffn_dim * args.moe_shared_experts
        mms += [tokens * args.n_experts * FP32] + ([tokens * shared * c] * 2 + [tokens * dim * c] if shared else [])
    else:
        ffn = args.ffn_dim_of(layer_id) // s.tp
        mms += [tokens * ffn * c] * 2 + [tokens * dim * c]
    seq_shard = tokens // s.tp
    saved = seq_shard * dim * c + sum(mms[0::2]) + tokens * heads * (args.v_head_dim * c + FP32)
    return saved + (2 * seq_shard * dim * c if s.tp > 1 else 0)


def group_router_bytes(args: LlamaArgs, s: ActivationShape) -> int:
    """DeepSeek-V3's group router (models/parts/group_router.py) for backward: its input (and, computing in a
    narrower dtype, the float32 copies of it and of the gate its linear takes), the float32 sigmoid scores, the
    chosen scores with their sum (norm_topk_prob) and the scores' sum over every expert, the weights in the compute
    dtype and the int64 ids. The correction bias only chooses: nothing of it is kept."""
    c, tokens, k = s.compute_bytes, s.tokens, args.moe_top_k
    saved = tokens * args.dim * c + tokens * args.n_experts * FP32 + tokens * k * FP32 + 2 * tokens * FP32
    if c != FP32:
        saved += (tokens + args.n_experts) * args.dim * FP32
    return saved + tokens * k * (c + 8)


def shared_experts_bytes(args: LlamaArgs, s: ActivationShape) -> int:
    """DeepSeek-V3's shared experts, one SwiGLU of moe_ffn_dim x n_shared_experts on every token of the gathered
    sequence (replicated over TP): w1, silu, w3 and product outputs; its input is the router's."""
    return 4 * s.tokens * args.moe_ffn_dim * args.moe_shared_experts * s.compute_bytes


def gated_shared_expert_bytes(args: LlamaArgs, s: ActivationShape) -> int:
    """Qwen3.5-MoE's shared expert on every token of the gathered sequence, split by hidden channel over TP: its w1,
    silu, w3 and product outputs; the whole w2 output and the gate's sigmoid [tokens, 1] that multiply each other;
    its input is the router's."""
    if not args.moe_shared_ffn_dim:
        return 0
    return (4 * s.tokens * (args.moe_shared_ffn_dim // s.tp) + s.tokens * args.dim + s.tokens) * s.compute_bytes


def routed_rows(args: LlamaArgs, s: ActivationShape) -> tuple[int, int]:
    """(rows this rank sends, rows its experts compute) in one MoE layer for one microbatch, at the plan's capacity.

    Without expert parallelism every routed row (token x top-k) is computed where it was routed: on every TP rank,
    which all route the gathered sequence alike. With it, each rank sends its share of the rows (under TP, 1/tp of
    the gathered ones) and its experts compute what the EP group sends them: tokens x top-k on average, but up to
    ep x tokens x min(top-k, local experts) when every token of the group chooses this rank's experts. Routing is
    dropless (no capacity factor), so the plan takes that worst case."""
    k = args.moe_top_k
    if s.ep == 1:
        return s.tokens * k, s.tokens * k
    tokens = s.tokens // s.tp
    return tokens * k, s.ep * tokens * min(k, args.n_experts // s.ep)


def moe_bytes(args: LlamaArgs, s: ActivationShape) -> int:
    """What an MoE feed-forward keeps for backward for one microbatch (router and experts see the whole gathered
    sequence: under TP every rank routes all of it): the router's input, logits and float32 probabilities, the top-k
    weights and ids; the rows its experts compute (routed_rows' capacity): their inputs, their w1, w3, silu and
    product outputs; every choice's output as the gate weights multiply it; the sorting indices (and, under EP, the
    order grouping the received rows by expert and its inverse); DeepSeek-V3's group router and shared experts and
    Qwen3.5-MoE's gated shared expert by their own counts."""
    c, k, tokens = s.compute_bytes, args.moe_top_k, s.tokens
    _, rows = routed_rows(args, s)
    if args.moe_router == "sigmoid_group":
        router = group_router_bytes(args, s)
    else:
        router = tokens * args.dim * c + tokens * args.n_experts * (c + FP32) + tokens * k * (c + 8)
    experts = rows * args.dim * c + 4 * rows * args.moe_ffn_dim * c
    indices = 3 * tokens * k * 8 + (2 * rows * 8 if s.ep > 1 else 0)
    shared = shared_experts_bytes(args, s) + gated_shared_expert_bytes(args, s)
    return router + experts + tokens * k * args.dim * c + indices + shared


def all_to_all_buffer_bytes(args: LlamaArgs, s: ActivationShape) -> int:
    """Expert parallelism's exchange buffers, one MoE layer at a time: the rows sent and the rows received (at the
    worst-case capacity) and their regrouping by expert, forward; their gradients alike in backward. They live while
    the layer runs, beside its other working tensors, so the plan takes them as a floor of a block's working set
    rather than adding them to the peak."""
    if s.ep == 1 or not args.moe_layers:
        return 0
    sent, rows = routed_rows(args, s)
    return (sent + 2 * rows) * args.dim * s.compute_bytes


def _unit_offset_qk_norm_bytes(args: LlamaArgs, layer_id: int, s: ActivationShape) -> int:
    """What the (1 + w) q/k norms (Qwen3.5, Gemma 3) save beyond _attention_core_bytes' count of plain q/k norms:
    each saves its input as float32 and x * rstd in float32. Qwen3.5's q is half of wq's doubled output: in float32
    its x.float() is that view itself, so the whole output (gate included) stays."""
    q_heads, kv_heads = args.heads_of(layer_id)
    q_width, kv_width = q_heads * args.head_dim // s.tp, kv_heads * args.head_dim // s.tp
    q_input = 2 * q_width if args.attn_output_gate and s.compute_bytes == FP32 else q_width
    return s.tokens * ((q_input + q_width + 2 * kv_width) * FP32 - (q_width + kv_width) * s.compute_bytes)


def gated_attention_bytes(args: LlamaArgs, layer_id: int, s: ActivationShape, policy: str) -> int:
    """Qwen3.5's attention beyond a plain one's count: the sigmoid of the output gate and the gated output (wo's
    input), each a query width; under op-level AC, the gate half of wq's doubled output."""
    if not args.attn_output_gate or policy == FULL_AC:
        return 0
    q_width = args.heads_of(layer_id)[0] * args.head_dim // s.tp
    return s.tokens * q_width * s.compute_bytes * (1 if policy == OP_AC else 2)


# Qwen3.5's Gated DeltaNet layers (models/parts/gated_deltanet.py), counted as its pure-PyTorch chunked rule runs:
# FLA's kernel (CUDA with fla-core) saves less and recomputes the per-chunk parts, so there the count is an upper
# bound.
def _deltanet_widths(args: LlamaArgs, tp: int) -> tuple[int, int, int]:
    """(conv channels, all of them on every TP rank; this rank's value heads; their total width)."""
    conv_dim = 2 * args.linear_n_key_heads * args.linear_key_head_dim + \
        args.linear_n_value_heads * args.linear_value_head_dim
    heads = args.linear_n_value_heads // tp
    return conv_dim, heads, heads * args.linear_value_head_dim


def delta_rule_bytes(args: LlamaArgs, tokens: int, seq: int, heads: int) -> int:
    """What chunked_delta_rule keeps for backward over `tokens` (rows of `seq`) for `heads` value heads, all in
    float32 whatever the compute dtype: q and k repeated to the value heads before their L2 norms (and each row's
    rsqrt); per padded token (each row right-padded to whole chunks of C) five C-wide rows (the decay, (beta K) K^T,
    the triangular system, Q K^T, the decayed scores), ten dk-wide (padded q and k, beta K, the two matmuls' operand
    copies each, W, the decayed q, k decayed to the chunk's end), three dv-wide (padded v, U, the new values) and
    three scalars (beta, the decays from the start and to the end); the state entering each chunk."""
    chunk, dk, dv = args.linear_chunk_size, args.linear_key_head_dim, args.linear_value_head_dim
    rows, chunks = tokens // seq, -(-seq // chunk)
    padded = rows * chunks * chunk
    per_head = tokens * (2 * dk + 2) + padded * (5 * chunk + 10 * dk + 3 * dv + 3) + rows * chunks * dk * dv
    return heads * per_head * FP32


def deltanet_mixer_bytes(args: LlamaArgs, s: ActivationShape) -> int:
    """A Gated DeltaNet mixer's saved activations for one microbatch under TP (deltanet_plan): its gathered input;
    the conv's input columns (the K - 1 zero columns before each row, then qkv) and output, on all channels; beta
    (compute dtype), the decay's softplus input and output (float32); the delta rule of this rank's value heads; the
    gated norm's float32 input, rstd, normed output (compute dtype), z and silu(z) (float32), the weighted product
    and out_proj's input (compute dtype)."""
    c, tokens = s.compute_bytes, s.tokens
    seq = s.seq_len or tokens
    conv_dim, heads, value_width = _deltanet_widths(args, s.tp)
    conv = (tokens // seq) * conv_dim * (seq + args.linear_conv_kernel - 1) * c + tokens * conv_dim * c
    gates = tokens * heads * (c + 2 * FP32) + args.linear_chunk_size ** 2  # beta, softplus in and out; the mask
    norm = tokens * value_width * (3 * FP32 + 3 * c) + tokens * heads * FP32
    rule = delta_rule_bytes(args, tokens, seq, heads)
    return tokens * args.dim * c + conv + gates + rule + norm


def deltanet_layer_bytes(args: LlamaArgs, layer_id: int, s: ActivationShape, policy: str) -> int:
    """Bytes one Gated DeltaNet block keeps for backward for one microbatch, under an AC policy: the block input
    (full AC); op-level AC's saved matmuls (of in_proj_qkv, in_proj_b, in_proj_a, in_proj_z, out_proj, w1, w3, w2
    every other one: qkv, a, out_proj and w3; the delta rule's batched matmuls are recomputed); or everything."""
    c, dim, tokens = s.compute_bytes, args.dim, s.tokens
    seq_shard = tokens // s.tp
    ffn = args.ffn_dim_of(layer_id) // s.tp
    if policy == FULL_AC:
        return seq_shard * dim * c
    conv_dim, heads, _ = _deltanet_widths(args, s.tp)
    if policy == OP_AC:
        saved = seq_shard * dim * c + tokens * (conv_dim // s.tp + heads + dim + ffn) * c
        return saved + (2 * seq_shard * dim * c if s.tp > 1 else 0)
    feed_forward = moe_bytes(args, s) if args.is_moe_layer(layer_id) else tokens * dim * c + 4 * tokens * ffn * c
    return 2 * _rms_norm_bytes(args, seq_shard, s) + deltanet_mixer_bytes(args, s) + feed_forward


def deltanet_prefill_bytes(args: LlamaArgs, rows: int, seq: int, tp: int = 1) -> int:
    """The chunked delta rule's largest working set in a prefill without gradients (rows of seq tokens, this rank's
    value heads): its float32 locals alive together, three C-wide rows (decay, system, scores), q, k, v, U, W, the
    decayed q and k per padded token."""
    if not args.is_hybrid:
        return 0
    chunk, dk, dv = args.linear_chunk_size, args.linear_key_head_dim, args.linear_value_head_dim
    padded = rows * -(-seq // chunk) * chunk
    return args.linear_n_value_heads // tp * padded * (3 * chunk + 5 * dk + 2 * dv) * FP32


def layer_activation_bytes(args: LlamaArgs, layer_id: int, s: ActivationShape, policy: str) -> int:
    """Bytes one transformer block keeps for backward for one microbatch, under an AC policy.

    Sequence parallel splits the tokens of block inputs and norms over TP; the gathered norm outputs that the
    projections consume are full-length. A routed feed-forward (MoE layer) keeps moe_bytes instead of the dense
    SwiGLU's.
    """
    if args.layer_type(layer_id) == "linear_attention":
        return deltanet_layer_bytes(args, layer_id, s, policy)
    c, dim, tokens = s.compute_bytes, args.dim, s.tokens
    seq_shard = tokens // s.tp
    ffn = args.ffn_dim_of(layer_id) // s.tp
    block_input = seq_shard * dim * c
    if policy == FULL_AC:
        return block_input
    q_heads, kv_heads = args.heads_of(layer_id)
    moe = args.is_moe_layer(layer_id)
    if policy == OP_AC and args.layer_type(layer_id) == "latent_attention":
        return latent_op_ac_bytes(args, layer_id, s)
    if policy == OP_AC:
        # Every other mm output is saved (wq, wv, w1, w2 of wq wk wv wo w1 w3 w2), plus SDPA outputs and, under
        # TP, the reduce-scatter outputs of wo and w2. In an MoE layer the router's logits are the fifth mm, saved;
        # the experts' grouped matmuls are not aten.mm, so the policy recomputes them.
        saved = block_input + tokens * (q_heads + kv_heads) * args.head_dim // s.tp * c
        saved += tokens * q_heads * args.head_dim // s.tp * c + tokens * (q_heads // s.tp) * FP32
        saved += tokens * args.n_experts * c if moe else tokens * ffn * c + tokens * dim * c
        if s.tp > 1:
            saved += 2 * seq_shard * dim * c
        return saved + gated_attention_bytes(args, layer_id, s, policy)
    gathered_norm_out = tokens * dim * c
    attention = _rms_norm_bytes(args, seq_shard, s) + gathered_norm_out + _attention_core_bytes(args, layer_id, s)
    attention += gated_attention_bytes(args, layer_id, s, policy)
    if args.qk_norm and args.norm_unit_offset:
        attention += _unit_offset_qk_norm_bytes(args, layer_id, s)
    feed_forward = moe_bytes(args, s) if moe else gathered_norm_out + 4 * tokens * ffn * c  # w1, silu, w3, product
    post_norms = 2 * _rms_norm_bytes(args, seq_shard, s) if args.sandwich_norms else 0  # Gemma 3's outputs' norms
    return attention + _rms_norm_bytes(args, seq_shard, s) + feed_forward + post_norms


def head_activation_bytes(args: LlamaArgs, s: ActivationShape) -> int:
    """Final norm, the output projection's input and what the loss saves: the chunked loss's probabilities in the
    logits' (compute) dtype, or F.cross_entropy's float32 log-softmax."""
    vocab = args.vocab_size // s.tp if s.loss_parallel else args.vocab_size
    loss_saved = s.tokens * vocab * (s.compute_bytes if s.chunked_loss else FP32)
    return _rms_norm_bytes(args, s.tokens // s.tp, s) + s.tokens * args.dim * s.compute_bytes + loss_saved


def document_mask_bytes(args: LlamaArgs, s: ActivationShape, layer_policies: dict[int, str] | None = None) -> int:
    """What a forward over packed documents keeps on top of a causal one: each token's RoPE rows and the mask, once
    for all its layers (every layer's attention saves the same tensors): this rank's query rows against the whole
    sequence as an additive mask in the compute dtype, or FlexAttention's block mask (a few int32 tensors of
    (seq / 128)^2 blocks). Attention per document (spans) has no mask but keeps each document's output beside the
    joined one, in every layer whose attention output is saved (no AC, or op-level AC)."""
    if s.document_mask is None:
        return 0
    rope_rows = s.tokens * args.head_dim * FP32  # (cos, sin) of head_dim / 2 pairs, float32
    microbatch, local_seq = s.tokens * s.cp // s.seq_len, s.seq_len // s.cp
    if s.document_mask == "spans":
        saved = [i for i, policy in (layer_policies or {}).items() if policy != FULL_AC]
        return rope_rows + sum(s.tokens * args.heads_of(i)[0] // s.tp * args.head_dim * s.compute_bytes
                               for i in saved)
    if s.document_mask == "flex":
        blocks = -(-s.seq_len // 128)
        return rope_rows + 4 * microbatch * blocks * blocks * FP32  # kv and q block indices, full and partial
    return rope_rows + microbatch * local_seq * s.seq_len * s.compute_bytes


def saved_activation_bytes(args: LlamaArgs, layer_policies: dict[int, str], has_head: bool,
                           s: ActivationShape) -> int:
    """Everything one microbatch keeps for backward on one stage (layer id -> AC policy)."""
    total = sum(layer_activation_bytes(args, i, s, p) for i, p in layer_policies.items())
    total += document_mask_bytes(args, s, layer_policies) if layer_policies else 0
    return total + (head_activation_bytes(args, s) if has_head else 0)


def backward_working_bytes(args: LlamaArgs, layer_ids: list[int], s: ActivationShape) -> int:
    """One block's un-checkpointed activations: its recompute, or its activation gradients, during backward; at least
    an MoE layer's all-to-all buffers under EP (the exchanged rows and their gradients belong to that working set)."""
    exchange = all_to_all_buffer_bytes(args, s) if any(args.is_moe_layer(i) for i in layer_ids) else 0
    return max([exchange, *(layer_activation_bytes(args, i, s, NO_AC) for i in layer_ids)])


def loss_backward_bytes(args: LlamaArgs, s: ActivationShape) -> int:
    """The fp32 gradients of the log-softmax output and of the logits, alive together as backward starts; with the
    chunked loss only the logits themselves, alive beside the saved probabilities as the forward ends."""
    vocab = args.vocab_size // s.tp if s.loss_parallel else args.vocab_size
    if s.chunked_loss:
        return s.tokens * vocab * s.compute_bytes
    return 2 * s.tokens * vocab * FP32


@dataclass(frozen=True)
class ActivationPeak:
    """One rank's activations: what its microbatches in flight keep for backward, the largest working set on top
    (a block's recompute and gradients, or the loss gradients), and the block part of that working set alone (what
    remains at the end of backward, when the saved activations are gone)."""

    saved: int
    working: int
    block_working: int

    @property
    def total(self) -> int:
        return self.saved + self.working


def activation_peak(args: LlamaArgs, stages: list[tuple[dict[int, str], bool]], s: ActivationShape,
                    in_flight: float = 1.0) -> ActivationPeak:
    """The activations of one rank's stages (layer policies, holds the head) with `in_flight` microbatches."""
    saved = sum(saved_activation_bytes(args, policies, has_head, s) for policies, has_head in stages)
    block = backward_working_bytes(args, [i for policies, _ in stages for i in policies], s)
    working = max(block, loss_backward_bytes(args, s)) if any(has_head for _, has_head in stages) else block
    return ActivationPeak(int(saved * in_flight), working, block)


def peak_activation_bytes(args: LlamaArgs, stages: list[tuple[dict[int, str], bool]], s: ActivationShape,
                          in_flight: float = 1.0) -> int:
    """Peak activation bytes of one rank: saved for every microbatch in flight, plus the largest working set."""
    return activation_peak(args, stages, s, in_flight).total


def gradients_apart_from_activations(gradients: int, activations: ActivationPeak) -> int:
    """Bytes that counting gradients and activations both at their peak counts twice, when one microbatch makes
    the step's gradients: backward frees each block's saved activations as it makes that block's gradients, so
    the step peaks either as backward starts (every activation, no gradient yet) or as it ends (every gradient,
    one block's working set); between the two it trades one for the other. `gradients` includes whatever else
    only backward holds (FSDP's reduce-scatter buffers)."""
    start, end = activations.total, gradients + activations.block_working
    return max(0, gradients + activations.total - max(start, end))


def in_flight_microbatches(schedule: str | None, pp: int, pp_rank: int, n_microbatches: int,
                           stages_per_rank: int = 1) -> float:
    """Microbatches whose activations one stage of this rank holds at the peak of a pipeline step.

    GPipe and LoopedBFS run every forward first; 1F1B holds pp - rank; interleaved schedules hold about
    (stages_per_rank - 1) x pp + 2 x (pp - 1 - rank) + 1 chunk-forwards, shared among this rank's stages.
    """
    if schedule is None or pp == 1:
        return 1.0
    if schedule in ("GPipe", "LoopedBFS"):
        return float(n_microbatches)
    if stages_per_rank == 1:
        return float(min(n_microbatches, pp - pp_rank))
    chunks = min(n_microbatches * stages_per_rank, (stages_per_rank - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)
    return chunks / stages_per_rank


@dataclass(frozen=True)
class FsdpUnit:
    """One fully_shard group: its parameter count after the all-gather (still TP-sharded), whether it frees the
    gathered parameters after forward, and how many of them train (only those are reduce-scattered; None = all)."""

    name: str
    unsharded_numel: int
    reshards_after_forward: bool
    trainable_numel: int | None = None
    # bytes of the gathered parameters when some are not gathered in the compute dtype (a 4-bit base, say)
    gathered_bytes: int | None = None

    @property
    def reduced_numel(self) -> int:
        return self.unsharded_numel if self.trainable_numel is None else self.trainable_numel

    def gather_bytes(self, compute_bytes: int) -> int:
        return self.unsharded_numel * compute_bytes if self.gathered_bytes is None else self.gathered_bytes


def fsdp_buffer_bytes(units: list[FsdpUnit], compute_bytes: int, reduce_bytes: int, prefetch: bool = True) -> int:
    """Gathered parameters of groups that stay unsharded, plus the worst pair of neighbouring groups in flight
    together: all-gathers of the current and the prefetched next group (forward), reduce-scatter inputs of the
    group just finished and the next (backward; gradients of trainable parameters only). `units` are in forward
    order."""
    if not units:
        return 0
    held = sum(u.gather_bytes(compute_bytes) for u in units if not u.reshards_after_forward)
    resharded = [u.gather_bytes(compute_bytes) for u in units if u.reshards_after_forward]
    gathers = _largest_neighbour_pair(resharded) if prefetch else max(resharded, default=0)
    return held + gathers + fsdp_reduce_scatter_bytes(units, reduce_bytes, prefetch)


def fsdp_reduce_scatter_bytes(units: list[FsdpUnit], reduce_bytes: int, prefetch: bool = True) -> int:
    """The part of fsdp_buffer_bytes that exists only in backward: two neighbouring groups' unsharded gradients (one
    without prefetching: on a CPU, where FSDP2 has no separate streams, each collective finishes before the next)."""
    if not units:
        return 0
    sizes = [u.reduced_numel for u in units]
    return (_largest_neighbour_pair(sizes) if prefetch else max(sizes)) * reduce_bytes


def _largest_neighbour_pair(sizes: list[int]) -> int:
    if len(sizes) < 2:
        return sum(sizes)
    return max(a + b for a, b in itertools.pairwise(sizes))


@dataclass
class MemoryEstimate:
    """Peak bytes on one device, by category, with a note on how each was counted."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    notes: dict[str, str] = field(default_factory=dict)
    # gradients and activations never alive together at the peak (gradients_apart_from_activations)
    not_together: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers - self.not_together

    def lines(self) -> list[str]:
        rows = [("parameters", self.parameters), ("gradients", self.gradients), ("optimizer", self.optimizer),
                ("activations", self.activations), ("buffers", self.buffers)]
        out = [f"  {name:<12}{b / GIB:9.2f} GiB  {self.notes.get(name, '')}".rstrip() for name, b in rows]
        if self.not_together:
            out.append(f"  {'overlap':<12}{-self.not_together / GIB:9.2f} GiB  gradients appear as backward frees "
                       "activations: both are never at their peak together")
        out.append(f"  {'peak':<12}{self.total / GIB:9.2f} GiB")
        return out


def state_bytes(local_params: int, param_bytes: int, offloaded: bool) -> tuple[int, int, int]:
    """(parameters, gradients, AdamW state) on the device: sharded params and grads in the parameter dtype,
    two AdamW moments per parameter in the same dtype; nothing when FSDP offloads them to the CPU."""
    if offloaded:
        return 0, 0, 0
    return local_params * param_bytes, local_params * param_bytes, 2 * param_bytes * local_params


def verdict(estimate: MemoryEstimate, capacity_gib: float) -> tuple[bool, str]:
    """(fits, one line) comparing the peak to the device capacity."""
    peak = estimate.total / GIB
    headroom = capacity_gib - peak
    if headroom >= 0:
        return True, f"fits: peak {peak:.2f} GiB of {capacity_gib:.2f} GiB, head-room {headroom:.2f} GiB"
    return False, f"does NOT fit: peak {peak:.2f} GiB exceeds {capacity_gib:.2f} GiB by {-headroom:.2f} GiB"
