"""The 'prune' transform: one-shot pruning once the initial weights are loaded (memory plan first, measured peak
after), then training with the masks held exactly; a per-layer sparsity report at the end."""

import json
import logging
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.data.datasets import check_dataset
from titan_lite.dtensor import local_tensor
from titan_lite.errors import ConfigError
from titan_lite.metrics.memory import PeakReading, device_capacity_gib, measure_peak
from titan_lite.models.args import LlamaArgs
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms.base import PassPlan, PlanContext, Transform, TransformContext, register_transform
from titan_lite.transforms.pruning.calibration import OneShotPruner, PruneResult, find_targets
from titan_lite.transforms.pruning.masks import (
    MASK,
    Pattern,
    all_kept_like,
    apply_mask,
    attach_mask,
    local_counts,
    mask_gradient,
    masked_linears,
)
from titan_lite.transforms.pruning.memory_plan import PruningMemoryPlan, format_bytes, plan_pruning, precision
from titan_lite.transforms.pruning.methods import calibrates

logger = logging.getLogger("titan_lite")
REPORT_NAME = "sparsity_report.json"


def check_with_lora(cfg: JobConfig) -> None:
    """LoRA recovery on a pruned base: prune first (the adapters wrap pruned linears), and an adapter init that
    leaves the base as pruned (PiSSA would replace it with a dense residual that the masks then cut)."""
    converters = cfg.model.converters
    if "lora" not in converters:
        return
    if converters.index("lora") < converters.index("prune"):
        raise ConfigError(f"'model.converters' = {converters}: list 'prune' before 'lora' (the adapters recover a "
                          "pruned base)")
    if cfg.lora.init.startswith("pissa"):
        raise ConfigError(f"'lora.init' = '{cfg.lora.init}' cannot follow 'prune' in 'model.converters': PiSSA "
                          "replaces the pruned base with a dense residual; use init 'default' or 'gaussian'")


def check_layout(cfg: JobConfig, args: LlamaArgs, dims: ParallelDims) -> None:
    """What the one-shot pass needs of the layout and the shapes; each refusal is one line naming the key."""
    p = cfg.pruning
    check_with_lora(cfg)
    if dims.pp_enabled:
        raise ConfigError(f"the 'prune' transform does not run under pipeline parallelism "
                          f"('parallelism.pipeline_parallel_degree' = {dims.pp}): calibration feeds every block the "
                          "outputs of the pruned blocks before it; use FSDP and/or tensor parallelism")
    if dims.cp_enabled:
        raise ConfigError(f"the 'prune' transform does not run under context parallelism "
                          f"('parallelism.context_parallel_degree' = {dims.cp}); use FSDP and/or tensor parallelism")
    if calibrates(p) and p.dataset_path is not None and Path(p.dataset_path).exists():
        check_dataset(p.dataset, p.dataset_path, "pruning")  # text to calibrate on (DRY_RUN lists a missing path)
    if calibrates(p) and p.nsamples % dims.dp_degree:
        raise ConfigError(f"'pruning.nsamples' = {p.nsamples} must be a multiple of the data-parallel degree "
                          f"{dims.dp_degree}: every rank calibrates on the same number of sequences")
    if p.seq_len % dims.tp:
        raise ConfigError(f"'pruning.seq_len' = {p.seq_len} must be divisible by 'parallelism.tensor_parallel_degree' "
                          f"= {dims.tp} (sequence parallel splits the calibration sequences)")
    pattern = Pattern.parse(p.pattern)
    if pattern.structured:
        widths = {"dim": args.dim, "ffn_dim": args.ffn_dim, "n_heads x head_dim": args.n_heads * args.head_dim}
        for name, width in widths.items():
            if width % pattern.m:
                raise ConfigError(f"'pruning.pattern' = '{p.pattern}' needs input widths divisible by {pattern.m}, "
                                  f"but the model's {name} is {width}")


