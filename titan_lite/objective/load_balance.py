"""MoE load balancing in training: each MoE layer's share of the aux loss for a step, the aux-loss-free update of
DeepSeek-V3's correction biases after it, and the step's aux loss and expert load as metrics (moe/aux_loss,
moe/load_max_over_mean/layer_{i})."""

from collections.abc import Callable

import torch
from torch import nn

from titan_lite.models.args import LlamaArgs
from titan_lite.models.parameters import canonical_name
from titan_lite.models.parts.group_router import GroupRouter
from titan_lite.models.parts.moe import MoE


def moe_layers(model_parts: list[nn.Module]) -> dict[int, MoE]:
    """The MoE modules these parts hold, by global layer id."""
    found = {}
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(module, MoE):
                found[int(canonical_name(name).split(".")[1])] = module
    return found


class LoadBalance:
    """The objective's MoE term: router_aux_loss_coef x the mean, over the step's sequences and the model's MoE layers,
    of transformers' load-balancing loss of one sequence in one layer.

    Per sequence, so the gradient is the same whatever splits the batch (data-parallel ranks, microbatches, pipeline
    stages; a context-parallel rank's share of a sequence uses the whole sequence's expert counts). Each MoE layer
    backpropagates its own term (MoE.aux_loss_scale), so nothing passes between pipeline stages.
    """

    def __init__(self, model_parts: list[nn.Module], args: LlamaArgs):
        self.layers = moe_layers(model_parts)
        self.coef, self.n_moe_layers, self.n_layers = args.router_aux_loss_coef, len(args.moe_layers), args.n_layers
        self.bias_coeff = args.moe_load_balance_coeff

    @property
    def enabled(self) -> bool:
        return self.n_moe_layers > 0

    def before_step(self, global_sequences: int, gradient_average_degree: int) -> None:
        """Scale each layer's sum of per-sequence losses so that the averaged gradient is coef x their mean (the
        data-parallel average divides by gradient_average_degree, as for the token losses); clear the step's sums."""
        scale = self.coef * gradient_average_degree / (global_sequences * self.n_moe_layers)
        for moe in self.layers.values():
            moe.aux_loss_scale = scale
            moe.reset_stats()

    @torch.no_grad()
    def update_biases(self, global_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """After the optimizer step: each correction bias (DeepSeek-V3's routers) moves by load_balance_coeff toward
        balance, from the step's expert loads summed by global_sum over the ranks that split the batch, so every
        rank moves it alike. Nothing for routers without one, or a coefficient of 0."""
        routed = {layer: moe for layer, moe in self.layers.items() if isinstance(moe.router, GroupRouter)}
        if not routed or not self.bias_coeff:
            return
        loads = global_sum(torch.stack([moe.tokens_per_expert.float() for moe in routed.values()]))
        for moe, load in zip(routed.values(), loads, strict=True):
            moe.router.update_bias(load, self.bias_coeff)

    def metrics(self, global_sum: Callable[[torch.Tensor], torch.Tensor], global_sequences: int,
                device: torch.device) -> tuple[dict[str, float], dict[str, float]]:
        """(printed, per-layer) metrics of the step: the mean aux loss (unscaled, as transformers reports aux_loss)
        and the largest load over the MoE layers; each MoE layer's load, the busiest expert's routed tokens over the
        mean. global_sum adds a tensor over the ranks that split the batch and over pipeline stages."""
        n_experts = next(iter(self.layers.values())).tokens_per_expert.numel() if self.layers else 1
        loads = torch.zeros(self.n_layers, n_experts + 1, dtype=torch.float64, device=device)
        for layer, moe in self.layers.items():
            loads[layer, :-1] = moe.tokens_per_expert.double()
            loads[layer, -1] = moe.aux_loss_sum.double()
        loads = global_sum(loads)
        counts = loads[:, :-1]
        printed, per_layer = {}, {}
        if self.coef:
            printed["moe/aux_loss"] = loads[:, -1].sum().item() / (global_sequences * self.n_moe_layers)
        for layer in range(self.n_layers):
            if counts[layer].sum() > 0:
                per_layer[f"moe/load_max_over_mean/layer_{layer}"] = (counts[layer].max() / counts[layer].mean()).item()
        if per_layer:
            printed["moe/load_max_over_mean"] = max(per_layer.values())
        return printed, per_layer
