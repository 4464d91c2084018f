"""Tensor parallelism with float8 (tensorwise): torchao's float8 styles for the linears float8 serves in every block,
so the sequence all-gather before attention and the MLP moves float8 activations."""

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

# The block's modules whose input one prepared all-gather feeds, with the linears that read it.
INPUT_USERS = {"attention": ("attention.wq", "attention.wk", "attention.wv"),
               "feed_forward": ("feed_forward.w1", "feed_forward.w3")}


def float8_in_every_block(model: nn.Module, path: str) -> bool:
    """Whether every block holding `path` holds it as a Float8Linear: a hybrid model's plan of one mixer (Qwen3.5's
    Gated DeltaNet or attention) meets only the blocks of that mixer."""
    # lazy: torchao loads only when float8 is used
    from torchao.float8.float8_linear import Float8Linear

    held = [block.get_submodule(path) for block in model.layers.values() if _holds(block, path)]
    return bool(held) and all(isinstance(module, Float8Linear) for module in held)


def _holds(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def float8_block_plan(plan: dict[str, ParallelStyle], model: nn.Module) -> dict[str, ParallelStyle]:
    """The block plan with float8 styles where every block's linear is a Float8Linear (a linear left in high
    precision, or wrapped by a later transform, keeps its style); an input is prepared in float8 only when every
    linear reading it is float8."""
    # lazy: torchao loads only when float8 is used
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    float8 = {path for path, style in plan.items()
              if type(style) in (ColwiseParallel, RowwiseParallel) and float8_in_every_block(model, path)}
    for path in float8:
        style = plan[path]
        kind = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
        plan[path] = kind(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                          use_local_output=style.use_local_output)
    for path, users in INPUT_USERS.items():
        style = plan.get(path)
        if type(style) is PrepareModuleInput and all(user in float8 for user in users):
            plan[path] = PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                                  desired_input_layouts=style.desired_input_layouts,
                                                  use_local_output=style.use_local_output)
    return plan
