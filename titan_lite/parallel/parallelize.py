"""parallelize_llama: applies TP, CP, EP, activation checkpointing, compile and FSDP to one model part, in that
order."""

from collections.abc import Sequence

from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError
from titan_lite.models.parameters import canonical_name
from titan_lite.parallel.activation_checkpoint import apply_ac
from titan_lite.parallel.compile import apply_compile, compiles_model
from titan_lite.parallel.context_parallel import apply_cp
from titan_lite.parallel.expert_parallel import apply_ep, apply_expert_fsdp, drop_experts_from_tp_plan
from titan_lite.parallel.fsdp import apply_fsdp, data_parallel_mesh
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.tensor_parallel import PlanEdit, apply_tp


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, cfg: JobConfig,
                      tp_plan_edits: Sequence[PlanEdit] = ()) -> nn.Module:
    """The fixed order of torchtitan: TP, CP, EP (after the dense TP, as torchtitan's MoE models), AC, compile,
    FSDP/HSDP (the experts first, on their own mesh). Each step is one named helper.

    tp_plan_edits: transforms' contributions to the tensor-parallel plan (see tensor_parallel.PlanEdit).
    """
    refuse_hybrid_layouts(model, parallel_dims, compiles_model(cfg.compile))
    with frozen_parameters_kept(model):
        if parallel_dims.tp_enabled:
            edits = [*tp_plan_edits, drop_experts_from_tp_plan] if parallel_dims.ep_enabled else tp_plan_edits
            apply_tp(model, parallel_dims.submesh("tp"), loss_parallel_enabled(parallel_dims, cfg), edits)
        if parallel_dims.cp_enabled:
            apply_cp(model, parallel_dims, cfg)
        if parallel_dims.ep_enabled:
            apply_ep(model, parallel_dims)
        apply_ac(model, cfg.activation_checkpoint)
        if compiles_model(cfg.compile):
            apply_compile(model, cfg.compile, tp_enabled=parallel_dims.tp_enabled)
        if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
            if parallel_dims.ep_enabled:
                apply_expert_fsdp(model, parallel_dims, cfg)
            apply_fsdp(model, data_parallel_mesh(parallel_dims), cfg, pp_enabled=parallel_dims.pp_enabled)
    return model


def refuse_hybrid_layouts(model: nn.Module, parallel_dims: ParallelDims, compiled: bool = False) -> None:
    """A ConfigError in one line for the layouts a model with Gated DeltaNet layers (Qwen3.5) cannot run yet (context
    parallel beside TP, PP or compile, or on the MoE family). (Gemma 3's, DeepSeek-V3's and gpt-oss's TP, CP and PP are
    checked against one process.)"""
    args = getattr(model, "args", None)
    if args is not None and args.is_hybrid:
        refuse_recurrent_cp(parallel_dims, args, compiled)


def refuse_recurrent_cp(parallel_dims: ParallelDims, args, compiled: bool = False) -> None:
    """Context parallel passes each Gated DeltaNet chunk's conv window and recurrent state on (ContextParallelScan),
    checked against one process alone and beside FSDP on the dense family; beside TP, PP or compile, and on
    Qwen3.5-MoE, it is not checked yet: refused."""
    if not parallel_dims.cp_enabled:
        return
    others = [name for name, on in (("tensor_parallel_degree > 1", parallel_dims.tp_enabled),
                                    ("pipeline_parallel_degree > 1", parallel_dims.pp_enabled),
                                    ("compile.enable", compiled)) if on]
    if args.n_experts:
        others.append("a Qwen3.5-MoE model")
    if others:
        raise ConfigError(f"parallelism.context_parallel_degree > 1 with {' and '.join(others)} is not supported yet "
                          "for Qwen3.5's linear_attention layers (their states passed between context-parallel chunks "
                          "are checked alone and beside FSDP only); drop one of them")


class frozen_parameters_kept:
    """Distributing a parameter makes a new nn.Parameter, which defaults to requires_grad=True: a frozen weight
    (a transform's base, say) would silently train. Record requires_grad by name before, restore it after."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self) -> None:
        self.frozen = {canonical_name(n) for n, p in self.model.named_parameters() if not p.requires_grad}

    def __exit__(self, *exc) -> None:
        for name, param in self.model.named_parameters():
            if canonical_name(name) in self.frozen:
                param.requires_grad_(False)


def loss_parallel_enabled(parallel_dims: ParallelDims, cfg: JobConfig) -> bool:
    """Cross-entropy on vocab-sharded logits (no gather of the logits) whenever TP is on and not disabled."""
    return parallel_dims.tp_enabled and not cfg.parallelism.disable_loss_parallel


