"""Expert parallelism (MoE): each MoE layer's experts split over the ep ranks, the routed rows sent to their experts'
ranks by all-to-all and brought back by the reverse one; the experts FSDP-sharded over the remaining data ranks."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.parts.moe import MoE
from titan_lite.parallel.fsdp import mixed_precision_policy, offload_policy, reshard_after_forward
from titan_lite.parallel.parallel_dims import ParallelDims


def check_ep_divisibility(args: LlamaArgs, ep: int) -> None:
    """Expert parallelism needs experts, and as many on every EP rank: one ConfigError line otherwise."""
    if ep <= 1:
        return
    if not args.moe_layers:
        raise ConfigError(f"'parallelism.expert_parallel_degree' = {ep} needs a mixture-of-experts model, but this "
                          "model has no MoE layer")
    if args.n_experts % ep:
        raise ConfigError(f"'parallelism.expert_parallel_degree' = {ep} must divide the model's n_experts "
                          f"({args.n_experts}): every EP rank holds the same number of experts")


def drop_experts_from_tp_plan(plan: dict[str, ParallelStyle], scope: str) -> dict[str, ParallelStyle]:
    """A tensor-parallel plan edit: the experts belong to expert parallelism, which also spans the TP ranks."""
    return {name: style for name, style in plan.items() if not (scope == "block" and name.startswith("moe.experts"))}


def apply_ep(model: nn.Module, parallel_dims: ParallelDims) -> None:
    """Split the experts of every MoE layer over the ep mesh and route their rows through all-to-alls. Under TP every
    TP rank routes the whole (gathered) sequence alike; each sends only its share of the routed rows (the TP ranks
    are EP ranks), and the expert outputs are gathered back over TP before the gate-weighted sum."""
    ep_mesh = parallel_dims.submesh("ep")
    tp_group = parallel_dims.submesh("tp").get_group() if parallel_dims.tp_enabled else None
    grad_scale = parallel_dims.tp / parallel_dims.ep
    for block in model.layers.values():
        if block.moe_enabled:
            ExpertParallel(ep_mesh, tp_group, grad_scale).apply(block.moe.experts)


class ExpertParallel:
    """One MoE layer's experts over the ep mesh: every parameter of GroupedExperts ([E, ...]) becomes a DTensor
    sharded on its expert dimension (rank i holds experts i * E/ep ...), and two hooks wrap forward(x, counts):

    dispatch: the per-expert counts are exchanged first (all-to-all of E numbers), then each rank sends every row to
    the rank of its expert (all-to-all with uneven splits) and groups the rows it receives by local expert;
    combine: the outputs go back to where their rows came from, in their original order (the reverse all-to-all).

    Both row all-to-alls are torch's functional all_to_all_single_autograd, whose backward is the opposite exchange;
    gloo runs all_to_all_single with uneven splits (its list all_to_all needs equal sizes, so it is not used).

    grad_scale (tp / ep) corrects the experts' gradients for the data-parallel average: a dense gradient is averaged
    over the dp_shard x cp (x dp_replicate) ranks, the trainer scaling each rank's loss up by that degree, but an
    expert's gradient already holds the tokens of every rank in its EP group and is averaged over the efsdp (x
    dp_replicate) ranks only, ep / tp times fewer. The experts' output gradient is multiplied by it and their input
    gradient divided by it again, so only the expert parameters' gradients change (exactly, when it is a power of two,
    as in the usual layouts). It is
    done here rather than by FSDP's gradient divide factor, which gloo runs only with SUM, and which torch 2.13
    applies twice when the reduce-scatter group has one rank."""

    def __init__(self, ep_mesh: DeviceMesh, tp_group: dist.ProcessGroup | None = None, grad_scale: float = 1.0):
        self.mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.tp_group = tp_group
        self.grad_scale = grad_scale
        self._exchange: _Exchange | None = None

    def apply(self, experts: nn.Module) -> None:
        for module in experts.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                sharded = distribute_tensor(param.data, self.mesh, [Shard(0)])
                module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.register_forward_pre_hook(self.dispatch)
        experts.register_forward_hook(self.combine)

    def dispatch(self, _module: nn.Module, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        x, counts = args
        if self.tp_group is not None:
            x, counts = tp_share(x, counts, self.tp_group)
        self._exchange = _Exchange.of(counts, self.ep, self.group)
        rows, local_counts = self._exchange.send(x)
        return _ScaleGrad.apply(rows, 1 / self.grad_scale), local_counts

    def combine(self, _module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = _ScaleGrad.apply(out, self.grad_scale)
        out, self._exchange = self._exchange.receive(out), None
        return _GatherRows.apply(out, self.tp_group) if self.tp_group is not None else out


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale if ctx.scale != 1 else grad, None


class _Exchange:
    """One dispatch's bookkeeping: how many rows go to and come from each EP rank, and the order that groups the
    received rows (source rank major, as they arrive) by local expert (expert major, as GroupedExperts takes them)."""

    def __init__(self, group: dist.ProcessGroup, send_splits: list[int], recv_splits: list[int],
                 order: torch.Tensor | None, local_counts: torch.Tensor):
        self.group, self.send_splits, self.recv_splits = group, send_splits, recv_splits
        self.order, self.local_counts = order, local_counts

    @classmethod
    @torch.no_grad()
    def of(cls, counts: torch.Tensor, ep: int, group: dist.ProcessGroup) -> "_Exchange":
        """counts [E]: this rank's rows per expert. Exchanges them: received[s, e] = rows rank s sends to local
        expert e. The splits are read on the host (one sync per MoE layer, as torchtitan)."""
        received = funcol.all_to_all_single(counts, None, None, group)
        received = torch.ops._c10d_functional.wait_tensor(received).view(ep, -1)
        send_splits = counts.view(ep, -1).sum(1).tolist()
        recv_splits = received.sum(1).tolist()
        local_experts = received.shape[1]
        order = None
        if local_experts > 1 and ep > 1:
            # each received row's (source, expert) segment, then a stable sort by (expert, source)
            segment = torch.repeat_interleave(torch.arange(received.numel(), device=counts.device), received.flatten())
            order = torch.argsort((segment % local_experts) * ep + segment // local_experts, stable=True)
        return cls(group, send_splits, recv_splits, order, received.sum(0))

    def send(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = funcol.all_to_all_single_autograd(x, self.recv_splits, self.send_splits, self.group)
        return (rows if self.order is None else rows[self.order]), self.local_counts

    def receive(self, out: torch.Tensor) -> torch.Tensor:
        if self.order is not None:
            out = out[torch.argsort(self.order)]
        return funcol.all_to_all_single_autograd(out, self.send_splits, self.recv_splits, self.group)


# ------------------------------------------------------------------------------------ under tensor parallel


def tp_share(x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """This TP rank's contiguous share of the routed rows, which every TP rank holds alike (grouped by expert), and
    its rows per expert."""
    share = x.shape[0] // dist.get_world_size(group)
    start = dist.get_rank(group) * share
    return _SplitRows.apply(x, group), counts_within(counts, start, start + share)


def counts_within(counts: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows per expert among rows [start, end) of rows grouped by expert (counts[e] consecutive rows each)."""
    ends = torch.cumsum(counts, 0)
    return ends.clamp(start, end) - (ends - counts).clamp(start, end)


