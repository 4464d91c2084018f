"""A toy transform exercising every hook of the transform contract (loaded with --experimental.custom_import).

It gates each block's ffn_norm output with a learnable per-channel scale (initialised to ones, so the converted
model starts as the base model), regularises the gates with an extra loss term, trains them with their own learning
rate, clamps them after each step, counts steps in a checkpointed state, logs their mean, folds them into
ffn_norm.weight for an HF export (exact: RMSNorm(x) * w * s), and writes a JSON file at the end. Each hook logs
'toy hook: <name>' the first time it runs, so the test can check the order.
"""

import json
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import SequenceParallel

from titan_lite.dtensor import full_tensor
from titan_lite.models.parameters import canonical_name
from titan_lite.transforms import Transform, TransformContext, register_transform

logger = logging.getLogger("titan_lite")
PENALTY = 1e-2


class ToyGate(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim))

    def param_init(self) -> dict:
        return {"scale": lambda tensor, generator: tensor.fill_(1.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def gate_ffn_norm_output(ffn_norm: nn.Module, _inputs, output: torch.Tensor) -> torch.Tensor:
    # The block is reached through the hooked module: pipeline stages are deep copies, and a closure over the
    # original block would call the original (meta) gate.
    return ffn_norm.toy_block.toy_gate(output)


class StepCounter:
    def __init__(self):
        self.steps = 0

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


def gates(model_parts: list[nn.Module]) -> list[nn.Parameter]:
    return [p for m in model_parts for n, p in m.named_parameters() if n.endswith("toy_gate.scale")]


@register_transform("toy_gate")
class ToyGateTransform(Transform):
    name = "toy_gate"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.counter = StepCounter()
        self.seen: set[str] = set()

    def log_first(self, hook: str, detail: str = "") -> None:
        if hook not in self.seen:
            self.seen.add(hook)
            logger.info(f"toy hook: {hook}{detail}")

    def convert(self, model: nn.Module) -> None:
        self.log_first("convert", f" on {next(model.parameters()).device.type}")
        for block in model.layers.values():
            block.toy_gate = ToyGate(model.args.dim)
            object.__setattr__(block.ffn_norm, "toy_block", block)  # a plain reference, not a child module
            block.ffn_norm.register_forward_hook(gate_ffn_norm_output)

    def check(self, model_args, parallel_dims) -> None:
        self.log_first("check")

    def tp_plan(self, plan: dict, scope: str) -> dict:
        self.log_first("tp_plan")
        if scope == "block":
            plan["toy_gate"] = SequenceParallel()  # a replicated scale on sequence-sharded activations, like a norm
        return plan

    def hf_names(self, names) -> None:
        self.log_first("hf_names")
        names.add_not_in_hf(r"\.toy_gate\.")

    @torch.no_grad()
    def after_load(self, ctx: TransformContext) -> None:
        loaded = [(canonical_name(n), p) for m in ctx.model_parts for n, p in m.named_parameters()
                  if "toy_gate" not in n]
        checksum = sum(full_tensor(p).double().sum().item() for _, p in loaded)
        self.log_first("after_load", f": {len(loaded)} tensors, checksum {checksum:.6f}, resuming {ctx.resuming}")

    def param_groups(self, model_parts: list[nn.Module]) -> list[dict]:
        self.log_first("param_groups")
        return [{"params": gates(model_parts), "lr": 0.05, "weight_decay": 0.0}]

    def before_step(self, model_parts: list[nn.Module], step: int) -> None:
        self.log_first("before_step", f": step {step}")

    def extra_loss(self, model_parts: list[nn.Module], step: int) -> torch.Tensor | None:
        self.log_first("extra_loss")
        return PENALTY * sum(((g - 1) ** 2).sum() for g in gates(model_parts))

    def after_optimizer_step(self, model_parts: list[nn.Module], step: int) -> None:
        self.log_first("after_optimizer_step")
        for g in gates(model_parts):
            g.clamp_(0.0, 2.0)
        self.counter.steps += 1

    def state(self) -> dict:
        self.log_first("state")
        return {"counter": self.counter}

    def metrics(self, model_parts: list[nn.Module]) -> dict[str, float]:
        self.log_first("metrics")
        values = torch.cat([full_tensor(g.detach()).flatten() for g in gates(model_parts)])
        return {"toy/gate_mean": values.mean().item(), "toy/steps": float(self.counter.steps)}

    def export_state_dict(self, state_dict: dict, model_args) -> tuple[dict, object]:
        self.log_first("export_state_dict")
        out = {}
        for name, tensor in state_dict.items():
            if name.endswith("toy_gate.scale"):
                continue
            if name.endswith("ffn_norm.weight"):
                tensor = tensor * state_dict[name.replace("ffn_norm.weight", "toy_gate.scale")]
            out[name] = tensor
        return out, model_args

    def export(self, model_parts: list[nn.Module], folder: Path, step: int) -> None:
        self.log_first("export")
        means = [full_tensor(g.detach()).mean().item() for g in gates(model_parts)]
        if not dist.is_initialized() or dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"toy-gates-step-{step}.json").write_text(json.dumps({"means": means}))
        assert all(math.isfinite(m) for m in means)
