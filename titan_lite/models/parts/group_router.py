"""DeepSeek-V3's router (moe.router.gate, moe.router.e_score_correction_bias): sigmoid scores, a correction bias
that only chooses experts, group-limited top-k, the routed scaling; the aux-loss-free update of the bias from a
step's expert loads; and the check of its shapes."""

import torch
from torch import nn

from titan_lite.dtensor import copy_into_shard, full_tensor, local_tensor
from titan_lite.errors import ConfigError


def check_groups(n_experts: int, top_k: int, n_group: int, topk_group: int, source: str = "model args") -> None:
    """A ConfigError in one line where the expert groups cannot be formed or cannot hold the top k."""
    if n_group < 1 or n_experts % n_group:
        raise ConfigError(f"{source}: n_group = {n_group} does not divide n_routed_experts = {n_experts}; each group "
                          "holds the same number of experts")
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"{source}: topk_group = {topk_group} must be between 1 and n_group = {n_group}")
    per_group = n_experts // n_group
    if n_group > 1 and per_group < 2:
        raise ConfigError(f"{source}: n_group = {n_group} leaves {per_group} expert per group; a group's score is "
                          "the sum of its two best experts' (at least 2 per group)")
    if top_k > topk_group * per_group:
        raise ConfigError(f"{source}: num_experts_per_tok = {top_k} exceeds the {topk_group} x {per_group} experts "
                          "of the topk_group groups a token may use")


class GroupRouter(nn.Module):
    """s = sigmoid(x W^T) in float32; the choice scores s + e_score_correction_bias pick the topk_group groups (a
    group's score: the sum of its two best) and the top k within them; the weights are the chosen experts' s
    (divided by their sum + 1e-20 when norm_topk_prob), times routed_scaling. The bias is a frozen parameter (no
    gradient; training moves it by `update_bias`), kept in float32 as transformers keeps it. The probabilities the
    sequence-wise aux loss reads are s normalised over every expert."""

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool, n_group: int, topk_group: int,
                 routed_scaling: float):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.n_group, self.topk_group, self.routed_scaling = n_group, topk_group, routed_scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, dim] -> (normalised scores [tokens, E] float32, top-k weights [tokens, k] in x's dtype, top-k
        expert ids [tokens, k])."""
        # local tensors: tensor parallel replicates the router (its parameters DTensors, its input local)
        scores = torch.sigmoid(nn.functional.linear(x.float(), local_tensor(self.gate.weight).float()))
        choice = scores + local_tensor(self.e_score_correction_bias).float()
        if self.n_group > 1:
            groups = choice.unflatten(-1, (self.n_group, -1))
            best = groups.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices
            kept = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(-1, best, True)
            choice = groups.masked_fill(~kept[..., None], float("-inf")).flatten(-2)
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        probs = scores / scores.sum(dim=-1, keepdim=True)
        return probs, (weights * self.routed_scaling).to(x.dtype), experts

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor, coeff: float) -> None:
        """The aux-loss-free rule (torchtitan's, from the DeepSeek-V3 report): each bias moves by coeff toward
        balance, up for an expert below the mean load, down above it, the moves centred to sum 0. tokens_per_expert
        [E] is the step's load over every rank; applied to this rank's shard of the bias."""
        delta = coeff * torch.sign(tokens_per_expert.mean() - tokens_per_expert)
        delta = delta - delta.mean()
        bias = self.e_score_correction_bias
        copy_into_shard(bias, full_tensor(bias) + delta.to(device=bias.device, dtype=bias.dtype))
