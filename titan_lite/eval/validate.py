"""The validator: mean token loss over a held-out split, on any layout, with the same batches every time."""

import torch
import torch.distributed as dist
from torch import nn

from titan_lite.config.schema import Validation
from titan_lite.data.dataloader import build_dataloader
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.runner import ModelRunner


class Validator:
    """Builds the validation loader once and counts the batches every rank can run once (the first time)."""

    def __init__(self, cfg: Validation, tokenizer, parallel_dims: ParallelDims, runner: ModelRunner,
                 device: torch.device):
        self.cfg = cfg
        self.runner = runner
        self.device = device
        batch_mesh = parallel_dims.submesh("batch")
        self.loader = build_dataloader(cfg.dataset, cfg.dataset_path, tokenizer, cfg.seq_len, cfg.local_batch_size,
                                       dp_rank=batch_mesh.get_local_rank(), dp_world_size=batch_mesh.size(),
                                       infinite=False, num_workers=cfg.dataloader.num_workers,
                                       pin_memory=cfg.dataloader.pin_memory,
                                       persistent_workers=cfg.dataloader.persistent_workers,
                                       prefetch_factor=cfg.dataloader.prefetch_factor, key_prefix="validation")
        self.start_state = self.loader.state_dict()
        self._batches: int | None = None

    def batch_count(self) -> int:
        """Batches every rank can run: a full pass (or `validation.steps`) ends at the shortest rank's split, so no
        collective waits for a rank that ran out."""
        if self._batches is None:
            limit = self.cfg.steps if self.cfg.steps != -1 else None
            count = 0
            for _ in self._batches_from_start():
                count += 1
                if limit is not None and count == limit:
                    break
            count_t = torch.tensor(count, device=self.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(count_t, op=dist.ReduceOp.MIN)
            self._batches = int(count_t)
        return self._batches

    def _batches_from_start(self):
        self.loader.load_state_dict(self.start_state)
        return iter(self.loader)

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module]) -> float:
        """Mean token loss over the split (the same batches every time)."""
        count = self.batch_count()
        for m in model_parts:
            m.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = self._batches_from_start()
        for _ in range(count):
            inputs, labels = (t.to(self.device) for t in next(batches))
            batch_loss, batch_tokens = self.runner.loss_sum(inputs, labels)
            loss_sum += batch_loss
            tokens += batch_tokens
        for m in model_parts:
            m.train()
        loss_sum = self.runner.global_sum(loss_sum, loss_values=True)
        tokens = self.runner.global_sum(tokens, loss_values=False)
        return (loss_sum / tokens).item()