@register_transform("prune")
class PruneTransform(Transform):
    """One-shot magnitude / Wanda / SparseGPT pruning ([pruning]); masks re-applied after every optimizer step."""

    name = "prune"
    runs_on_gated_deltanet = True  # every linear, the DeltaNet projections included

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        self.result: PruneResult | None = None
        self.plan: PruningMemoryPlan | None = None
        self.measured: PeakReading | None = None
        self.dims: ParallelDims | None = None
        self.masked: list[nn.Module] = []

    def check(self, model_args: LlamaArgs, parallel_dims: ParallelDims) -> None:
        check_layout(self.cfg, model_args, parallel_dims)

    @torch.no_grad()
    def after_load(self, ctx: TransformContext) -> None:
        self.dims = ctx.parallel_dims
        model = ctx.model_parts[0]
        if ctx.resuming and ctx.checkpoint_holds_model:
            self.attach_placeholders(model)
            logger.info("prune: resuming; the masks and pruned weights come from the checkpoint")
        else:  # a fresh run, or an adapter-only checkpoint: the base is pruned again, deterministically
            self.prune_once(ctx)
        self.masked = [module for _, module in masked_linears(ctx.model_parts)]
        if self.cfg.pruning.mask_gradients:
            for module in self.masked:
                if module.weight.requires_grad:  # a frozen base (LoRA) gets no gradient to mask
                    module.weight.register_post_accumulate_grad_hook(partial(mask_gradient, module=module))

    def attach_placeholders(self, model: nn.Module) -> None:
        """Masks of the right shapes and shardings for the checkpoint to fill."""
        if not self.cfg.pruning.hold_masks:
            return
        targets, _ = find_targets(model, self.cfg.pruning.skip)
        for layer_targets in targets.values():
            for target in layer_targets:
                attach_mask(target.module, all_kept_like(target.module.weight))

    def prune_once(self, ctx: TransformContext) -> None:
        p = self.cfg.pruning
        model = ctx.model_parts[0]
        param_dtype = next(model.layers.parameters()).dtype
        self.plan = plan_pruning(p, ctx.model_args, ctx.parallel_dims, ctx.model_parts,
                                 precision(self.cfg, ctx.parallel_dims, ctx.device.type, param_dtype))
        log_plan(self.plan, self.cfg, ctx.parallel_dims, device_capacity_gib(ctx.device))
        batches = ctx.calibration_batches(p.dataset, p.dataset_path, p.nsamples, p.seq_len, p.batch_size)
        baseline = [t for part in ctx.model_parts for t in (*part.parameters(), *part.buffers())]
        with measure_peak(ctx.device, baseline) as self.measured:
            pruner = OneShotPruner(p, ctx.parallel_dims, ctx.device, ctx.runner.context)
            self.result = pruner.run(model, batches if calibrates(p) else [])
        pruned = sum(layer.pruned for layer in self.result.layers)
        total = sum(layer.shape[0] * layer.shape[1] for layer in self.result.layers)
        owl = " with OWL layer ratios" if p.layer_ratios == "owl" else ""
        logger.info(f"prune: {p.method} {p.pattern}{owl} pruned {pruned:,} of {total:,} weights "
                    f"({pruned / max(total, 1):.2%}) in {len(self.result.layers)} linears in "
                    f"{self.result.seconds:.1f}s; peak memory measured {format_bytes(self.measured.bytes)} "
                    f"({self.measured.source}), estimated {format_bytes(self.plan.peak)}")

    # ------------------------------------------------------------------------------------------ training

    def after_optimizer_step(self, model_parts: list[nn.Module], step: int) -> None:
        for module in self.masked:
            apply_mask(module)

    def metrics(self, model_parts: list[nn.Module]) -> dict[str, float]:
        """Fraction of zeros in the masked linears, and nonzero weights at pruned positions (always 0)."""
        if not self.masked:
            return {}
        counts = torch.tensor([local_counts(m) for m in self.masked], dtype=torch.float64).sum(0)
        counts = counts.to(local_tensor(self.masked[0].weight).device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)  # replicas count every element alike: the ratio is unaffected
        numel, zeros, violations = counts.tolist()
        replicas = self.dims.dp_replicate if self.dims is not None else 1
        return {"pruning/sparsity": zeros / numel, "pruning/mask_violations": violations / replicas}

    def hf_names(self, names) -> None:
        names.add_not_in_hf(rf"\.{MASK}$")

    # ------------------------------------------------------------------------------------------ plan hooks

    def sequence_length(self) -> int:
        return self.cfg.pruning.seq_len

    def check_inputs(self) -> None:
        p = self.cfg.pruning
        if p.dataset_path is not None:
            check_dataset(p.dataset, p.dataset_path, "pruning")

    def pass_plan(self, ctx: PlanContext) -> PassPlan:
        """The one-shot pass's memory on this rank, planned for an accelerator (every data-parallel rank does the
        same work)."""
        p = self.cfg.pruning
        param_dtype = next(ctx.model_parts[0].layers.parameters()).dtype
        plan = plan_pruning(p, ctx.model_args, ctx.parallel_dims, ctx.model_parts,
                            precision(self.cfg, ctx.parallel_dims, ctx.device_type, param_dtype))
        return PassPlan("the pruning pass",
                        f"one-shot pruning at the start ({p.method} {p.pattern}, {p.nsamples} x {p.seq_len} "
                        "calibration tokens), per device:", plan.lines(None), plan.peak,
                        "lower 'pruning.batch_size' or 'pruning.nsamples', or shard over more devices")

    def export(self, model_parts: list[nn.Module], folder: Path, step: int) -> None:
        report = sparsity_report(model_parts, self.cfg, self.dims, self.result, self.plan, self.measured)
        if not dist.is_initialized() or dist.get_rank() == 0:
            write_report(report, folder / f"sparsity-report-step-{step}.json")


