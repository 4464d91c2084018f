"""Log-probabilities of the labels, token by token, from logits [batch, seq, vocab] in float32 blocks of rows (no
float32 [tokens, vocab] copy; vocab-sharded DTensor logits under loss parallel worked on shard by shard), with the
mean logit of every token (a metric) or the entropy of its distribution (GRPO's metric), optionally at a temperature
(the logits scaled by 1 / temperature) and restricted to the tokens a sampler could draw (`keep`: GRPO's logprobs
"sampled"), and their gradient made in the forward as the chunked cross entropy makes it."""

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from titan_lite.loss import IGNORE_INDEX, VocabShard, row_blocks, saved_once, softmax_rows
from titan_lite.objective.vocab import block_elements, local_vocab_shard

# The scaled logit of a token left out (keep): exp of it minus the row's max is 0, and so is 0 x it (the entropy).
LEFT_OUT = -1e30
# keep(a float32 block of rows of the logits, as they are) -> bool [rows, vocab]: the tokens in the distribution.
Keep = Callable[[torch.Tensor], torch.Tensor]


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label) of every token, 0 where the label is IGNORE_INDEX; the token's mean logit over the vocabulary,
    detached), both float32 [batch, seq], for logits [batch, seq, vocab] (plain, or a vocab-sharded DTensor)."""
    local, shard = local_vocab_shard(logits)
    logps, mean_logits, _ = TokenLogps.apply(local.flatten(0, 1), labels.flatten(), shard, logits.shape[-1])
    return logps.view(labels.shape), mean_logits.view(labels.shape)


def tempered_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                   entropy: bool = False, keep: Keep | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(label) under softmax(logits / temperature), 0 where the label is IGNORE_INDEX; the entropy of that
    distribution at every labelled token, detached, or None), float32 [batch, seq]. With `keep` the distribution is
    renormalised over the tokens it keeps (each label kept too, so a sampled token never scores -inf where the
    training forward's logits put it just outside); vocab-sharded logits are then gathered whole (a top k or top p
    needs every column of a row)."""
    local, shard = local_vocab_shard(logits.full_tensor() if keep is not None and isinstance(logits, DTensor)
                                     else logits)
    logps, _, entropies = TokenLogps.apply(local.flatten(0, 1), labels.flatten(), shard, logits.shape[-1],
                                           1.0 / temperature, entropy, keep)
    return logps.view(labels.shape), entropies.view(labels.shape) if entropy else None


class TokenLogps(torch.autograd.Function):
    """x[label] - logsumexp(x) of every row of x = scale x [tokens, vocab (shard)] logits, in float32 blocks of
    rows; blocks without a label are skipped. When a gradient is wanted the forward writes softmax(x) into the
    gradient's buffer (in the logits' dtype) and the backward scales it by minus the incoming gradient (and `scale`)
    and adds it at the labels, in place (one backward pass, as ChunkedCrossEntropySum). With `entropy` it also
    returns each row's entropy -sum p log p of softmax(x) (else zeros). With `keep` (whole rows only: no shard) the
    tokens it leaves out of a row, other than its label, are out of the softmax: their probability and gradient are
    0 (the mean logits are then meaningless)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, shard: VocabShard, vocab: int, scale: float = 1.0,
                entropy: bool = False, keep: Keep | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        valid = labels != IGNORE_INDEX
        local_labels, inside = shard.local_labels(torch.where(valid, labels, 0), logits.shape[1])
        lse = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        logit_sums, entropies = torch.zeros_like(lse), torch.zeros_like(lse)
        probs = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        blocks = row_blocks(logits.shape[0], logits.shape[1], logits.device, block_elements())
        wanted = [bool(b) for b in torch.stack([valid[rows].any() for rows in blocks]).tolist()]  # one sync
        for rows, needed in zip(blocks, wanted, strict=True):
            if not needed:
                if probs is not None:
                    probs[rows].zero_()
                continue
            block = logits[rows].float()  # a float32 block (the logits themselves when they are float32)
            kept = None if keep is None else keep(block).scatter_(1, local_labels[rows, None], True)
            if scale != 1.0:
                block = block * scale
            if kept is not None:
                block = block.masked_fill(~kept, LEFT_OUT)
            row_max, sums = softmax_rows(block, probs[rows] if probs is not None else None, shard,
                                         lambda exp, x: [x.sum(dim=1)] + ([(exp * x).sum(dim=1)] if entropy else []))
            lse[rows], logit_sums[rows] = row_max + sums[0].log(), sums[1]
            if entropy:  # H = logsumexp(x) - sum softmax(x) x
                entropies[rows] = lse[rows] - sums[2] / sums[0]
        target = shard.sum_(logits.gather(1, local_labels[:, None]).squeeze(1).float() * scale * inside)
        logps = (target - lse) * valid
        mean_logits = logit_sums / vocab
        ctx.mark_non_differentiable(mean_logits, entropies)
        ctx.save_for_backward(probs, local_labels, inside, valid)
        ctx.logits_dtype, ctx.scale, ctx.used = logits.dtype, scale, False
        return logps, mean_logits, entropies * valid

    @staticmethod
    def backward(ctx, grad_logps: torch.Tensor, grad_mean_logits: torch.Tensor, grad_entropies: torch.Tensor) -> tuple:
        probs, local_labels, inside, valid = saved_once(ctx, "TokenLogps")
        g = grad_logps * valid * ctx.scale  # rows without a label have a constant 0
        grad = probs.mul_(-g[:, None].to(probs.dtype))  # d log p(label) / d logits = scale (onehot - softmax)
        grad.scatter_add_(1, local_labels[:, None], (g * inside)[:, None].to(grad.dtype))
        return grad.to(ctx.logits_dtype), None, None, None, None, None, None
