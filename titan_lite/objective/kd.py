"""The distillation loss: alpha T^2 KL + (1 - alpha) cross entropy over the trained tokens, in blocks of rows, on
whole or vocab-sharded (loss parallel) logits, with its gradient made in the forward.

KL is KL(teacher_T || student_T) (kind "forward", Minitron's) or KL(student_T || teacher_T) ("reverse"), of the
softmaxes at temperature T. Per block of rows everything runs in float32: the row maxima and exponential sums (all-
reduced over the vocab shards when the logits are sharded: a distributed logsumexp), both log-softmaxes, the row KL,
the cross entropy at T = 1, and the gradient of the block, written in the logits' dtype into the teacher's logits
(consumed: after the loss they hold the student's gradient; a new buffer when their dtype or layout differs). So
the loss adds no [tokens, vocab] tensor beyond the two logits, and no float32 one (on CPU fp32 logits are already
float32; the temporaries are float32 blocks of _CHUNK_ELEMENTS).

Gradients with respect to the student's logits s, per row (p = softmax(s / T), q = softmax(t / T), d = log p - log q):
forward KL: T^2 dKL/ds = T (p - q); reverse KL: T^2 dKL/ds = T p (d - KL); cross entropy: softmax(s) - onehot.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_lite.loss import IGNORE_INDEX

KINDS = ("forward", "reverse")
# Elements of one [rows, vocab] float32 block; about six such temporaries are alive while a block is worked on.
_CHUNK_ELEMENTS = 1 << 20
_ACCELERATOR_CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class DistillLoss:
    """alpha (the KL's weight; 1 - alpha is the cross entropy's), temperature and kind of the loss."""

    alpha: float = 1.0
    temperature: float = 1.0
    kind: str = "forward"


@dataclass(frozen=True)
class VocabShard:
    """This rank's columns [offset, offset + width) of a vocabulary split over `group` (None: the whole of it)."""

    offset: int = 0
    group: dist.ProcessGroup | None = None

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t


def distill_loss_sum(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor,
                     spec: DistillLoss) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss summed over the trained tokens, [KL sum, CE sum] of those tokens, detached) for logits [batch, seq,
    vocab] and labels [batch, seq]; the caller normalises by its token count. Vocab-sharded DTensor logits (loss
    parallel) are worked on shard by shard. The teacher's logits are consumed (they become the gradient buffer)."""
    shard = VocabShard()
    if isinstance(student, DTensor):
        student, teacher, shard = _local_vocab_shards(student, teacher)
    return ChunkedDistillSum.apply(student.flatten(0, 1), teacher.flatten(0, 1).detach(), labels.flatten(), spec,
                                   shard)


