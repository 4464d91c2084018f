"""parallelize_llama: applies TP, CP, activation checkpointing, compile and FSDP to one model part, in that order."""

from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.parallel.activation_checkpoint import apply_ac
from titan_lite.parallel.compile import apply_compile, compiles_model
from titan_lite.parallel.fsdp import apply_fsdp, check_cpu_offload, data_parallel_mesh
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.tensor_parallel import apply_tp, check_tp_divisibility


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, cfg: JobConfig) -> nn.Module:
    """The fixed order of torchtitan: TP, CP, AC, compile, FSDP/HSDP. Each step is one named helper."""
    if parallel_dims.tp_enabled:
        check_tp_divisibility(model.args, parallel_dims.tp)
        apply_tp(model, parallel_dims.submesh("tp"), loss_parallel=loss_parallel_enabled(parallel_dims, cfg))

    if parallel_dims.cp_enabled:
        from titan_lite.parallel.context_parallel import apply_cp

        apply_cp(model, parallel_dims, cfg)

    apply_ac(model, cfg.activation_checkpoint)

    if compiles_model(cfg.compile):
        apply_compile(model, cfg.compile, tp_enabled=parallel_dims.tp_enabled)

    check_cpu_offload(cfg, parallel_dims)
    if parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled:
        apply_fsdp(model, data_parallel_mesh(parallel_dims), cfg, pp_enabled=parallel_dims.pp_enabled)
    return model


def loss_parallel_enabled(parallel_dims: ParallelDims, cfg: JobConfig) -> bool:
    """Cross-entropy on vocab-sharded logits (no gather of the logits) whenever TP is on and not disabled."""
    return parallel_dims.tp_enabled and not cfg.parallelism.disable_loss_parallel
