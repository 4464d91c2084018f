"""The training loss: token-sum cross entropy with IGNORE_INDEX, whether it is compiled, and the objective the
runner calls (cross entropy here; distillation and preference tuning in titan_lite/objective/)."""

from collections.abc import Callable
from typing import Any

import torch
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
        exp_in_probs = probs is not None and probs.dtype == torch.float32  # else exp in a float32 temporary
        for rows in _row_blocks(logits):
            block = logits[rows].float()
            row_max = block.amax(dim=-1, keepdim=True)
            exp = torch.sub(block, row_max, out=probs[rows] if exp_in_probs else None).exp_()
            total = exp.sum(dim=-1, keepdim=True)
            if probs is not None:
                exp.div_(total)
                if not exp_in_probs:
                    probs[rows].copy_(exp)
            torch.add(row_max.squeeze(1), total.squeeze(1).log(), out=lse[rows])
        target = logits.gather(1, safe_labels[:, None]).squeeze(1).float()
        ctx.save_for_backward(probs, safe_labels, valid)
        ctx.logits_dtype = logits.dtype
        ctx.used = False
        token_losses = (lse - target) * valid
        return token_losses if per_token else token_losses.sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.used:  # the gradient is made in place from the saved probabilities: only once
            raise RuntimeError("ChunkedCrossEntropySum supports one backward pass (no retain_graph)")
        ctx.used = True
        probs, safe_labels, valid = ctx.saved_tensors
        scale = valid * grad_output  # [tokens]: 0 on ignored rows (grad_output: a scalar, or [tokens] per token)
        grad = probs.mul_(scale[:, None])
        grad.scatter_add_(1, safe_labels[:, None], -scale[:, None].to(grad.dtype))
        return grad.to(ctx.logits_dtype), None, None


def _row_blocks(logits: torch.Tensor) -> list[slice]:
    chunk = _CHUNK_ELEMENTS if logits.device.type == "cpu" else _ACCELERATOR_CHUNK_ELEMENTS
    rows = max(1, chunk // max(1, logits.shape[1]))
    return [slice(start, start + rows) for start in range(0, logits.shape[0], rows)]


def build_loss_fn(compile_cfg: Compile, loss_parallel: bool, per_sample: bool = False):
    """cross_entropy_sum (or cross_entropy_per_sample), compiled when `compile.components` has 'loss' (and loss
    parallel is off: compiled, cross
    entropy ignores loss_parallel()'s handlers and normalises each vocab shard on its own, a silently wrong loss)."""
    fn = cross_entropy_per_sample if per_sample else cross_entropy_sum
    if compile_cfg.enable and "loss" in compile_cfg.components and not loss_parallel:
        return torch.compile(fn, backend=compile_cfg.backend)
    return fn


class Objective:
    """What training minimises for one microbatch, as a sum over the units the loss averages (callers normalise by the
    global count of those units): here the cross entropy of the model's logits, summed over the tokens with a label.
    titan_lite/objective/ adds distillation, preference tuning and GRPO: their frozen model (a teacher, a reference)
    runs through `reference` on the same inputs as the trained model, by the runner's one model-forward path."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn = loss_fn

    def units(self, labels: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
        """The counts a microbatch adds to the step (float64, 1-D): the first one normalises the loss (here the tokens
        with a label); an objective may count more for itself (start_step gets their global sums)."""
        return (labels != IGNORE_INDEX).sum().double()[None]

    def start_step(self, global_units: torch.Tensor) -> None:
        """The step's units summed over every microbatch of every data-parallel rank, before its first forward."""

    def prepare(self, labels: torch.Tensor, documents: torch.Tensor | None, shard: Callable,
                values: torch.Tensor | None = None) -> Any:
        """What the loss needs of a microbatch besides this rank's logits and labels, from its whole labels, document
        ids and per-token values ([batch, seq, k] floats a source adds: RL's sampling log-probabilities and
        advantages) (shard(*tensors): this rank's context-parallel part of [batch, seq] tensors), or None."""
        return None

    def reference(self, forward: Callable[[torch.nn.Module], torch.Tensor], prepared: Any = None) -> Any:
        """A frozen model's output for this microbatch (forward(model) runs a model on its inputs), or None."""
        return None

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor, reference: Any = None,
                 prepared: Any = None) -> torch.Tensor:
        return self.loss_fn(logits, labels)

    def step_metrics(self, global_sum: Callable[[torch.Tensor], torch.Tensor],
                     global_units: torch.Tensor) -> dict[str, float]:
        """Scalars of the step's loss parts, logged with the training line (collective when not empty)."""
        return {}

    def pipeline_step(self, pipeline: Any, inputs: torch.Tensor, labels: torch.Tensor,
                      documents: torch.Tensor | None, scale: torch.Tensor, extra: dict) -> torch.Tensor:
        """One microbatch through a pipeline (a PipelineRunner): its own loss on the last stage, unless the objective
        computes another there."""
        return pipeline.step(inputs, labels, scale, extra=extra)

    def eval_sums(self, logits: torch.Tensor, reference: Any, prepared: Any) -> torch.Tensor:
        """The sums a validation pass adds up over batches, for an objective validated on its own terms (preference
        tuning's rewards); cross entropy and distillation validate on the cross entropy instead."""
        raise NotImplementedError(f"{type(self).__name__} is validated on the cross entropy")
