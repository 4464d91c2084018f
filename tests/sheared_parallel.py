"""Shared pieces of the Sheared tests, and the 2-rank worker (kept light: spawned processes import this module)."""

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from titan_lite.config.schema import JobConfig, Sheared
from titan_lite.dtensor import full_tensor
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.parallelize import parallelize_llama
from titan_lite.transforms.sheared.modules import ShearedBlock, convert_model
from titan_lite.transforms.sheared.targets import Targets, targets_from_config

SEQ, BATCH = 16, 2
SCENARIOS = (("tp2", 2, "full"), ("fsdp2", 1, "none"))  # (name, TP degree (else FSDP), AC mode)


def tiny_args():
    args = flavor_args("tiny")
    args.max_seq_len = SEQ
    return args


def all_targets(head_mode: str = "per_group_query") -> Targets:
    """Every type pruned on the tiny model (4 layers, 4 heads / 2 KV heads, ffn 192, dim 64)."""
    s = Sheared(layer_sparsity=0.25, hidden_sparsity=0.25, intermediate_sparsity=0.5, head_mode=head_mode)
    s.head_sparsity = 0.5
    return targets_from_config(s, tiny_args())


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    return tokens[:, :-1], tokens[:, 1:]


def parallel_report(tp: int, ac_mode: str) -> dict:
    """The sheared tiny model under TP (or FSDP when tp == 1) on 2 ranks: masks, loss, gate gradients."""
    cfg = JobConfig()
    cfg.parallelism.tensor_parallel_degree = tp
    cfg.activation_checkpoint.mode = ac_mode
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    dims.build_mesh("cpu")
    targets = all_targets()
    with torch.device("meta"):
        model = Llama(tiny_args())
        convert_model(model, targets, seed=0)
    parallelize_llama(model, dims, cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0, buffer_device=torch.device("cpu"))
    g = model.sheared_gates
    if tp > 1:
        mesh = dims.submesh("tp")
        g.tp_rank, g.tp_size, g.tp_group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
    g.draw_noise(3)
    inputs, labels = batch()
    with loss_parallel() if tp > 1 else torch.enable_grad():
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    block = [m for m in model.modules() if isinstance(m, ShearedBlock)][1]
    return {"loss": full_tensor(loss).item(),
            "hidden_z": block.hidden_z.tolist(), "head_z": block.attention.head_z.tolist(),
            "ffn_z": block.feed_forward.ffn_z.tolist(),
            "grads": {k: full_tensor(v.grad).flatten().tolist() for k, v in g.log_alphas().items()}}


def parallel_worker(rank: int, out_dir: str) -> None:
    for name, tp, ac_mode in SCENARIOS:
        Path(out_dir, f"{name}.rank{rank}.json").write_text(json.dumps(parallel_report(tp, ac_mode)))
    dist.barrier()
