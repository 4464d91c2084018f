"""First-order Taylor importance of attention heads and MLP channels (LLM-Pruner style, one shot), computed on the
assembled (FSDP/TP-sharded) model, and the uniform keep-set it selects.

The importance of a group of weights is |sum over the group of W * dL/dW|, with L the mean token loss over the
calibration windows: a query head is its wq rows (and their bias entries) and its wo columns, a KV head its wk and wv
rows (and biases), an MLP channel its w1 and w3 rows and its w2 column. Gradients stay sharded like the weights;
the per-group sums are DTensor reductions whose full result every rank receives, so every rank ranks the same
numbers and picks the same keep-set.
"""

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from titan_lite.data.batch import Batch
from titan_lite.dtensor import full_tensor
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.runner import ModelRunner
from titan_lite.transforms.structured.materialize import StructureKeep

logger = logging.getLogger("titan_lite")

HeadMode = Literal["per_group_query", "kv_group"]
HEAD_MODES = ("per_group_query", "kv_group")


@dataclass
class LayerScores:
    """Signed per-group sums of W * dL/dW of one block (importance is their absolute value)."""

    q_heads: Tensor  # [n_heads]: wq rows + wo columns of each query head
    kv_heads: Tensor  # [n_kv_heads]: wk + wv rows of each KV head
    ffn: Tensor  # [ffn_dim]: w1 + w3 rows and the w2 column of each channel


# ------------------------------------------------------------------------------------------ gradients


def check_taylor_layout(dims: ParallelDims) -> None:
    if dims.pp_enabled:
        raise ConfigError(f"Taylor structured pruning does not run under pipeline parallelism (degree {dims.pp}): "
                          "use FSDP and/or tensor parallelism")


