"""The distillation loss: alpha T^2 KL + (1 - alpha) cross entropy over the trained tokens, in blocks of rows, on
whole or vocab-sharded (loss parallel) logits, with its gradient made in the forward.

KL is KL(teacher_T || student_T) (kind "forward", Minitron's) or KL(student_T || teacher_T) ("reverse"), of the
softmaxes at temperature T. Per block of rows everything runs in float32: the row maxima and exponential sums (all-
reduced over the vocab shards when the logits are sharded: a distributed logsumexp), the row KL from the shifted
logits and those sums, the cross entropy at T = 1, and the gradient of the block, written into the teacher's logits
(consumed: after the loss they hold the student's gradient; a new buffer when their dtype or layout differs). So
the loss adds no [tokens, vocab] tensor beyond the two logits, and no float32 one (on CPU fp32 logits are already
float32; the temporaries are float32 blocks of _CHUNK_ELEMENTS).

Gradients with respect to the student's logits s, per row (p = softmax(s / T), q = softmax(t / T), d = log p - log q):
forward KL: T^2 dKL/ds = T (p - q); reverse KL: T^2 dKL/ds = T p (d - KL); cross entropy: softmax(s) - onehot.
"""

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from titan_lite.loss import IGNORE_INDEX, VocabShard, row_blocks, saved_once
from titan_lite.objective.vocab import ACCELERATOR_CHUNK_ELEMENTS, CHUNK_ELEMENTS, local_vocab_shard

KINDS = ("forward", "reverse")
# Elements of one [rows, vocab] float32 block; about six such temporaries are alive while a block is worked on.
_CHUNK_ELEMENTS, _ACCELERATOR_CHUNK_ELEMENTS = CHUNK_ELEMENTS, ACCELERATOR_CHUNK_ELEMENTS


@dataclass(frozen=True)
class DistillLoss:
    """alpha (the KL's weight; 1 - alpha is the cross entropy's), temperature and kind of the loss."""

    alpha: float = 1.0
    temperature: float = 1.0
    kind: str = "forward"


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
    local, shard = local_vocab_shard(student)
    if shard.group is None:
        return local, _full(teacher), shard
    if isinstance(teacher, DTensor) and teacher.placements == student.placements:
        return local, teacher.to_local(), shard
    return local, _full(teacher)[..., shard.offset:shard.offset + local.shape[-1]], shard


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


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
        for rows in row_blocks(student.shape[0], student.shape[1], student.device,
                               (_CHUNK_ELEMENTS, _ACCELERATOR_CHUNK_ELEMENTS)):
            kl[rows], ce[rows] = _block(student[rows], teacher[rows], labels[rows], valid[rows], spec, shard,
                                        grad[rows] if grad is not None else None)
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
        (grad,) = saved_once(ctx, "ChunkedDistillSum")
        return grad.mul_(grad_loss.to(grad.dtype)).to(ctx.student_dtype), None, None, None, None


def _gradient_buffer(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Where the gradient is written: the teacher's logits when they can hold it (same dtype, shape, contiguous,
    not needed by anything else), else a new tensor like the student's."""
    if (teacher.dtype == student.dtype and teacher.shape == student.shape and teacher.is_contiguous()
            and not teacher.requires_grad and teacher.data_ptr() != student.data_ptr()):
        return teacher
    return torch.empty_like(student, memory_format=torch.contiguous_format)