class _SplitRows(torch.autograd.Function):
    """Forward: this rank's share of rows the TP ranks hold alike. Backward: the shares' gradients gathered, so the
    input's gradient is whole and alike on every TP rank (each row's gradient comes from the one rank that used it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        share = x.shape[0] // dist.get_world_size(group)
        rank = dist.get_rank(group)
        return x[rank * share:(rank + 1) * share].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_rows(grad.contiguous(), ctx.group), None


class _GatherRows(torch.autograd.Function):
    """Forward: every TP rank's rows gathered, in rank order. Backward: this rank's share of the gradient, which the
    computation after the gather (alike on every TP rank) makes alike on every rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather_rows(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        share = grad.shape[0] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * share:(rank + 1) * share], None


def _all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


# ------------------------------------------------------------------------------------ FSDP of the experts


def apply_expert_fsdp(model: nn.Module, parallel_dims: ParallelDims, cfg: JobConfig) -> None:
    """Shard each MoE layer's experts on the expert data-parallel mesh (efsdp, with dp_replicate for HSDP) before FSDP
    groups the rest of the block; their gradients are averaged over that mesh (see ExpertParallel's grad_scale)."""
    mesh = parallel_dims.expert_data_parallel_mesh
    reshard = reshard_after_forward(cfg.parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled)
    for block in model.layers.values():
        experts = _experts_of(block)
        if experts is not None:
            fully_shard(experts, mesh=mesh, reshard_after_forward=reshard,
                        mp_policy=mixed_precision_policy(cfg, mesh.device_type),
                        offload_policy=offload_policy(cfg.training.enable_cpu_offload, mesh.device_type))


def _experts_of(block: nn.Module) -> nn.Module | None:
    """A block's GroupedExperts, whatever wraps the block (activation checkpointing); None in a dense layer."""
    return next((m.experts for m in block.modules() if isinstance(m, MoE)), None)