# ------------------------------------------------------------------------------------------ plan and report


def log_plan(plan: PruningMemoryPlan, cfg: JobConfig, dims: ParallelDims, capacity_gib: float | None) -> None:
    p = cfg.pruning
    per_rank = p.nsamples // dims.dp_degree
    logger.info("\n".join([
        f"prune: memory plan per device ({p.method} {p.pattern}; {p.nsamples} calibration sequences x {p.seq_len} "
        f"tokens, {per_rank} per data-parallel rank in batches of {p.batch_size}; {dims.describe()}):",
        *plan.lines(capacity_gib)]))


def zero_counts(model_parts: list[nn.Module], cfg: JobConfig,
                dims: ParallelDims | None) -> tuple[dict[str, tuple[list[int], int]], list[str]]:
    """(canonical name -> (shape, zeros) of every pruned linear, counted on the weights (collective); the names of
    the linears left dense)."""
    targets, skipped = find_targets(model_parts[0], cfg.pruning.skip)
    modules = {t.name: t.module for ts in targets.values() for t in ts}
    local = torch.tensor([int((local_tensor(m.weight) == 0).sum()) for m in modules.values()], dtype=torch.float64)
    if modules and dist.is_initialized() and dist.get_world_size() > 1:
        local = local.to(local_tensor(next(iter(modules.values())).weight).device)
        dist.all_reduce(local)  # every element lives on one rank of each replica
    replicas = dims.dp_replicate if dims is not None else 1
    counts = {name: (list(m.weight.shape), int(z) // replicas)
              for (name, m), z in zip(modules.items(), local.tolist(), strict=True)}
    return counts, skipped


def sparsity_report(model_parts: list[nn.Module], cfg: JobConfig, dims: ParallelDims | None,
                    result: PruneResult | None, plan: PruningMemoryPlan | None,
                    measured: PeakReading | None) -> dict:
    """Per-layer and total sparsity of the pruned linears, read from the weights (a collective), with the
    one-shot pass's settings, timing and memory."""
    p = cfg.pruning
    counts, skipped = zero_counts(model_parts, cfg, dims)
    targets = {layer.name: layer.target_sparsity for layer in result.layers} if result is not None else {}
    weights = sum(shape[0] * shape[1] for shape, _ in counts.values())
    zeros = sum(z for _, z in counts.values())
    parameters = sum(param.numel() for part in model_parts for param in part.parameters())
    report = {
        "method": p.method, "pattern": p.pattern, "target_sparsity": p.sparsity,
        "calibration": {"dataset": p.dataset, "dataset_path": p.dataset_path, "nsamples": p.nsamples,
                        "seq_len": p.seq_len},
        "pruned_linears": {"count": len(counts), "weights": weights, "zeros": zeros,
                           "sparsity": zeros / max(weights, 1)},
        "model": {"parameters": parameters, "zeros": zeros, "sparsity": zeros / max(parameters, 1)},
        "skipped": skipped,
        "layer_ratios": p.layer_ratios,
        "layers": {name: {"shape": shape, "zeros": z, "sparsity": z / (shape[0] * shape[1]),
                          **({"target_sparsity": targets[name]} if name in targets else {})}
                   for name, (shape, z) in counts.items()},
    }
    if result is not None and result.outlier_ratios:
        layer_sparsity = {name.split(".")[1]: s for name, s in targets.items()}
        report["owl"] = {"lambda": p.owl_lambda, "m": p.owl_m, "layers": {
            layer: {"outlier_ratio_percent": ratio, "sparsity": layer_sparsity[layer]}
            for layer, ratio in result.outlier_ratios.items()}}
    if result is not None:
        report["seconds"] = round(result.seconds, 3)
        report["calibration"]["windows"] = result.windows
    if plan is not None and measured is not None:
        report["memory"] = {"estimated_peak_bytes": plan.peak, "measured_peak_bytes": measured.bytes,
                            "measured_by": measured.source}
    return report


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
