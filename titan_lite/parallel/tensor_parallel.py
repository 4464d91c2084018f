"""Tensor parallelism for Llama: the sequence-parallel plan per module, loss parallel, and the TP divisibility check."""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs


def check_tp_divisibility(args: LlamaArgs, tp: int) -> None:
    """Every sharded width must split evenly over the TP ranks; raise one ConfigError line naming the numbers."""
    if tp <= 1:
        return
    widths = {"dim": [args.dim]}
    widths["n_heads"] = args.layer_n_heads or [args.n_heads]
    widths["n_kv_heads"] = args.layer_n_kv_heads or [args.kv_heads]
    widths["ffn_dim"] = args.layer_ffn_dims or [args.ffn_dim]
    if args.moe_shared_ffn_dim:  # Qwen3.5-MoE's shared expert is split by hidden channel
        widths["moe_shared_ffn_dim"] = [args.moe_shared_ffn_dim]
    if args.is_hybrid:  # the Gated DeltaNet's heads are split by key-head group
        widths["linear_num_key_heads"] = [args.linear_n_key_heads]
    for name, values in widths.items():
        bad = sorted({v for v in values if v % tp})
        if bad:
            raise ConfigError(f"'parallelism.tensor_parallel_degree' = {tp} must divide the model's {name} "
                              f"({', '.join(map(str, bad))})")


def top_level_plan(loss_parallel: bool) -> dict:
    """Embeddings produce sequence-sharded activations; the head consumes them and shards (or gathers) logits."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            # loss parallel needs the DTensor so cross-entropy can run on vocab shards
            use_local_output=not loss_parallel,
        ),
    }


def block_plan(qk_norm: bool = False, moe: bool = False, latent: bool = False, linear_attention: bool = False,
               sandwich: bool = False, sinks: bool = False, gated_shared_expert: bool = False) -> dict:
    """Norms on sequence shards; attention and MLP gather the sequence, split heads/hidden, and scatter it back.

    q/k/v biases are sharded with their colwise linears, wo's bias (gpt-oss) replicated and added once, after the
    rowwise reduction; gpt-oss's sinks (a logit per query head) split by head as wq's rows are. The q/k norms (Qwen3)
    act on each head's head_dim: their weight is replicated and their input is this rank's heads (dim 2 of [batch,
    seq, heads, head_dim]), so the weight's gradient, a sum over all heads, is reduced over the TP ranks. An MoE
    block's routed feed-forward is replicated, Qwen3.5-MoE's gated shared expert split (moe_plan). Sandwich norms
    (Gemma 3's post_attention_norm and post_ffn_norm) norm wo's and w2's sequence shards and hand the residual add
    local tensors. A Gated DeltaNet layer's mixer splits by key-head groups (deltanet_plan)."""
    norms = {name: SequenceParallel(sequence_dim=2, use_local_output=True)
             for name in ("attention.q_norm", "attention.k_norm")} if qk_norm else {}
    post_norms = {name: SequenceParallel(use_local_output=True)
                  for name in ("post_attention_norm", "post_ffn_norm")} if sandwich else {}
    if linear_attention:
        mixer = deltanet_plan()
    else:
        mixer = {**norms, **(latent_attention_plan() if latent else _attention_plan(sinks))}
    return {**mixer, **post_norms, **(moe_plan(latent, gated_shared_expert) if moe else _feed_forward_plan())}


def latent_attention_plan() -> dict:
    """DeepSeek-V3's latent attention: the query's and the latent's up-projections split by head (colwise), the
    down-projections and the latent norms replicated (every rank computes them whole, their gradients whole after the
    colwise inputs' reduction), o_proj rowwise; the rope key is shared by every head, so its gradient, a sum over the
    heads, is summed over the TP ranks (attention.rope_key)."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        **{f"attention.{name}": ColwiseParallel() for name in ("wq", "q_b_proj", "kv_b_proj")},
        **{f"attention.{name}": ReplicateParallel()
           for name in ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")},
        "attention.rope_key": SumGradients(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def _attention_plan(sinks: bool = False) -> dict:
    # a plain PrepareModuleInput where there are no sinks: float8's plan edit swaps that one for its own
    gathered = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    return {
        "attention_norm": SequenceParallel(),
        "attention": HeadShardedInput(("sinks",)) if sinks else gathered,
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def deltanet_plan() -> dict:
    """A Gated DeltaNet layer (Qwen3.5) split by key-head groups: each rank runs the delta rule of its key heads and
    their value heads. in_proj_qkv's rows are [q all heads | k all heads | v all heads], so no contiguous row shard
    is one group's: it is split colwise and its output gathered, the depthwise conv (a small replicated weight) runs
    on all channels, and the mixer keeps its heads' share of q, k and v (gated_deltanet's local_share). in_proj_z,
    in_proj_b, in_proj_a (rows per value head), A_log and dt_bias are split by value head, the gated norm's weight
    replicated (its gradient reduced over the heads of every rank), out_proj rowwise."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": HeadShardedInput(("A_log", "dt_bias")),
        "attention.in_proj_qkv": ColwiseParallel(output_layouts=Replicate(), use_local_output=False),
        "attention.conv1d": ReplicateParallel(local_io=False),
        **{f"attention.{name}": ColwiseParallel() for name in ("in_proj_z", "in_proj_b", "in_proj_a")},
        "attention.norm": HeadShardedNorm(),
        "attention.out_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


