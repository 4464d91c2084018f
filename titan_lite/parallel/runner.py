"""ModelRunner: batches through the parallelised model parts (CP sharding, pipeline, loss parallel, autocast)."""

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from titan_lite.config.schema import JobConfig
from titan_lite.data.batch import Batch
from titan_lite.data.datasets import document_positions
from titan_lite.distributed import compute_dtype
from titan_lite.dtensor import full_tensor
from titan_lite.loss import IGNORE_INDEX, build_loss_fn
from titan_lite.parallel.context_parallel import shard_batch
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.parallelize import loss_parallel_enabled
from titan_lite.parallel.pipeline import PipelineRunner

# Keyword inputs of a model forward besides the token ids (see ModelRunner.extra_inputs).
ExtraInputs = dict[str, torch.Tensor]


class RunnerObjective(Protocol):
    """What the runner asks of the objective its caller (the trainer, the validator) hands in: one of
    titan_lite/objective/ (its base class documents each method); None stands for the cross entropy of loss_fn."""

    def prepare(self, batch: Batch, shard: Callable) -> Any: ...

    def reference(self, forward: Callable[[nn.Module], torch.Tensor], prepared: Any = None) -> Any: ...

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor, reference: Any = None,
                 prepared: Any = None) -> torch.Tensor: ...

    def pipeline_step(self, pipeline: PipelineRunner, inputs: torch.Tensor, labels: torch.Tensor, batch: Batch,
                      scale: torch.Tensor, extra: ExtraInputs) -> torch.Tensor: ...

    def eval_sums(self, logits: torch.Tensor, reference: Any, prepared: Any) -> torch.Tensor: ...