def _local_vocab_shards(student: DTensor, teacher: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, VocabShard]:
    """This rank's vocab columns of both logits and where they sit; logits that are not split over the vocab on a
    1-D mesh are gathered whole (differentiably)."""
    placements = student.placements
    if student.device_mesh.ndim != 1 or not (placements[0].is_shard() and
                                             placements[0].dim in (-1, student.ndim - 1)):
        return student.full_tensor(), _full(teacher), VocabShard()
    mesh = student.device_mesh
    vocab, ranks, rank = student.shape[-1], mesh.size(), mesh.get_local_rank()
    chunk = -(-vocab // ranks)  # torch.chunk's split, as Shard places uneven vocabularies
    offset = min(rank * chunk, vocab)
    local = student.to_local()
    if isinstance(teacher, DTensor) and teacher.placements == placements:
        teacher_local = teacher.to_local()
    else:
        teacher_local = _full(teacher)[..., offset:offset + local.shape[-1]]
    return local, teacher_local, VocabShard(offset, mesh.get_group())


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _row_blocks(rows: int, width: int, device: torch.device) -> list[slice]:
    chunk = _CHUNK_ELEMENTS if device.type == "cpu" else _ACCELERATOR_CHUNK_ELEMENTS
    step = max(1, chunk // max(1, width))
    return [slice(start, start + step) for start in range(0, rows, step)]


class ChunkedDistillSum(torch.autograd.Function):
    """The loss of `distill_loss_sum` on [tokens, vocab (shard)] logits; its backward scales the gradient the
    forward wrote, once (no retain_graph), like ChunkedCrossEntropySum."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, spec: DistillLoss,
                shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
        valid = labels != IGNORE_INDEX
        grad = _gradient_buffer(student, teacher) if ctx.needs_input_grad[0] else None
        kl = torch.empty(student.shape[0], dtype=torch.float32, device=student.device)
        ce = torch.empty_like(kl)
        for rows in _row_blocks(student.shape[0], student.shape[1], student.device):
            kl[rows], ce[rows], block_grad = _block(student[rows], teacher[rows], labels[rows], valid[rows], spec,
                                                    shard, grad is not None)
            if grad is not None:
                grad[rows].copy_(block_grad)
            del block_grad
        kl_sum, ce_sum = (kl * valid).sum(), (ce * valid).sum()
        t2 = spec.temperature ** 2
        loss = spec.alpha * t2 * kl_sum + (1 - spec.alpha) * ce_sum
        parts = torch.stack([kl_sum, ce_sum])
        ctx.mark_non_differentiable(parts)
        ctx.save_for_backward(grad)
        ctx.student_dtype, ctx.used = student.dtype, False
        return loss, parts

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_parts: torch.Tensor) -> tuple:
        if ctx.used:  # the gradient is scaled in place: only once
            raise RuntimeError("ChunkedDistillSum supports one backward pass (no retain_graph)")
        ctx.used = True
        (grad,) = ctx.saved_tensors
        return grad.mul_(grad_loss.to(grad.dtype)).to(ctx.student_dtype), None, None, None, None


def _gradient_buffer(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Where the gradient is written: the teacher's logits when they can hold it (same dtype, shape, contiguous,
    not needed by anything else), else a new tensor like the student's."""
    if (teacher.dtype == student.dtype and teacher.shape == student.shape and teacher.is_contiguous()
            and not teacher.requires_grad and teacher.data_ptr() != student.data_ptr()):
        return teacher
    return torch.empty_like(student, memory_format=torch.contiguous_format)


def _block(s_raw: torch.Tensor, t_raw: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, spec: DistillLoss,
           shard: VocabShard, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(row KL, row cross entropy, gradient of alpha T^2 KL + (1 - alpha) CE for the block's valid rows or None)
    of one block of rows (this rank's vocab columns), in float32."""
    inv_t = 1.0 / spec.temperature
    log_p = s_raw.to(torch.float32, copy=True)  # becomes log softmax(s / T)
    log_q = t_raw.to(torch.float32, copy=True)  # becomes log softmax(t / T)
    if spec.temperature != 1.0:
        log_p.mul_(inv_t)
        log_q.mul_(inv_t)
    plain_ce = spec.temperature == 1.0  # the cross entropy's softmax (T = 1) is the student's
    maxima = [log_p.amax(dim=1), log_q.amax(dim=1)] + ([] if plain_ce else [s_raw.amax(dim=1).float()])
    maxima = shard.max_(torch.stack(maxima))
    log_p.sub_(maxima[0][:, None])
    log_q.sub_(maxima[1][:, None])
    p, q = log_p.exp(), log_q.exp()
    sums = [p.sum(dim=1), q.sum(dim=1)]
    ce_probs = None
    if not plain_ce:
        ce_probs = s_raw.float().sub(maxima[2][:, None]).exp_()
        sums.append(ce_probs.sum(dim=1))
    sums = shard.sum_(torch.stack(sums))
    log_sums = sums.log()
    log_p.sub_(log_sums[0][:, None])
    log_q.sub_(log_sums[1][:, None])
    p.div_(sums[0][:, None])
    q.div_(sums[1][:, None])
    diff = torch.sub(log_p, log_q) if spec.kind == "reverse" else torch.sub(log_q, log_p)
    del log_p, log_q
    weighted = torch.mul(diff, p if spec.kind == "reverse" else q)
    local, in_shard = labels - shard.offset, (labels >= shard.offset) & (labels < shard.offset + s_raw.shape[1])
    local = torch.where(in_shard, local, 0)
    target = s_raw.gather(1, local[:, None]).squeeze(1).float() * in_shard
    kl_target = shard.sum_(torch.stack([weighted.sum(dim=1), target]))
    del weighted
    kl = kl_target[0]
    lse = (maxima[0] + log_sums[0]) if plain_ce else (maxima[2] + log_sums[2])
    ce = lse - kl_target[1]
    if not with_grad:
        return kl, ce, None
    if ce_probs is None:
        ce_probs = p if spec.alpha < 1 else None
    else:
        ce_probs.div_(sums[2][:, None])
    grad = _block_gradient(p, q, diff, kl, ce_probs, local, in_shard, valid, spec)
    return kl, ce, grad


def _block_gradient(p: torch.Tensor, q: torch.Tensor, diff: torch.Tensor, kl: torch.Tensor,
                    ce_probs: torch.Tensor | None, local_labels: torch.Tensor, in_shard: torch.Tensor,
                    valid: torch.Tensor, spec: DistillLoss) -> torch.Tensor:
    """d(alpha T^2 KL + (1 - alpha) CE)/ds of a block's rows (zero on ignored rows), reusing diff's memory.
    For the reverse kind diff holds log p - log q; for the forward kind it is not needed."""
    kl_weight = spec.alpha * spec.temperature
    if spec.kind == "reverse":
        grad = diff.sub_(kl[:, None]).mul_(p).mul_(kl_weight)
    else:
        grad = torch.sub(p, q, out=diff).mul_(kl_weight)
    if spec.alpha < 1:
        grad.add_(ce_probs, alpha=1 - spec.alpha)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_labels] -= (1 - spec.alpha) * in_shard.float()
    return grad.mul_(valid[:, None])