class HeadShardedInput(PrepareModuleInput):
    """A mixer's input gathered over the sequence, and its per-head parameters (`names`, each [heads] and split by
    head as the colwise projections' rows are; a name the module holds as None is skipped): gpt-oss's sinks, the
    Gated DeltaNet's A_log and dt_bias (per value head, like in_proj_a's rows). Each rank's heads' gradient is its
    own, so none is reduced."""

    def __init__(self, names: tuple[str, ...]):
        super().__init__(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in self.names:
            param = getattr(module, name, None)
            if param is not None:
                module.register_parameter(name, nn.Parameter(distribute_tensor(param, device_mesh, (Shard(0),)),
                                                             requires_grad=param.requires_grad))
        return super()._apply(module, device_mesh)


class HeadShardedNorm(ParallelStyle):
    """A norm over each head's channels taking several inputs [batch, seq, heads, dim] of this rank's heads: its
    weight replicated, its inputs marked sharded on dim 2, its output handed back local."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_head_sharded_inputs, output_fn=_local_outputs)


def _head_sharded_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(t, mesh, (Shard(2),), run_check=False) for t in inputs)


def _feed_forward_plan() -> dict:
    return {
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def moe_plan(group_router: bool = False, gated_shared_expert: bool = False) -> dict:
    """The routed feed-forward under TP: router and experts replicated on every TP rank, which all route the whole
    (gathered) sequence and compute the same output; each keeps its own sequence shard of it. No expert is split
    over TP (experts are split over EP ranks instead): every gradient is whole and identical on the TP ranks, so
    none is reduced over them; the cost is TP-fold redundant expert compute. DeepSeek-V3 (group_router): its router
    (gate and correction bias, read as local tensors) and shared experts replicated alike. Qwen3.5-MoE
    (gated_shared_expert): the shared expert's w1/w3 colwise and w2 rowwise on the gathered sequence (w2's reduction
    hands back the whole output, which the replicated 1-wide gate then scales), its input's gradient summed over the
    ranks by the colwise inputs."""
    if group_router:
        plan = moe_plan()
        del plan["moe.router.gate"]
        return {**plan, "moe.router": ReplicateParallel(local_io=False), "moe.shared_experts": ReplicateParallel()}
    if gated_shared_expert:
        return {**moe_plan(), "moe.shared_expert.w1": ColwiseParallel(), "moe.shared_expert.w3": ColwiseParallel(),
                "moe.shared_expert.w2": RowwiseParallel(), "moe.shared_expert_gate": ReplicateParallel()}
    return {
        "ffn_norm": SequenceParallel(),
        "moe": PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                        use_local_input=True, output_layouts=(Replicate(),),
                                        desired_output_layouts=(Shard(1),), use_local_output=True),
        "moe.router.gate": ReplicateParallel(),
        "moe.experts": ReplicateParallel(local_io=False),
    }


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over the TP mesh (DTensor Replicate) for a module that runs on local tensors: its plain
    inputs are taken as replicated and its outputs handed back local (local_io), or it converts its parameters itself
    (GroupedExperts); torchtitan's NoParallel."""

    def __init__(self, local_io: bool = True):
        super().__init__()
        self.local_io = local_io

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.local_io:
            return distribute_module(module, device_mesh)
        return distribute_module(module, device_mesh, input_fn=_replicated_inputs, output_fn=_local_outputs)


