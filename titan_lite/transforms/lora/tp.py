"""Tensor parallelism of LoRALinear: colwise and rowwise styles that place the adapters beside the sharded base.

Colwise (wq, wk, wv, w1, w3; the output dim is split): W Shard(0), A replicated, B Shard(0) (and DoRA's magnitude and
a bias, per output row, Shard(0)); each rank computes its own output columns of W x + s B A x, nothing to reduce.
Rowwise (wo, w2; the input dim is split): W Shard(1), A Shard(1), B replicated, magnitude replicated; each rank's
W x and B (A x) are partial sums over its input slice, and their sum is reduced once, by the style's output
redistribution (the reduce-scatter to sequence shards), exactly like the base alone.
"""

from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from titan_lite.transforms.lora.module import LoRALinear

COLWISE_PLACEMENTS = {"weight": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0), "magnitude": Shard(0),
                      "pissa_a0": Replicate(), "pissa_b0": Shard(0), "bias": Shard(0)}
ROWWISE_PLACEMENTS = {"weight": Shard(1), "lora_a": Shard(1), "lora_b": Replicate(), "magnitude": Replicate(),
                      "pissa_a0": Shard(1), "pissa_b0": Replicate(), "bias": Replicate()}


def place_parameters(placements: dict[str, Placement], _name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Distribute a LoRALinear's own parameters with their placements (keeping requires_grad)."""
    if not isinstance(module, LoRALinear):
        return
    for name, param in list(module.named_parameters(recurse=False)):
        placed = distribute_tensor(param, mesh, [placements[name]], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))


class LoRAColwiseParallel(ColwiseParallel):
    """ColwiseParallel that also shards a LoRALinear's adapters (plain nn.Linear: as ColwiseParallel)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LoRALinear):
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, partial(place_parameters, COLWISE_PLACEMENTS),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class LoRARowwiseParallel(RowwiseParallel):
    """RowwiseParallel that also shards a LoRALinear's adapters (plain nn.Linear: as RowwiseParallel)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LoRALinear):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, partial(place_parameters, ROWWISE_PLACEMENTS),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def lora_style(style: ParallelStyle) -> ParallelStyle:
    """The LoRA-aware counterpart of a colwise or rowwise style, with the same layouts."""
    kind = LoRAColwiseParallel if isinstance(style, ColwiseParallel) else LoRARowwiseParallel
    return kind(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output)
