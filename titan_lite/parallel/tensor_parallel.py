"""Tensor parallelism for Llama: the sequence-parallel plan per module, loss parallel, and the TP divisibility check."""

from collections.abc import Callable, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
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


def block_plan(qk_norm: bool = False, moe: bool = False, sandwich: bool = False) -> dict:
    """Norms on sequence shards; attention and MLP gather the sequence, split heads/hidden, and scatter it back.

    q/k/v biases are sharded with their colwise linears. The q/k norms (Qwen3) act on each head's head_dim: their
    weight is replicated and their input is this rank's heads (dim 2 of [batch, seq, heads, head_dim]), so the
    weight's gradient, a sum over all heads, is reduced over the TP ranks. Sandwich norms (Gemma 3's
    post_attention_norm and post_ffn_norm) norm wo's and w2's sequence shards and hand the residual add local
    tensors. An MoE block's routed feed-forward is replicated (moe_plan)."""
    norms = {name: SequenceParallel(sequence_dim=2, use_local_output=True)
             for name in ("attention.q_norm", "attention.k_norm")} if qk_norm else {}
    if sandwich:
        norms |= {name: SequenceParallel(use_local_output=True) for name in ("post_attention_norm", "post_ffn_norm")}
    return {**norms, **_attention_plan(), **(moe_plan() if moe else _feed_forward_plan())}


def _attention_plan() -> dict:
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def _feed_forward_plan() -> dict:
    return {
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def moe_plan() -> dict:
    """The routed feed-forward under TP: router and experts replicated on every TP rank, which all route the whole
    (gathered) sequence and compute the same output; each keeps its own sequence shard of it. No expert is split
    over TP (experts are split over EP ranks instead): every gradient is whole and identical on the TP ranks, so
    none is reduced over them; the cost is TP-fold redundant expert compute."""
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
    plans = {moe: edited_plan(block_plan(model.args.qk_norm, moe, model.args.sandwich_norms), "block", plan_edits)
             for moe in (False, True)}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, plans[block.moe_enabled])
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
