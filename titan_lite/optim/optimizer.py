"""Builds Adam/AdamW over the trainable parameters of every model part, with the configured kernel."""

import torch
from torch import nn

from titan_lite.config.schema import Optimizer as OptimizerConfig


def _kernel_flags(implementation: str, device: torch.device) -> dict:
    if implementation == "fused" and device.type in ("cuda", "cpu", "xpu", "mps"):
        return {"fused": True}
    if implementation == "for-loop":
        return {"foreach": False}
    return {"foreach": True}


def build_optimizer(cfg: OptimizerConfig, model_parts: list[nn.Module], device: torch.device,
                    extra_groups: list[dict] | None = None) -> torch.optim.Optimizer:
    """One optimizer over all trainable parameters (frozen ones are skipped); transforms may add groups
    with their own lr/weight_decay, whose parameters are then left out of the main group."""
    extra_groups = extra_groups or []
    claimed = {id(p) for g in extra_groups for p in g["params"]}
    params = [p for m in model_parts for p in m.parameters() if p.requires_grad and id(p) not in claimed]
    groups = [{"params": params}] + extra_groups
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    return cls(groups, **kwargs, **_kernel_flags(cfg.implementation, device))
