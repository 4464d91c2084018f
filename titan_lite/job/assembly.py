"""Model assembly, the one path every entry point takes: meta model, transforms, pipeline split, parallelize,
materialise, init, the load plan's initial weights, transforms after load."""

import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from titan_lite.checkpoint.manager import load_initial_weights
from titan_lite.checkpoint.resume import LoadPlan
from titan_lite.data.datasets import build_packed_source
from titan_lite.dtensor import local_tensor
from titan_lite.job.plan import JobPlan
from titan_lite.loss import build_loss_fn
from titan_lite.models.decoder import Llama
from titan_lite.parallel.parallelize import loss_parallel_enabled, parallelize_llama
from titan_lite.parallel.pipeline import PipelineRunner, pipeline_llama, split_llama
from titan_lite.parallel.runner import ModelRunner
from titan_lite.transforms import TransformContext

logger = logging.getLogger("titan_lite")

@dataclass
class BuiltModel:
    """The model parts this rank holds (one, or its pipeline stages) and the runner that drives them."""

    parts: list[nn.Module]
    runner: ModelRunner
    pipeline: PipelineRunner | None

    def param_count(self) -> int:
        """Parameters this rank holds: a sharded parameter's local piece, not its global size."""
        return sum(local_tensor(p).numel() for m in self.parts for p in m.parameters())


def build_parts(plan: JobPlan, device: torch.device, loss_fn: Callable,
                schedule: bool = True) -> tuple[list[nn.Module], PipelineRunner | None]:
    """The meta model, converted by the transforms, split into this rank's pipeline stages and parallelised
    (still on the meta device: DRY_RUN plans from here, without the pipeline schedule: `schedule` False)."""
    with torch.device("meta"):
        model = Llama(plan.model_args)
    # Parameters in training.dtype (init_weights rebuilds the fp32 RoPE cache); transforms may choose otherwise.
    model.to(getattr(torch, plan.cfg.training.dtype))
    plan.transforms.convert(model)
    if plan.cfg.model.print_after_conversion:
        logger.info(f"model after transforms:\n{model}")
    pipeline, parts = None, [model]
    if plan.parallel_dims.pp_enabled and schedule:
        pipeline, parts = pipeline_llama(model, plan.parallel_dims, plan.cfg, device, loss_fn)
    elif plan.parallel_dims.pp_enabled:
        _, parts = split_llama(model, plan.parallel_dims, plan.cfg)
    edits = plan.transforms.tp_plan_edits()
    parts = [parallelize_llama(part, plan.parallel_dims, plan.cfg, edits) for part in parts]
    for part in parts:
        plan.transforms.after_parallelize(part, plan.parallel_dims)
    return parts, pipeline


def loss_function(plan: JobPlan) -> Callable:
    return build_loss_fn(plan.cfg.compile, loss_parallel_enabled(plan.parallel_dims, plan.cfg))


def materialise(parts: list[nn.Module], plan: JobPlan, device: torch.device, seed: int) -> None:
    """Allocate the parts on the device (sharded parameters on the CPU under FSDP CPU offload) and initialise."""
    offload = plan.cfg.training.enable_cpu_offload
    for part in parts:
        part.to_empty(device="cpu" if offload else device)
        part.tie_embeddings()  # to_empty untied them; FSDP tracks the embedding's parameter (the first module)
        part.init_weights(seed=seed, buffer_device=device)
        part.train()


def assemble_model(plan: JobPlan, device: torch.device, *, seed: int = 0,
                   load: LoadPlan | None = None) -> BuiltModel:
    """Build, materialise and initialise this rank's parts, load the load plan's initial weights (if any), then let
    the transforms work on real weights (`after_load`). The trainer and the scripts come through here.

    The plan's checkpoint is loaded by the caller afterwards (CheckpointManager.load_planned). When it restores every
    parameter the initial weights are not loaded; when it does not (adapter-only checkpoints) they are, and the rest
    comes from the checkpoint.
    """
    load = load or LoadPlan()
    loss_fn = loss_function(plan)
    parts, pipeline = build_parts(plan, device, loss_fn)
    materialise(parts, plan, device, seed)
    built = BuiltModel(parts, ModelRunner(parts, plan.parallel_dims, plan.cfg, device, loss_fn, pipeline), pipeline)
    restores_model = load_initial_weights(load, parts, plan.cfg.checkpoint, plan.model_args, plan.transforms.hf_names,
                                          plan.transforms.saves_parameter)
    plan.transforms.after_load(TransformContext(
        cfg=plan.cfg, model_args=plan.model_args, parallel_dims=plan.parallel_dims, device=device,
        tokenizer=plan.tokenizer, model_parts=parts, runner=built.runner,
        calibration_batches=calibration_source(plan, device), resuming=load.resuming,
        checkpoint_holds_model=restores_model, initial_hf_folder=initial_hf_folder(load, restores_model)))
    return built


def initial_hf_folder(load: LoadPlan, restores_model: bool) -> str | None:
    """The HF folder assembly read the initial weights from, or None."""
    if load.initial is None or load.initial.kind != "hf" or restores_model:
        return None
    return str(load.initial.path)


def calibration_source(plan: JobPlan, device: torch.device):
    """Calibration batches for transforms: the first `nsamples` windows of `seq_len` tokens of a dataset, packed
    from one stream on every rank (so any layout sees the same set), then dealt round-robin over data-parallel
    ranks; each rank yields its share in batches of `batch_size`."""
    dims = plan.parallel_dims

    def batches(dataset: str, path: str | None, nsamples: int, seq_len: int,
                batch_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        source = build_packed_source(dataset, path, plan.tokenizer, seq_len, infinite=False)
        windows = [sample for sample, _ in itertools.islice(source.samples(), nsamples)]
        if dims.dp_degree > 1:
            mesh = dims.submesh("batch")
            windows = windows[mesh.get_local_rank()::mesh.size()]
        for i in range(0, len(windows), batch_size):
            chunk = windows[i:i + batch_size]
            yield (torch.stack([w[0] for w in chunk]).to(device), torch.stack([w[1] for w in chunk]).to(device))
    return batches
