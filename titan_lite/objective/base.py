"""The contract of a training objective: what it counts, prepares, asks of a frozen model and sums for a microbatch
(the cross entropy here; distillation, preference tuning and GRPO subclass it)."""

from collections.abc import Callable
from typing import Any

import torch

from titan_lite.data.batch import Batch
from titan_lite.loss import IGNORE_INDEX


class Objective:
    """What training minimises for one microbatch, as a sum over the units the loss averages (callers normalise by the
    global count of those units): here the cross entropy of the model's logits, summed over the tokens with a label.
    A frozen model (a teacher, a reference) runs through `reference` on the same inputs as the trained model, by the
    runner's one model-forward path."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn = loss_fn

    def units(self, batch: Batch) -> torch.Tensor:
        """The counts a microbatch adds to the step (float64, 1-D): the first one normalises the loss (here the tokens
        with a label); an objective may count more for itself (start_step gets their global sums)."""
        return (batch.labels != IGNORE_INDEX).sum().double()[None]

    def start_step(self, global_units: torch.Tensor) -> None:
        """The step's units summed over every microbatch of every data-parallel rank, before its first forward."""

    def prepare(self, batch: Batch, shard: Callable) -> Any:
        """What the loss needs of a microbatch besides this rank's logits and labels, from the whole batch (its
        labels, document ids, per-token values) (shard(*tensors): this rank's context-parallel part of [batch, seq]
        tensors), or None."""
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

    def pipeline_step(self, pipeline: Any, inputs: torch.Tensor, labels: torch.Tensor, batch: Batch,
                      scale: torch.Tensor, extra: dict) -> torch.Tensor:
        """One microbatch through a pipeline (a PipelineRunner), `inputs` and `labels` this rank's parts of the
        batch's: its own loss on the last stage, unless the objective computes another there."""
        return pipeline.step(inputs, labels, scale, extra=extra)

    def eval_sums(self, logits: torch.Tensor, reference: Any, prepared: Any) -> torch.Tensor:
        """The sums a validation pass adds up over batches, for an objective validated on its own terms (preference
        tuning's rewards); cross entropy and distillation validate on the cross entropy instead."""
        raise NotImplementedError(f"{type(self).__name__} is validated on the cross entropy")
