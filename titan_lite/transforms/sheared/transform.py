"""The 'sheared' transform: Sheared-LLaMA targeted structured pruning with hard-concrete gates and a Lagrangian."""

import logging
import math
from pathlib import Path

import torch
from torch import nn

from titan_lite.checkpoint.hf import export_hf
from titan_lite.config.schema import JobConfig
from titan_lite.dtensor import full_tensor, local_tensor
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.names import HFNames
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms.base import Transform, TransformContext, register_transform
from titan_lite.transforms.sheared import gates
from titan_lite.transforms.sheared.keep import GATE_PREFIX, materialize_pruned
from titan_lite.transforms.sheared.modules import ShearedGates, convert_model
from titan_lite.transforms.sheared.targets import KINDS, Targets, expected_params, targets_from_config

logger = logging.getLogger("titan_lite")


def gates_of(model_parts: list[nn.Module]) -> ShearedGates:
    return model_parts[0].sheared_gates


def ramp(step: int, warmup_steps: int) -> float:
    """The fraction of the target sparsity in force at `step` (linear over warmup_steps)."""
    return 1.0 if warmup_steps <= 0 else min(1.0, step / warmup_steps)


def expected_sparsity(log_alpha: torch.Tensor) -> torch.Tensor:
    """1 - E[kept] / units, per row (the model for layer/hidden gates, each layer for head/intermediate gates)."""
    return 1.0 - gates.prob_nonzero(log_alpha).mean(-1)


def lagrangian(log_alphas: dict[str, torch.Tensor], lambdas: torch.Tensor, targets: Targets,
               fraction: float) -> torch.Tensor:
    """Sum over the pruned types of mean over rows of lambda1 (s - t) + lambda2 (s - t)^2."""
    terms = []
    for kind, log_alpha in log_alphas.items():
        gap = expected_sparsity(log_alpha) - targets.target_sparsity(kind) * fraction
        lam1, lam2 = lambdas[KINDS.index(kind)]
        terms.append((lam1 * gap + lam2 * gap.square()).mean())
    return torch.stack(terms).sum()


def expected_param_count(log_alphas: dict[str, torch.Tensor], targets: Targets) -> float:
    """E[parameters] of the pruned model under the gates' keep probabilities (GQA-aware, see expected_params)."""
    a = targets.args
    p = {kind: gates.prob_nonzero(v.detach()) for kind, v in log_alphas.items()}
    layers = p["layer"].tolist() if "layer" in p else a.n_layers
    if "head" not in p:
        q, kv = [float(a.n_heads)] * a.n_layers, [float(a.kv_heads)] * a.n_layers
    elif targets.head_mode == "per_group_query":
        q, kv = (p["head"].sum(-1) * a.kv_heads).tolist(), [float(a.kv_heads)] * a.n_layers
    else:
        kv = p["head"].sum(-1).tolist()
        q = [k * targets.n_rep for k in kv]
    ffn = p["intermediate"].sum(-1).tolist() if "intermediate" in p else [float(a.ffn_dim)] * a.n_layers
    dim = p["hidden"].sum().item() if "hidden" in p else float(a.dim)
    return expected_params(a, layers, q, kv, ffn, dim)


