"""Routing of a mixture-of-experts layer: the router (softmax top-k, moe.router.gate), one forward's routing of
tokens to experts (dispatch, combine) and transformers' load-balancing loss."""

from dataclasses import dataclass

import torch
from torch import nn


class Router(nn.Module):
    """Token-choice top-k routing: a linear to E logits (biased when `bias`, gpt-oss), then by `kind`:
    "softmax_topk" (Qwen3-MoE, Mixtral): softmax in float32, the k most probable experts, their probabilities
    renormalised to sum 1 when norm_topk_prob; "topk_softmax" (gpt-oss): the k largest logits, a softmax over those
    alone. The probabilities the load-balancing loss reads are the softmax over every logit either way."""

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool, kind: str = "softmax_topk",
                 bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=bias)
        self.top_k, self.norm_topk_prob, self.kind = top_k, norm_topk_prob, kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, dim] -> (probabilities [tokens, E] float32, top-k weights [tokens, k] in x's dtype, top-k
        expert ids [tokens, k])."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if self.kind == "topk_softmax":
            top, experts = logits.topk(self.top_k, dim=-1)
            return probs, torch.softmax(top, dim=-1), experts
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(logits.dtype), experts


def load_balancing_loss(expert_counts: torch.Tensor, prob_sums: torch.Tensor, tokens: float) -> torch.Tensor:
    """transformers' load_balancing_loss_func (Switch Transformer): E * sum_e f_e * P_e, f_e = top-k assignments to
    expert e per token, P_e = its mean router probability, over `tokens` tokens whose expert_counts and prob_sums
    [..., E] are given; one value per leading index."""
    n_experts = expert_counts.shape[-1]
    return n_experts * ((expert_counts / tokens) * (prob_sums / tokens)).sum(-1)


@dataclass
class Routing:
    """One MoE forward's routing of tokens [N] with k choices each: `order` sorts the N*k (token, choice) pairs by
    expert (stable), `counts` [E] are the pairs per expert, `weights` [N, k] the gate weights, `probs` [N, E]."""

    probs: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor
    order: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def of(cls, probs: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> "Routing":
        flat = experts.flatten()
        counts = torch.bincount(flat, minlength=probs.shape[-1])
        return cls(probs, weights, experts, torch.argsort(flat, stable=True), counts)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """The rows each expert computes, grouped by expert: [N * k, dim]."""
        return x[self.order // self.weights.shape[1]]

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Each token's gate-weighted sum of its k experts' outputs [N, dim], from the grouped outputs."""
        per_choice = self.unsort(expert_out).view(*self.weights.shape, -1)
        return (per_choice * self.weights[..., None]).sum(1)

    def unsort(self, grouped: torch.Tensor) -> torch.Tensor:
        """Grouped rows back in (token, choice) order: [N * k, ...]."""
        return grouped[torch.argsort(self.order)]
