"""The one place a run's data sources are chosen, for training and validation: packed pre-training windows (raw
text or token files), instruction, chat and preference records, a data mixture, or RL's prompts (rollouts of the
model being trained, sampled through the policy interface)."""

import contextlib
import logging
from dataclasses import dataclass
from functools import partial

import torch

from titan_lite.config.schema import JobConfig
from titan_lite.data.dataloader import BatchLayout, DataLoader, build_section_loader, describe_source, loader_options
from titan_lite.data.mixture import DomainWeights, build_domain_weights
from titan_lite.data.tokenizer import describe_tokenizer
from titan_lite.distributed import compute_dtype
from titan_lite.job.plan import JobPlan
from titan_lite.parallel.gather_once import (
    free_bytes,
    fsdp_modules,
    gathered_once,
    gathers_once,
    resharded,
    unsharded_bytes,
)
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.runner import ModelRunner
from titan_lite.rl.evaluate import PromptValidation
from titan_lite.rl.memory import decoded_together, rollout_memory
from titan_lite.rl.policy import ModelPolicy, lockstep_for
from titan_lite.rl.rollout import RolloutSource, build_rollout_source

logger = logging.getLogger("titan_lite")
# The trainer's batches: a loader over a dataset, or RL's rollouts (iterated, checkpointed and logged alike).
TrainingLoader = DataLoader | RolloutSource


@dataclass
class TrainingData:
    """What the trainer reads its batches from, and the data mixture's domain weights when it mixes domains."""

    loader: TrainingLoader
    mixture: DomainWeights | None = None


def reads_prompts(cfg: JobConfig, section: str) -> bool:
    """[training] or [validation] reads RL prompts (its batches are the policy's scored answers to them)."""
    return getattr(cfg, section).dataset == "prompts"


def policy_of(runner: ModelRunner, device: torch.device, dims: ParallelDims,
              weights: "RolloutWeights | None" = None) -> ModelPolicy:
    """The model being trained as a policy: its forward as training runs it (in the rollout's weights when given),
    in lockstep with its layout's ranks where that forward issues collectives."""
    if weights is None:
        return ModelPolicy(runner.model_parts[0], device, partial(lockstep_for, dims), runner.context)
    return ModelPolicy(runner.model_parts[0], device, lambda: lockstep_for(dims, bool(weights.gather)), weights)


class RolloutWeights:
    """The context a rollout decodes in: the runner's, FSDP's weights gathered once or layer by layer
    (grpo.gather_once), the transforms' folded for decoding (grpo.fold_adapters); the choice logged once."""

    def __init__(self, plan: JobPlan, runner: ModelRunner, device: torch.device):
        self.plan, self.runner, self.device = plan, runner, device
        self.gather: bool | None = None

    def __call__(self) -> contextlib.ExitStack:
        """Entered in this order, left in the reverse: the weights folded (into FSDP's shards, which the rollout's
        all-gathers then read), FSDP's gathered copies dropped (before the base is restored into the shards), the
        weights gathered once."""
        model = self.runner.model_parts[0]
        stack = self.runner.context()
        try:
            if self.gather is None:
                self.gather = self.choose_gather()
            folded = self.plan.transforms.folded_for_decoding(self.runner.model_parts) \
                if self.plan.cfg.grpo.fold_adapters else None
            if folded is not None:
                stack.enter_context(folded)
            stack.enter_context(resharded(model))
            if self.gather:
                stack.enter_context(gathered_once(model))
        except BaseException:
            stack.close()
            raise
        return stack

    def choose_gather(self) -> bool:
        """Gather once where the unsharded weights fit beside the rollout (under FSDP; TP decodes as it does)."""
        cfg, dims, model = self.plan.cfg, self.plan.parallel_dims, self.runner.model_parts[0]
        if not fsdp_modules(model):
            return False
        c = compute_dtype(cfg.training.mixed_precision_param, self.device.type).itemsize
        together = decoded_together(cfg, cfg.training.local_batch_size * self.plan.grad_accum)
        needed = unsharded_bytes(model, c, dims.tp) + rollout_memory(cfg, self.plan.model_args, dims.tp, together,
                                                                      c).total
        gather, why = gathers_once(cfg.grpo.gather_once, needed, free_bytes(self.device), self.device)
        how = "gathers FSDP's weights once and keeps them gathered while it decodes" if gather else \
            "all-gathers FSDP's weights layer by layer in every decode step"
        logger.info(f"rollout: {how} ({why})")
        return gather


def training_data(plan: JobPlan, runner: ModelRunner, device: torch.device, seed: int) -> TrainingData:
    """[training]'s source for this rank's layout: RL rollouts of the prompts (online RL: the policy answers them and
    trains on its scored answers), a data mixture, or the section's dataset."""
    cfg, t, dims = plan.cfg, plan.cfg.training, plan.parallel_dims
    batch_mesh = dims.submesh("batch")
    layout = BatchLayout(t.local_batch_size, batch_mesh.get_local_rank(), batch_mesh.size(), plan.grad_accum)
    if reads_prompts(cfg, "training"):
        policy = policy_of(runner, device, dims, RolloutWeights(plan, runner, device))
        return TrainingData(build_rollout_source(cfg, plan.tokenizer, layout, policy, dims, seed))
    if cfg.data_mixture.enable:
        mixture = build_domain_weights(cfg.data_mixture, plan.tokenizer, t.seq_len, seed,
                                       documents=plan.block_causal, shuffle=t.shuffle)
        return TrainingData(DataLoader(mixture.source, layout, loader_options(t.dataloader)), mixture)
    loader = build_section_loader(cfg, "training", plan.tokenizer, layout, documents=plan.block_causal)
    logger.info(f"data: {describe_source(loader.source, layout)}; tokenizer: {describe_tokenizer(plan.tokenizer)}")
    return TrainingData(loader)


def validation_data(cfg: JobConfig, tokenizer, dims: ParallelDims, runner: ModelRunner,
                    device: torch.device) -> DataLoader | PromptValidation:
    """[validation]'s source: the held-out prompts answered greedily by the policy, or a finite pass of the section's
    dataset in stored order, batched for this rank's layout."""
    if reads_prompts(cfg, "validation"):
        return PromptValidation(cfg, tokenizer, policy_of(runner, device, dims), dims)
    batch_mesh = dims.submesh("batch")
    layout = BatchLayout(cfg.validation.local_batch_size, batch_mesh.get_local_rank(), batch_mesh.size())
    return build_section_loader(cfg, "validation", tokenizer, layout, infinite=False, documents=runner.block_causal)