def local_calibration(batches: Iterable[tuple[Tensor, Tensor]], nsamples: int, dims: ParallelDims,
                      device: torch.device, where: str) -> list[tuple[Tensor, Tensor]]:
    """This rank's calibration batches; every data-parallel rank must hold its full share (or the collectives of
    the forward passes would not line up)."""
    local = list(batches)
    short = torch.tensor([int(sum(x.shape[0] for x, _ in local) < nsamples // dims.dp_degree)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(short)
    if int(short):
        raise ConfigError(f"calibration data '{where}' holds fewer than {nsamples} windows of the calibration length; "
                          "lower --nsamples or --seq_len, or add data")
    return local


def accumulate_gradients(runner: ModelRunner, batches: list[tuple[Tensor, Tensor]], dims: ParallelDims,
                         device: torch.device) -> float:
    """Gradients of the mean token loss over every rank's calibration windows (as the trainer scales one step);
    returns that loss."""
    for part in runner.model_parts:
        part.zero_grad(set_to_none=True)
    tokens = torch.tensor([float(sum(int(y.numel()) for _, y in batches))], dtype=torch.float64, device=device)
    global_tokens = runner.global_sum(tokens, loss_values=False)
    scale = (dims.gradient_average_degree / global_tokens).to(torch.float32)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    begin = time.monotonic()
    for i, (inputs, labels) in enumerate(batches, start=1):
        loss += runner.forward_backward(Batch(inputs, labels), scale).to(torch.float64)
        logger.info(f"taylor: calibration batch {i}/{len(batches)} forward+backward "
                    f"({time.monotonic() - begin:.1f}s)")
    return float(runner.global_sum(loss, loss_values=True) / global_tokens)


def _group_sums(weight: nn.Parameter, dim: int) -> Tensor:
    """sum of W * dL/dW over `dim` (1: per row, 0: per column), full length on every rank, float32."""
    if weight.grad is None:
        raise RuntimeError("no gradient: the weight did not take part in the calibration loss")
    product = weight.detach().float() * weight.grad.float()
    return full_tensor(product.sum(dim=dim)).float().cpu()


def _row_sums(linear: nn.Module) -> Tensor:
    """Per output row: sum of W * dL/dW over the row, plus b * dL/db of a bias (Qwen2's q/k/v)."""
    sums = _group_sums(linear.weight, 1)
    if getattr(linear, "bias", None) is not None:
        sums = sums + full_tensor(linear.bias.detach().float() * linear.bias.grad.float()).float().cpu()
    return sums


def layer_scores(block: nn.Module, head_dim: int) -> LayerScores:
    """A head's q/k norm weights (Qwen3) are shared by every head: they count for no head and are all kept."""
    attention, ffn = block.attention, block.feed_forward
    q = _row_sums(attention.wq) + _group_sums(attention.wo.weight, 0)
    kv = _row_sums(attention.wk) + _row_sums(attention.wv)
    channels = _group_sums(ffn.w1.weight, 1) + _group_sums(ffn.w3.weight, 1) + _group_sums(ffn.w2.weight, 0)
    return LayerScores(q.view(-1, head_dim).sum(1), kv.view(-1, head_dim).sum(1), channels)


def taylor_scores(runner: ModelRunner, batches: list[tuple[Tensor, Tensor]], dims: ParallelDims,
                  args: LlamaArgs, device: torch.device) -> tuple[list[LayerScores], float]:
    """(per-layer scores, calibration loss) of the assembled model; the gradients are freed afterwards."""
    check_taylor_layout(dims)
    # Compiled blocks would recompile for calibration shapes: score eagerly.
    with torch.compiler.set_stance("force_eager"):
        loss = accumulate_gradients(runner, batches, dims, device)
    model = runner.model_parts[0]
    scores = [layer_scores(model.layers[str(i)], args.head_dim) for i in range(args.n_layers)]
    model.zero_grad(set_to_none=True)
    return scores, loss


# ------------------------------------------------------------------------------------------ selection


def kept_count(total: int, ratio: float) -> int:
    """What remains of `total` groups after removing round(total x ratio), at least one."""
    return max(1, total - round(total * ratio))


def _top(importance: Tensor, count: int) -> list[int]:
    """Indices of the `count` largest values (ties to the lower index), ascending."""
    order = torch.sort(-importance, stable=True).indices[:count]
    return sorted(order.tolist())


def select_heads(scores: LayerScores, n_rep: int, ratio: float, mode: HeadMode) -> tuple[list[int], list[int]]:
    """(kept query heads, kept KV heads) of one layer. per_group_query keeps every KV head and the same number of
    its most important query heads in each group; kv_group keeps the most important whole groups (a KV head with
    its n_rep query heads). With one query head per KV head (no GQA) both keep whole heads with their K/V."""
    n_kv = scores.kv_heads.numel()
    per_group = scores.q_heads.view(n_kv, n_rep)
    if mode == "kv_group" or n_rep == 1:
        groups = _top((scores.kv_heads + per_group.sum(1)).abs(), kept_count(n_kv, ratio))
        return [g * n_rep + r for g in groups for r in range(n_rep)], groups
    keep = kept_count(n_rep, ratio)
    q_heads = [g * n_rep + r for g in range(n_kv) for r in _top(per_group[g].abs(), keep)]
    return q_heads, list(range(n_kv))


def select_keep(scores: list[LayerScores], args: LlamaArgs, head_ratio: float, ffn_ratio: float,
                head_mode: HeadMode) -> StructureKeep:
    """The uniform keep-set: in every layer the same counts, each chosen by that layer's importances."""
    n_rep = args.n_heads // args.kv_heads
    heads = [select_heads(s, n_rep, head_ratio, head_mode) for s in scores]
    ffn_keep = kept_count(args.ffn_dim, ffn_ratio)
    return StructureKeep(layers=list(range(args.n_layers)), q_heads=[q for q, _ in heads],
                         kv_heads=[kv for _, kv in heads], ffn=[_top(s.ffn.abs(), ffn_keep) for s in scores],
                         hidden=list(range(args.dim)))
