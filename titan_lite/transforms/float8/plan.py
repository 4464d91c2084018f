"""What float8 changes in DRY_RUN's plan: weights gathered in 1 byte under the float8 all-gather, and the float8
casts alive while a linear runs its backward."""

from torch import nn

from titan_lite.transforms.base import PlanContext, PlanItem

# Linears whose input dimension tensor parallelism splits (the others split their output dimension).
ROWWISE = ("attention.wo", "feed_forward.w2")
FLOAT8_BYTES = 1


def local_shape(name: str, module: nn.Module, tp: int) -> tuple[int, int]:
    """(out, in) of one rank's TP shard of a linear (FSDP shards are gathered before the matmul)."""
    out_f, in_f = module.weight.shape
    if tp > 1 and not name.endswith("output"):
        return (out_f, in_f // tp) if name.endswith(ROWWISE) else (out_f // tp, in_f)
    return out_f, in_f


def cast_bytes(ctx: PlanContext, float8_modules: list[tuple[str, nn.Module]]) -> tuple[int, str]:
    """The largest float8 working set of one linear: in its backward, the float8 casts of the output gradient, the
    weight and the saved input (torchao 0.18 saves the forward's inputs as they arrive and casts again), 1 byte
    each; the forward's casts of input and weight are a subset."""
    cfg, dims = ctx.cfg, ctx.parallel_dims
    microbatch = cfg.parallelism.pipeline_parallel_microbatch_size if dims.pp_enabled else \
        cfg.training.local_batch_size
    tokens = microbatch * cfg.training.seq_len // dims.cp
    best, best_name = 0, ""
    for name, module in float8_modules:
        out_f, in_f = local_shape(name, module, dims.tp)
        size = FLOAT8_BYTES * (tokens * (out_f + in_f) + out_f * in_f)
        if size > best:
            best, best_name = size, name
    return best, best_name


def plan_items(ctx: PlanContext, float8_modules: list[tuple[str, nn.Module]]) -> list[PlanItem]:
    size, name = cast_bytes(ctx, float8_modules)
    if not size:
        return []
    return [PlanItem("activations", size, f"float8 casts in one linear's backward ({name}: output gradient, "
                                          f"weight, input) {size / 2**20:.0f} MiB")]