class SumGradients(ParallelStyle):
    """Identity on a module's inputs whose backward sums their gradients over the TP ranks: for a tensor every rank
    computes whole but uses for its own heads only (latent attention's shared rope key)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_gradients_summed)


def _gradients_summed(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(SumGradOverGroup.apply(t, mesh.get_group()) for t in inputs)


class SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over a process group (the TP group: each rank's activations
    give only its share of a replicated parameter's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _replicated_inputs(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(t, mesh, (Replicate(),), run_check=False) if not isinstance(t, DTensor) else t
                 for t in inputs)


def _local_outputs(module: nn.Module, output, mesh: DeviceMesh):
    return output.to_local() if isinstance(output, DTensor) else output


# A transform's contribution to the plan: (plan, scope) -> plan, scope "model" (top level) or "block" (per block).
PlanEdit = Callable[[dict[str, ParallelStyle], str], dict[str, ParallelStyle]]


def edited_plan(plan: dict[str, ParallelStyle], scope: str, edits: Sequence[PlanEdit]) -> dict[str, ParallelStyle]:
    for edit in edits:
        plan = edit(dict(plan), scope)
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool, plan_edits: Sequence[PlanEdit] = ()) -> None:
    """Shard the model over tp_mesh in place (sequence parallel everywhere; pipeline stages may lack some parts)."""
    tied = _is_tied(model)
    top = edited_plan(top_level_plan(loss_parallel), "model", plan_edits)
    parallelize_module(model, tp_mesh, {name: style for name, style in top.items()
                                        if getattr(model, name.split(".")[0], None) is not None})
    latent = model.args.is_latent
    plans = {(moe, linear): edited_plan(block_plan(model.args.qk_norm, moe, latent, linear,
                                                         model.args.sandwich_norms, model.args.attn_sinks,
                                                         bool(model.args.moe_shared_ffn_dim)), "block", plan_edits)
             for moe in (False, True) for linear in (False, True)}
    for block in model.layers.values():
        linear = model.args.layer_type(block.layer_id) == "linear_attention"
        held = {name for name, _ in block.named_modules()}  # latent attention: wq (q_proj) or q_a_proj/q_b_proj
        parallelize_module(block, tp_mesh, {name: style for name, style in plans[block.moe_enabled, linear].items()
                                            if not latent or name in held})
    if tied:
        retie_embeddings(model)


def _is_tied(model: nn.Module) -> bool:
    emb, out = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    return emb is not None and out is not None and emb.weight is out.weight


def retie_embeddings(model: nn.Module) -> None:
    """Distributing a module replaces its parameter, which unties tied weights: share the embedding's again.

    Rowwise embedding and colwise head both shard the [vocab, dim] weight as Shard(0), so one DTensor serves both.
    """
    emb, out = model.tok_embeddings.weight, model.output.weight
    assert emb.placements == out.placements, (emb.placements, out.placements)
    model.tie_embeddings()