class ModelRunner:
    """Runs one local batch through the model parts, the same way on every layout.

    Token losses are sums (see titan_lite.loss); callers normalise by a global token count. Under context parallel
    each rank runs its own sequence chunks; under pipeline parallel only ranks holding the last stage see losses.
    The runner holds no objective: the caller hands in the one it holds.
    """

    def __init__(self, model_parts: list[nn.Module], parallel_dims: ParallelDims, cfg: JobConfig,
                 device: torch.device, loss_fn: Callable, pipeline: PipelineRunner | None = None):
        self.model_parts = model_parts
        self.parallel_dims = parallel_dims
        self.cfg = cfg
        self.device = device
        self.loss_fn = loss_fn
        self.pipeline = pipeline
        self.loss_parallel = loss_parallel_enabled(parallel_dims, cfg)
        self.sample_loss_fn = build_loss_fn(cfg.compile, self.loss_parallel, per_sample=True)  # data mixtures only
        # packed documents attend only within themselves: the batches carry document ids
        self.block_causal = getattr(model_parts[0], "args", None) is not None and \
            model_parts[0].args.attn_mask_type == "block_causal"

    def logits(self, model: nn.Module, inputs: torch.Tensor, extra: ExtraInputs) -> torch.Tensor:
        """A model's logits for this rank's inputs: the one forward path of the student and of an objective's
        teacher, so both see the same inputs and extra inputs (packed documents' positions and ids)."""
        return model(inputs, **extra)

    def context(self) -> contextlib.ExitStack:
        """Loss parallel under TP (the loss runs on vocab-sharded logits); autocast when mixed precision is asked
        for but no data parallelism (whose FSDP policy casts itself) is applied."""
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            stack.enter_context(loss_parallel())
        dtype = compute_dtype(self.cfg.training.mixed_precision_param, self.device.type)
        pd = self.parallel_dims
        if dtype != torch.float32 and not (pd.fsdp_enabled or pd.dp_replicate_enabled):
            stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
        return stack

    def shard(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of [batch, seq] tensors: their context-parallel sequence chunks, or the whole batch."""
        if not self.parallel_dims.cp_enabled:
            return tensors
        return shard_batch(tensors, self.parallel_dims, self.cfg.parallelism.context_parallel_load_balancer)

    def extra_inputs(self, documents: torch.Tensor | None) -> ExtraInputs:
        """The model's forward inputs besides the token ids, for one batch: with packed documents (block_causal),
        every token's position in its document (this rank's context-parallel chunks of them) and the document ids
        of the whole sequence, from which the forward builds its attention mask once. A teacher (or any other)
        forward of the same batch takes the same: model(inputs, **extra)."""
        if documents is None:
            return {}
        (positions,) = self.shard(document_positions(documents))
        return {"positions": positions, "documents": documents}

    def forward_backward(self, batch: Batch, scale: torch.Tensor, objective: RunnerObjective | None = None,
                         domain_sums: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of one microbatch with loss = the objective's loss sum x scale (None: the token-loss
        sum of the cross entropy); returns the detached sum.

        With the batch's domains (data mixtures) the loss is the cross entropy computed per sample and this rank's
        per-domain token-loss sums and token counts are added to domain_sums ([2, domains]); under pipeline parallel
        only the last stage adds to them (callers sum them over the stages, as global_sum does)."""
        extra = self.extra_inputs(batch.documents)
        prepared = objective.prepare(batch, self.shard) if objective is not None else None
        inputs, labels = self.shard(batch.inputs, batch.labels)
        domains = batch.domains
        with self.context():
            if self.pipeline is not None and domains is None and objective is not None:
                loss_sum = objective.pipeline_step(self.pipeline, inputs, labels, batch, scale, extra)
            elif self.pipeline is not None:
                loss_sum = self.pipeline.step(inputs, labels, scale, domains, domain_sums, self.domain_loss, extra)
            else:
                reference = objective.reference(lambda model: self.logits(model, inputs, extra), prepared) \
                    if objective is not None else None
                logits = self.logits(self.model_parts[0], inputs, extra)
                if domains is not None:
                    loss_sum = self.domain_loss(logits, labels, domains, domain_sums)
                elif objective is not None:
                    loss_sum = objective.loss_sum(logits, labels, reference, prepared)
                else:
                    loss_sum = self.loss_fn(logits, labels)
                del logits, reference
                (loss_sum * scale).backward()
        return full_tensor(loss_sum.detach())

    def domain_loss(self, output: torch.Tensor, labels: torch.Tensor, domains: torch.Tensor,
                    domain_sums: torch.Tensor) -> torch.Tensor:
        """The token-loss sum, adding each sample's loss and token count to its domain's column of domain_sums."""
        per_sample = self.sample_loss_fn(output, labels)
        ids = domains.clamp(0, domain_sums.shape[1] - 1)  # the pipeline's shape-inference call passes placeholders
        domain_sums[0].index_add_(0, ids, full_tensor(per_sample.detach()).double())
        domain_sums[1].index_add_(0, ids, (labels != IGNORE_INDEX).sum(dim=1).double())
        return per_sample.sum()

    @torch.no_grad()
    def loss_sum(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(token-loss sum, tokens with a loss) of one batch on this rank, in float64, without gradients."""
        loss, tokens, _ = self.eval_sums(batch)
        return loss, tokens

    def eval_sums(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """loss_sum's two, and the tokens whose argmax prediction equals the label (None under pipeline parallel,
        where only the loss leaves the last stage)."""
        extra = self.extra_inputs(batch.documents)
        inputs, labels = self.shard(batch.inputs, batch.labels)
        correct = None
        with self.context():
            if self.pipeline is not None:
                loss = self.pipeline.evaluate(inputs, labels, extra)
            else:
                logits = self.logits(self.model_parts[0], inputs, extra)
                loss = self.loss_fn(logits, labels)
                correct = (full_tensor(logits).argmax(dim=-1) == labels).sum().double()
        return full_tensor(loss).double(), (labels != IGNORE_INDEX).sum().double(), correct

    @torch.no_grad()
    def forward_only(self, run: Callable[[Callable[[nn.Module], torch.Tensor]], Any], batch: Batch) -> Any:
        """run(forward), where forward(model) is a model's logits on this rank's part of the batch (the forward of
        training: CP sharding, extra inputs, loss parallel, autocast), without gradients."""
        extra = self.extra_inputs(batch.documents)
        (inputs,) = self.shard(batch.inputs)
        with self.context():
            return run(lambda model: self.logits(model, inputs, extra))

    @torch.no_grad()
    def objective_sums(self, batch: Batch, objective: RunnerObjective) -> torch.Tensor:
        """The objective's evaluation sums of one batch on this rank (its reference run first, as in training)."""
        if self.pipeline is not None:
            with self.context():
                return objective.pipeline_eval_sums(self.pipeline, batch, self.extra_inputs(batch.documents))
        prepared = objective.prepare(batch, self.shard)

        def run(forward: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
            reference = objective.reference(forward, prepared)
            return objective.eval_sums(forward(self.model_parts[0]), reference, prepared)
        return self.forward_only(run, batch)

    def global_sum(self, local: torch.Tensor, loss_values: bool) -> torch.Tensor:
        """Sum of a per-rank statistic over the ranks that split a batch (data and context parallel). Loss values
        are also summed over pipeline stages, where only the last stage holds them (the others hold zero)."""
        pd = self.parallel_dims
        if pd.dp_degree * pd.cp > 1:
            dist.all_reduce(local, group=pd.submesh("loss").get_group())
        if loss_values and pd.pp_enabled:
            dist.all_reduce(local, group=pd.submesh("pp").get_group())
        return local
