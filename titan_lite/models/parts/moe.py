"""The mixture-of-experts feed-forward (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3, Qwen3.5-MoE): router, grouped
experts, DeepSeek's shared experts or Qwen3.5's gated shared expert, the load-balancing loss added to the backward
wherever the layer runs, and the step's routed load for
metrics."""

import torch
from torch import nn

from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.experts import GroupedExperts
from titan_lite.models.parts.feed_forward import FeedForward
from titan_lite.models.parts.group_router import GroupRouter, check_groups
from titan_lite.models.parts.router import Router, Routing, load_balancing_loss


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on the block's output whose backward also backpropagates `scale` x aux (an aux loss term computed
    inside the block): each MoE layer adds its term to the objective wherever it runs, pipeline stages included."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def make_router(args: LlamaArgs) -> nn.Module:
    """The router the args' moe_router names: DeepSeek-V3's group-limited sigmoid one, or Router's kinds."""
    if args.moe_router == "sigmoid_group":
        check_groups(args.n_experts, args.moe_top_k, args.moe_n_group, args.moe_topk_group)
        return GroupRouter(args.dim, args.n_experts, args.moe_top_k, args.moe_norm_topk_prob, args.moe_n_group,
                           args.moe_topk_group, args.moe_routed_scaling)
    return Router(args.dim, args.n_experts, args.moe_top_k, args.moe_norm_topk_prob, args.moe_router,
                  args.moe_router_bias)


class MoE(nn.Module):
    """The routed feed-forward of a mixture-of-experts layer: router, then each token's top-k SwiGLU experts, the
    output their gate-weighted sum, plus the shared experts' output where there are some (DeepSeek-V3), or with
    `moe_shared_ffn_dim` (Qwen3.5-MoE) a SwiGLU shared expert of every token scaled by sigmoid(shared_expert_gate x).

    Training adds transformers' load-balancing loss (load_balancing_loss) per sequence and layer, times
    `aux_loss_scale` (set by the trainer: router_aux_loss_coef over the sequences and MoE layers it averages, 0 = off);
    when the sequence is split over context-parallel ranks (`cp_group`), its expert counts are summed over them.
    `tokens_per_expert` and `aux_loss_sum` accumulate the routed load and the unscaled loss over a step, for metrics.
    """

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.router = make_router(args)
        self.experts = GroupedExperts(args.dim, args.moe_ffn_dim, args.n_experts, args.expert_act, args.expert_bias,
                                      args.swiglu_alpha, args.swiglu_limit)
        # DeepSeek-V3: shared experts on every token, unweighted (one SwiGLU of their summed width)
        self.shared_experts = FeedForward(args.dim, args.moe_ffn_dim * args.moe_shared_experts) \
            if args.moe_shared_experts else None
        # DeepSeek-V3's sequence-wise loss is the Switch loss over its normalised sigmoid scores divided by top k
        self.aux_loss_factor = 1 / args.moe_top_k if args.moe_router == "sigmoid_group" else 1.0
        if args.moe_shared_ffn_dim:
            self.shared_expert = FeedForward(args.dim, args.moe_shared_ffn_dim)
            self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.aux_loss_scale = 0.0
        self.cp_group = None
        self._without_first: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's sums but its first forward
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        routing = Routing.of(*self.router(x.reshape(-1, dim)))
        out = routing.combine(self.experts(routing.dispatch(x.reshape(-1, dim)), routing.counts))
        out = out.view(batch, seq, dim)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.training and torch.is_grad_enabled():
            aux = self.sequence_aux_losses(routing, batch) if self.aux_loss_scale else None
            self.record(routing.counts, aux)
            if aux is not None:
                out = _AddAuxLossGrad.apply(out, aux.sum(), self.aux_loss_scale)
        return out

    def sequence_aux_losses(self, routing: Routing, batch: int) -> torch.Tensor:
        """load_balancing_loss of each sequence [batch] (this rank's share of it under context parallel)."""
        n_experts = routing.probs.shape[-1]
        choices = routing.experts.view(batch, -1)
        with torch.no_grad():
            counts = torch.zeros(batch, n_experts, device=choices.device).scatter_add_(
                1, choices, torch.ones_like(choices, dtype=torch.float32))
            tokens = routing.experts.shape[0] // batch
            if self.cp_group is not None:
                torch.distributed.all_reduce(counts, group=self.cp_group)
                tokens *= torch.distributed.get_world_size(self.cp_group)
        prob_sums = routing.probs.view(batch, -1, n_experts).sum(1)
        return load_balancing_loss(counts, prob_sums, tokens) * self.aux_loss_factor

    def reset_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.aux_loss_sum.zero_()
        self._without_first = None

    @torch.compiler.disable
    def record(self, counts: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Add this forward's load (and aux loss) to the step's sums, except when activation checkpointing recomputes
        the forward inside the backward pass."""
        if torch._C._current_graph_task_id() != -1:
            return
        counts = counts.detach().to(self.tokens_per_expert.dtype)
        aux = aux.detach().sum() if aux is not None else torch.zeros_like(self.aux_loss_sum)
        if self._without_first is None:
            self._without_first = (self.tokens_per_expert.clone(), self.aux_loss_sum.clone())
        else:
            self._without_first[0].add_(counts)
            self._without_first[1].add_(aux)
        self.tokens_per_expert += counts
        self.aux_loss_sum += aux

    def discard_first_forward(self) -> None:
        """Take the step's first forward out of its sums: a pipeline stage's first run adds one forward, on
        placeholder activations, to infer shapes. The sums are rebuilt without it rather than it subtracted: the
        placeholders are uninitialised memory, whose aux loss may be NaN."""
        if self._without_first is not None:
            self.tokens_per_expert.copy_(self._without_first[0])
            self.aux_loss_sum.copy_(self._without_first[1])
            self._without_first = None