def _block(s_raw: torch.Tensor, t_raw: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, spec: DistillLoss,
           shard: VocabShard, grad_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(row KL, row cross entropy) of one block of rows (this rank's vocab columns), in float32; with grad_rows (the
    block's rows of the gradient buffer, possibly the teacher's own logits: read before written) the gradient of
    alpha T^2 KL + (1 - alpha) CE, zero on ignored rows, is written there.

    With z = (logits - their row maximum) / T and Z the rows' exponential sums, log softmax = z - log Z, so log q -
    log p = (z_t - z_s) + (log Z_s - log Z_t) and KL(q || p) = sum(exp(z_t) (z_t - z_s)) / Z_t + log Z_s - log Z_t
    (the weights summing to 1 over the whole vocabulary): the log-softmaxes are never written out."""
    reverse, plain_ce = spec.kind == "reverse", spec.temperature == 1.0  # at T = 1 the CE's softmax is the KL's
    maxima = shard.max_(torch.stack([s_raw.amax(dim=1).float(), t_raw.amax(dim=1).float()]))
    z_s, z_t = _shifted(s_raw, maxima[0], spec.temperature), _shifted(t_raw, maxima[1], spec.temperature)
    p, q = z_s.exp(), z_t.exp()  # unnormalised: divided by their sums where used
    ce_exp = None if plain_ce else torch.sub(s_raw, maxima[0][:, None]).exp_()  # float32: the maxima are
    sums = shard.sum_(torch.stack([p.sum(dim=1), q.sum(dim=1)] + ([] if plain_ce else [ce_exp.sum(dim=1)])))
    log_sums = sums.log()
    # log p - log q (forward: log q - log p) but for a constant per row, `shift`
    diff, shift = (z_s.sub_(z_t), log_sums[1] - log_sums[0]) if reverse else (z_t.sub_(z_s), log_sums[0] - log_sums[1])
    del z_s, z_t
    weights, weight_sum = (p, sums[0]) if reverse else (q, sums[1])
    local, in_shard = shard.local_labels(labels, s_raw.shape[1])
    target = s_raw.gather(1, local[:, None]).squeeze(1).float() * in_shard
    dots = torch.linalg.vecdot(weights, diff, dim=1)
    dots_target = shard.sum_(torch.stack([dots, target]))
    kl = dots_target[0] / weight_sum + shift
    lse = maxima[0] + (log_sums[0] if plain_ce else log_sums[2])
    ce = lse - dots_target[1]
    if grad_rows is not None:
        out = grad_rows if grad_rows.dtype == torch.float32 else torch.empty_like(p)
        _write_gradient(out, p, q, diff, shift - kl, ce_exp, sums, local, in_shard, valid, spec)
        if out is not grad_rows:
            grad_rows.copy_(out)
    return kl, ce


def _shifted(logits: torch.Tensor, row_max: torch.Tensor, temperature: float) -> torch.Tensor:
    """A new float32 tensor (logits - row_max) / T (the subtraction promotes bf16 logits to the maxima's float32)."""
    z = torch.sub(logits, row_max[:, None])
    return z if temperature == 1.0 else z.mul_(1.0 / temperature)


def _write_gradient(out: torch.Tensor, p: torch.Tensor, q: torch.Tensor, diff: torch.Tensor, offset: torch.Tensor,
                    ce_exp: torch.Tensor | None, sums: torch.Tensor, local_labels: torch.Tensor,
                    in_shard: torch.Tensor, valid: torch.Tensor, spec: DistillLoss) -> None:
    """d(alpha T^2 KL + (1 - alpha) CE)/ds of a block's rows into `out` (float32), the softmax normalisations and the
    ignored rows folded into per-row factors. Forward: T (p - q); reverse: T p (log p - log q - KL), where diff +
    offset is log p - log q - KL (diff is consumed); cross entropy: softmax(s) - onehot."""
    rows_in = valid.float()
    kl_weight, ce_weight = spec.alpha * spec.temperature * rows_in, (1 - spec.alpha) * rows_in
    ce_sum = sums[0] if ce_exp is None else sums[2]
    if spec.kind == "reverse":
        torch.mul(diff.add_(offset[:, None]).mul_(p), (kl_weight / sums[0])[:, None], out=out)
        if spec.alpha < 1:
            out.addcmul_(p if ce_exp is None else ce_exp, (ce_weight / ce_sum)[:, None])
    else:
        p_weight = kl_weight + (ce_weight if ce_exp is None else 0)  # at T = 1 the CE's probabilities are p
        torch.mul(p, (p_weight / sums[0])[:, None], out=out)
        out.addcmul_(q, (-kl_weight / sums[1])[:, None])
        if ce_exp is not None and spec.alpha < 1:
            out.addcmul_(ce_exp, (ce_weight / ce_sum)[:, None])
    if spec.alpha < 1:
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, local_labels] -= ce_weight * in_shard.float()
