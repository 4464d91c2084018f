"""The training loss: token-sum cross entropy with IGNORE_INDEX and whether it is compiled; and the one row-block
kernel the chunked losses share (cross entropy here, log-probabilities and distillation in titan_lite/objective/):
blocks of rows, each block's softmax written into the gradient's buffer in the forward, a backward that finishes
that gradient in place, once.

The objectives (and their base class) are in titan_lite/objective/."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from titan_lite.config.schema import Compile

# Labels with this value carry no loss (padding, prompt tokens of instruction data).
IGNORE_INDEX = -100

# Elements of the [rows, vocab] block that row-chunked cross entropy works on at a time. CPU: 4 MiB of float32, small
# enough to stay in the cache and below malloc's mmap threshold (no page faults for the temporaries). Accelerators:
# 64 MiB, few enough blocks that kernel launches do not matter (63 for 2 x 8192 tokens of a 128k vocabulary).
_CHUNK_ELEMENTS = 1 << 20
_ACCELERATOR_CHUNK_ELEMENTS = 1 << 24


# ------------------------------------------------------------------------------------------ the row-block kernel


def row_blocks(rows: int, width: int, device: torch.device, elements: tuple[int, int]) -> list[slice]:
    """Slices of rows whose [rows, width] float32 block holds about elements[0] elements on the CPU, elements[1] on
    an accelerator (each chunked loss names its own: as many float32 temporaries as it keeps alive per block)."""
    cpu, accelerator = elements
    step = max(1, (cpu if device.type == "cpu" else accelerator) // max(1, width))
    return [slice(start, start + step) for start in range(0, rows, step)]


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

    def local_labels(self, labels: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels as column indices of this shard, 0 where outside it; whether each label is in this shard)."""
        inside = (labels >= self.offset) & (labels < self.offset + width)
        return torch.where(inside, labels - self.offset, 0), inside


def softmax_rows(block: torch.Tensor, probs: torch.Tensor | None, shard: VocabShard = VocabShard(),
                 more_sums: Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row maxima, [row sums of exp(block - max), *more_sums(exp, block)]) of a float32 block of rows, made whole
    over the vocab shards; with `probs` (the block's rows of the gradient's buffer, in the logits' dtype) softmax(block)
    is written there, with one exp per logit (in place when the buffer is float32, else in a float32 temporary)."""
    row_max = shard.max_(block.amax(dim=1))
    exp_in_probs = probs is not None and probs.dtype == torch.float32
    exp = torch.sub(block, row_max[:, None], out=probs if exp_in_probs else None).exp_()
    sums = shard.sum_(torch.stack([exp.sum(dim=1), *(more_sums(exp, block) if more_sums is not None else [])]))
    if probs is not None:
        exp.div_(sums[0][:, None])
        if not exp_in_probs:
            probs.copy_(exp)
    return row_max, sums


def saved_once(ctx, name: str) -> tuple[torch.Tensor, ...]:
    """A chunked loss's saved tensors for its backward, which makes the gradient in place from them: only once."""
    if ctx.used:
        raise RuntimeError(f"{name} supports one backward pass (no retain_graph)")
    ctx.used = True
    return ctx.saved_tensors


# ------------------------------------------------------------------------------------------ cross entropy


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token losses, so the caller can normalise by the global token count.

    Eager, plain tensors go through ChunkedCrossEntropySum (the same values in fewer passes over the logits, no
    [tokens, vocab] float32 temporaries: what lets an 8B QLoRA step fit one 24 GB GPU). Compiled code (inductor fuses
    F.cross_entropy itself) and vocab-sharded DTensor logits (loss parallel) use F.cross_entropy.
    """
    if _chunked(logits):
        return ChunkedCrossEntropySum.apply(logits.flatten(0, 1), labels.flatten())
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def cross_entropy_per_sample(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-loss sum of every sample: [batch] for logits [batch, seq, vocab]; the same terms as cross_entropy_sum,
    split by sample (data mixtures measure each domain's loss from them). Used only when a run asks for it."""
    if _chunked(logits):
        token_losses = ChunkedCrossEntropySum.apply(logits.flatten(0, 1), labels.flatten(), True)
    else:
        token_losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none",
                                       ignore_index=IGNORE_INDEX)
    return token_losses.view(labels.shape[0], -1).sum(dim=1)


def _chunked(logits: torch.Tensor) -> bool:
    return not isinstance(logits, DTensor) and not torch.compiler.is_compiling()


class ChunkedCrossEntropySum(torch.autograd.Function):
    """sum over rows of logsumexp(logits) - logits[label], for logits [tokens, vocab], in float32 blocks of rows.

    When a gradient is wanted the forward writes softmax(logits) into the gradient's buffer (in the logits' dtype)
    as it goes (one exp per logit, in all), and the backward only scales it and subtracts the one-hot labels in
    place. Nothing saves the logits: after the forward only that buffer remains, where F.cross_entropy keeps a
    float32 log-softmax copy and then allocates two more float32 [tokens, vocab] tensors in its backward. With
    per_token it returns the [tokens] losses instead of their sum.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        valid = labels != IGNORE_INDEX
        safe_labels = torch.where(valid, labels, 0)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        probs = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        elements = (_CHUNK_ELEMENTS, _ACCELERATOR_CHUNK_ELEMENTS)
        for rows in row_blocks(logits.shape[0], logits.shape[1], logits.device, elements):
            row_max, sums = softmax_rows(logits[rows].float(), probs[rows] if probs is not None else None)
            torch.add(row_max, sums[0].log(), out=lse[rows])
        target = logits.gather(1, safe_labels[:, None]).squeeze(1).float()
        ctx.save_for_backward(probs, safe_labels, valid)
        ctx.logits_dtype = logits.dtype
        ctx.used = False
        token_losses = (lse - target) * valid
        return token_losses if per_token else token_losses.sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        probs, safe_labels, valid = saved_once(ctx, "ChunkedCrossEntropySum")
        scale = valid * grad_output  # [tokens]: 0 on ignored rows (grad_output: a scalar, or [tokens] per token)
        grad = probs.mul_(scale[:, None])
        grad.scatter_add_(1, safe_labels[:, None], -scale[:, None].to(grad.dtype))
        return grad.to(ctx.logits_dtype), None, None



def build_loss_fn(compile_cfg: Compile, loss_parallel: bool, per_sample: bool = False):
    """cross_entropy_sum (or cross_entropy_per_sample), compiled when `compile.components` has 'loss' (and loss
    parallel is off: compiled, cross
    entropy ignores loss_parallel()'s handlers and normalises each vocab shard on its own, a silently wrong loss)."""
    fn = cross_entropy_per_sample if per_sample else cross_entropy_sum
    if compile_cfg.enable and "loss" in compile_cfg.components and not loss_parallel:
        return torch.compile(fn, backend=compile_cfg.backend)
    return fn