@register_transform("sheared")
class ShearedTransform(Transform):
    """Hard-concrete gates on layers, heads (GQA-aware), intermediate channels and the hidden dim, trained with
    the model under a Lagrangian that ramps their expected sparsity to the [sheared] targets."""

    name = "sheared"

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        self.targets: Targets | None = None
        self.step = 0
        self.ctx: TransformContext | None = None

    def targets_for(self, args: LlamaArgs) -> Targets:
        if self.targets is None:
            self.targets = targets_from_config(self.cfg.sheared, args)
        return self.targets

    def check(self, model_args: LlamaArgs, parallel_dims: ParallelDims) -> None:
        others = [c for c in self.cfg.model.converters if c != self.name]
        if others:
            raise ConfigError(f"'model.converters' = {self.cfg.model.converters}: 'sheared' runs alone (prune the "
                              "model, then continue training or fine-tune the materialised result)")
        if model_args.n_experts:
            raise ConfigError(f"'sheared' masks dense widths, but this {model_args.family} model routes "
                              f"{len(model_args.moe_layers)} layers to experts; remove experts with scripts/prune.py "
                              "--method reap")
        for enabled, key, degree in ((parallel_dims.pp_enabled, "pipeline_parallel_degree", parallel_dims.pp),
                                     (parallel_dims.cp_enabled, "context_parallel_degree", parallel_dims.cp)):
            if enabled:
                raise ConfigError(f"the 'sheared' transform does not run with 'parallelism.{key}' = {degree}: the "
                                  "masks are computed at the root of one model part; use FSDP and/or tensor "
                                  "parallelism")
        targets = self.targets_for(model_args)
        if not targets.pruned:
            raise ConfigError("'sheared' has nothing to prune: set targets below the model's sizes (sheared.target_* "
                              "or sheared.*_sparsity)")

    def convert(self, model: nn.Module) -> None:
        seed = self.cfg.debug.seed if self.cfg.debug.seed is not None else 0
        convert_model(model, self.targets_for(model.args), seed)

    def hf_names(self, names: HFNames) -> None:
        names.add_not_in_hf("^" + GATE_PREFIX.replace(".", r"\."))  # gates start fresh on an HF checkpoint

    def after_load(self, ctx: TransformContext) -> None:
        self.ctx = ctx
        g = gates_of(ctx.model_parts)
        if ctx.parallel_dims.tp_enabled:
            tp_mesh = ctx.parallel_dims.submesh("tp")
            g.tp_rank, g.tp_size, g.tp_group = tp_mesh.get_local_rank(), tp_mesh.size(), tp_mesh.get_group()

    def param_groups(self, model_parts: list[nn.Module]) -> list[dict]:
        g, s = gates_of(model_parts), self.cfg.sheared
        return [{"params": list(g.log_alphas().values()), "lr": s.mask_lr, "weight_decay": 0.0},
                {"params": [g.lambdas], "lr": -s.lambda_lr, "weight_decay": 0.0}]  # negative lr: gradient ascent

    def before_step(self, model_parts: list[nn.Module], step: int) -> None:
        self.step = step
        gates_of(model_parts).draw_noise(step)

    def extra_loss(self, model_parts: list[nn.Module], step: int) -> torch.Tensor | None:
        g = gates_of(model_parts)
        log_alphas = {kind: full_tensor(v) for kind, v in g.log_alphas().items()}
        return lagrangian(log_alphas, full_tensor(g.lambdas), self.targets,
                          ramp(step, self.cfg.sheared.warmup_steps))

    def after_optimizer_step(self, model_parts: list[nn.Module], step: int) -> None:
        for log_alpha in gates_of(model_parts).log_alphas().values():
            local_tensor(log_alpha).clamp_(gates.LOG_ALPHA_MIN, gates.LOG_ALPHA_MAX)

    @torch.no_grad()
    def metrics(self, model_parts: list[nn.Module]) -> dict[str, float]:
        g = gates_of(model_parts)
        log_alphas = {kind: full_tensor(v.detach()) for kind, v in g.log_alphas().items()}
        lambdas = full_tensor(g.lambdas.detach())
        fraction = ramp(self.step, self.cfg.sheared.warmup_steps)
        out = {}
        for kind, log_alpha in log_alphas.items():
            i = KINDS.index(kind)
            out[f"sheared/sparsity_{kind}"] = expected_sparsity(log_alpha).mean().item()
            out[f"sheared/target_{kind}"] = self.targets.target_sparsity(kind) * fraction
            out[f"sheared/lambda1_{kind}"] = lambdas[i, 0].item()
            out[f"sheared/lambda2_{kind}"] = lambdas[i, 1].item()
        out["sheared/expected_params"] = expected_param_count(log_alphas, self.targets)
        out["sheared/target_params"] = float(self.targets.param_count())
        return out

    def export_state_dict(self, state_dict: dict[str, torch.Tensor],
                          model_args: LlamaArgs) -> tuple[dict[str, torch.Tensor], LlamaArgs]:
        """The pruned dense model: deterministic gates with the exact target counts, soft values folded in."""
        return materialize_pruned(state_dict, model_args, self.targets_for(model_args))

    def export(self, model_parts: list[nn.Module], folder: Path, step: int) -> None:
        """sheared.materialize_at_end: the pruned model as an HF folder (unless the run's own HF export, which goes
        through export_state_dict, already wrote it)."""
        c = self.cfg.checkpoint
        if not self.cfg.sheared.materialize_at_end or c.last_save_in_hf:
            return
        out = folder / f"step-{step}-pruned-hf"
        export_hf(model_parts, self.ctx.model_args, str(out), getattr(torch, c.export_dtype),
                  self.cfg.model.hf_assets_path, self.ctx.parallel_dims, convert=self.export_state_dict)
        logger.info(f"sheared: pruned model of step {step} written to {out} (continue training it with "
                    f"model.flavor = \"hf\", model.hf_assets_path = that folder, checkpoint.initial_load_in_hf = true)")

    def plan_lines(self, model_args: LlamaArgs) -> list[str]:
        """DRY_RUN's summary: the target architecture and the gate parameters the memory plan counts."""
        t = self.targets_for(model_args)
        n_gates = sum(math.prod(t.gate_shape(kind)) for kind in t.pruned)
        return [f"sheared: target {t.layers} layers, {t.heads} heads / {t.kv_heads} KV heads, dim {t.dim}, "
                f"intermediate {t.intermediate} = {t.param_count():,} parameters; {n_gates:,} gate logits + "
                f"{2 * len(KINDS)} multipliers (float32, counted in the parameters, gradients and optimizer state "
                "below)"]
