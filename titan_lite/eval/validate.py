"""The validator: mean token loss over a held-out split, on any layout, with the same batches every time."""

import itertools

import torch
from torch import nn

from titan_lite.config.schema import Validation
from titan_lite.data.dataloader import BatchLayout, build_dataloader, loader_options
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.runner import ModelRunner


class Validator:
    """Builds the validation loader once and counts its batches once (the first time)."""

    def __init__(self, cfg: Validation, tokenizer, parallel_dims: ParallelDims, runner: ModelRunner,
                 device: torch.device):
        self.cfg = cfg
        self.runner = runner
        self.device = device
        batch_mesh = parallel_dims.submesh("batch")
        layout = BatchLayout(cfg.local_batch_size, batch_mesh.get_local_rank(), batch_mesh.size())
        self.loader = build_dataloader(cfg.dataset, cfg.dataset_path, tokenizer, cfg.seq_len, layout,
                                       loader_options(cfg.dataloader), infinite=False, key_prefix="validation")
        self._batches: int | None = None

    def batch_count(self) -> int:
        """Global batches of a full pass (every rank sees the same number), or `validation.steps` of them."""
        if self._batches is None:
            limit = self.cfg.steps if self.cfg.steps != -1 else None
            self._batches = sum(1 for _ in itertools.islice(self._batches_from_start(), limit))
        return self._batches

    def _batches_from_start(self):
        self.loader.restart()
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
