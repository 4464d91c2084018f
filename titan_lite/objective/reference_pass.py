"""precompute_reference: the reference's log-probabilities of every pair of the training and held-out splits, computed
in one pass before the first step through the runner on this layout, kept in the objective's checkpointed table,
and the reference freed."""

import gc
import logging
import math
import time
from functools import partial

import torch
import torch.distributed as dist

from titan_lite.data.batch import Batch
from titan_lite.data.dataloader import build_section_source, pad_collate
from titan_lite.data.instruct import split_words
from titan_lite.data.preference import PreferenceSource
from titan_lite.job.assembly import BuiltModel
from titan_lite.job.plan import JobPlan
from titan_lite.loss import IGNORE_INDEX
from titan_lite.metrics.logger import Progress
from titan_lite.objective.frozen import FrozenForward
from titan_lite.objective.preference import PreferenceObjective, pair_batch, reference_of
from titan_lite.parallel.parallel_dims import ParallelDims

logger = logging.getLogger("titan_lite")


class ReferencePass:
    """precompute_reference: the reference's log-probabilities of every pair of the training (and held-out) split,
    computed before the first step through the runner on this layout (each data-parallel rank its share of the
    windows, in batches of training.local_batch_size), then the reference is freed."""

    def __init__(self, plan: JobPlan, model: BuiltModel, objective: PreferenceObjective, device: torch.device,
                 seed: int):
        self.plan, self.model, self.objective, self.device, self.seed = plan, model, objective, device, seed

    def run(self) -> None:
        table, cfg = self.objective.table, self.plan.cfg
        if table.loaded:
            counts = ", ".join(f"{int((~t[:, 0].isnan()).sum()):,} {name}" for name, t in table.tables.items())
            logger.info(f"preference: the reference log-probabilities come from the checkpoint ({counts} pairs), "
                        "not recomputed")
            return
        started = time.perf_counter()
        frozen = self.reference()
        sections = ["training"] + (["validation"] if cfg.validation.enable else [])
        for section in sections:
            table.tables[section] = self.compute(section, frozen)
        del frozen
        gc.collect()
        counts = ", ".join(f"{int((~table.tables[s][:, 0].isnan()).sum()):,} {s}" for s in sections)
        logger.info(f"preference: reference log-probabilities of {counts} pairs computed in "
                    f"{time.perf_counter() - started:.1f}s and kept with the checkpoints; the reference is freed")

    def reference(self) -> FrozenForward:
        cfg = self.plan.cfg
        frozen = reference_of(cfg).load(self.plan, self.model, self.device, self.seed)
        if frozen.plan is not None:
            logger.info(f"preference: reference {frozen.plan.cfg.model.flavor} from '{cfg.preference.reference}' "
                        "loaded for the precomputation")
        return frozen

    def values(self, frozen: FrozenForward, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, [pairs, 2] reference log-probabilities) of one batch's pairs (under pipeline parallelism: on the
        last stage, none elsewhere)."""
        runner = self.model.runner
        if runner.pipeline is not None:
            target = torch.cat([batch.labels, batch.documents], dim=1)
            found = self.objective.pipeline_reference(runner.pipeline, batch.inputs, target,
                                                      runner.extra_inputs(batch.documents), frozen)
            return found.examples.to(self.device), found.values
        pairs = pair_batch(batch.labels, batch.documents, runner.shard)
        return pairs.examples, runner.forward_only(partial(self.objective.frozen_logps, batch=pairs, frozen=frozen),
                                                   batch)

    @torch.no_grad()
    def compute(self, section: str, frozen: FrozenForward) -> torch.Tensor:
        cfg, dims = self.plan.cfg, self.plan.parallel_dims
        windows = _read_windows(build_section_source(cfg, section, self.plan.tokenizer, infinite=False),
                                f"reference log-probabilities ({section})")
        rows = max(int(docs.max()) for _, _, docs in windows) // 2 + 1
        batch_mesh = dims.submesh("batch")
        mine = windows[batch_mesh.get_local_rank()::batch_mesh.size()]
        size = getattr(cfg, section).local_batch_size
        count = math.ceil(math.ceil(len(windows) / batch_mesh.size()) / size)  # batches on every rank alike
        table = torch.zeros(rows, 2, dtype=torch.float64, device=self.device)
        seen = torch.zeros(rows, dtype=torch.float64, device=self.device)
        pad_id = self.plan.tokenizer.pad_id if self.plan.tokenizer.pad_id >= 0 else self.plan.tokenizer.eos_id
        collate = pad_collate(pad_id, IGNORE_INDEX, dims.cp * 2)
        progress = Progress(f"reference log-probabilities ({section})", count, "batches", announce=True)
        for i in range(count):
            progress.update(i)
            chunk = mine[i * size:(i + 1) * size]
            chunk += [_padding_window(windows[0])] * (size - len(chunk))  # whole batches: pipelines need them
            batch, _ = collate([(w, {}) for w in chunk])
            examples, values = self.values(frozen, batch.to(self.device))
            if examples.numel():
                table[examples] = values.to(table.device)
                seen[examples] = 1
        _sum_over(table, seen, dims)
        table[seen == 0] = float("nan")
        return table.cpu()


def _read_windows(source: PreferenceSource, what: str, every_s: float = 10.0) -> list:
    """Every window of the section's pairs, tokenized and packed (for thousands of conversations rendered with a chat
    template, a minute or more): a line when it starts and one at most every `every_s` seconds."""
    logger.info(f"{what}: reading, tokenizing and packing the pairs of '{source.file.path}'"
                f"{split_words(source.split)}")
    windows, last = [], time.perf_counter()
    for sample, _ in source.samples():
        windows.append(sample)
        if time.perf_counter() - last >= every_s:
            last = time.perf_counter()
            logger.info(f"{what}: {len(windows):,} windows of pairs packed so far")
    return windows


def _padding_window(window: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A window of padding only: a rank with fewer windows runs it, so every rank runs the same forwards."""
    inputs, labels, documents = window
    return inputs, torch.full_like(labels, IGNORE_INDEX), torch.full_like(documents, -1)


def _sum_over(table: torch.Tensor, seen: torch.Tensor, dims: ParallelDims) -> None:
    """Each pair was computed by one data-parallel rank (by the last pipeline stage): the others hold zeros."""
    for name, enabled in (("batch", dims.dp_degree > 1), ("pp", dims.pp_enabled)):
        if enabled:
            group = dims.submesh(name).get_group()
            dist.all_reduce(table, group=group)
            dist.all_reduce(seen, group=group)
