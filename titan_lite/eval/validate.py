"""The validator: mean token loss over a held-out split, on any layout, with the same batches every time; on
instruction data also token accuracy and answer accuracy by generation; on preference pairs the preference loss and
TRL's rewards and log-probabilities; on RL prompts the greedy answers' rewards and answer accuracy (no loss)."""

import itertools
import logging

import torch
from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError
from titan_lite.eval.answer_accuracy import answer_accuracy
from titan_lite.job.sources import PromptValidation, validation_data
from titan_lite.metrics.logger import Progress
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.runner import ModelRunner

logger = logging.getLogger(__name__)


class Validator:
    """Builds the validation loader once and counts its batches once (the first time). `objective`: the trainer's,
    for data validated on the objective's own terms (preference pairs)."""

    def __init__(self, cfg: JobConfig, tokenizer, parallel_dims: ParallelDims, runner: ModelRunner,
                 device: torch.device, objective=None):
        self.cfg = cfg.validation
        self.instruct = cfg.instruct
        self.tokenizer = tokenizer
        self.runner = runner
        self.objective = objective
        self.device = device
        # The last step that validates: sample completions are printed there and at the first evaluation.
        self.last_step = cfg.training.steps // self.cfg.freq * self.cfg.freq
        self.evaluations = 0
        self.prompts = None
        source = validation_data(cfg, tokenizer, parallel_dims, runner, device)
        if isinstance(source, PromptValidation):
            self.prompts = source
            return
        self.loader = source
        self.instruction_data = self.cfg.dataset == "instruct"
        self.preference_data = self.cfg.dataset == "preference"
        self._batches: int | None = None

    def batch_count(self) -> int:
        """Global batches of a full pass (every rank sees the same number), or `validation.steps` of them."""
        if self._batches is None:
            limit = self.cfg.steps if self.cfg.steps != -1 else None
            self._batches = sum(1 for _ in itertools.islice(self._batches_from_start(), limit))
            if self._batches == 0:  # a pass over nothing: no loss to report (and no metrics to divide)
                raise ConfigError(f"validation: the held-out {self.cfg.dataset} split fills no whole batch of "
                                  f"'validation.local_batch_size' = {self.cfg.local_batch_size} per data-parallel "
                                  "rank: lower it, or hold out more data")
        return self._batches

    def _batches_from_start(self):
        self.loader.restart()
        return iter(self.loader)

    def validate(self, model_parts: list[nn.Module]) -> float:
        """Mean token loss over the split (the same batches every time)."""
        return self.evaluate(model_parts, step=0, answers=False)["loss"]

    @torch.no_grad()
    def evaluate(self, model_parts: list[nn.Module], step: int, answers: bool = True) -> dict[str, float]:
        """loss; on instruction data token_accuracy (argmax = label on response tokens; not under pipeline
        parallel) and, with validation.answer_problems, answer_accuracy."""
        if self.prompts is not None:
            return self._prompt_metrics(step)
        for m in model_parts:
            m.eval()
        results = self._preference_metrics() if self.preference_data else self._token_metrics()
        if answers and self.instruction_data and self.cfg.answer_problems > 0:
            results["answer_accuracy"] = self._answer_accuracy(model_parts[0], step)
        for m in model_parts:
            m.train()
        self.evaluations += 1
        return results

    def _prompt_metrics(self, step: int) -> dict[str, float]:
        """RL prompts: the held-out prompts answered greedily (generation puts the model in eval mode itself)."""
        show = (self.evaluations == 0 or step == self.last_step) and self.cfg.sample_outputs > 0
        if show:
            which = "first" if self.evaluations == 0 else "last"
            logger.info(f"validation at step {step} ({which} evaluation): sample completions of held-out prompts:")
        self.evaluations += 1
        return self.prompts.evaluate(show_samples=show)

    def _token_metrics(self) -> dict[str, float]:
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, tokens, correct
        has_correct = True
        count = self.batch_count()  # before the pass below: counting runs the loader once itself
        batches = self._batches_from_start()
        progress = Progress("validation", count, "batches")
        for done in range(count):
            progress.update(done)
            loss, tokens, correct = self.runner.eval_sums(next(batches).to(self.device))
            has_correct = correct is not None
            sums += torch.stack([loss, tokens, correct if has_correct else torch.zeros_like(tokens)])
        loss_sum = self.runner.global_sum(sums[:1].clone(), loss_values=True)
        counts = self.runner.global_sum(sums[1:].clone(), loss_values=False)
        results = {"loss": (loss_sum[0] / counts[0]).item()}
        if self.instruction_data and has_correct:
            results["token_accuracy"] = (counts[1] / counts[0]).item()
        return results

    def _preference_metrics(self) -> dict[str, float]:
        """The preference loss and TRL's metrics (rewards/*, logps/*, logits/*) over the held-out pairs."""
        objective = self.objective
        count = self.batch_count()
        batches = self._batches_from_start()
        progress = Progress("validation", count, "batches")
        sums = None
        with objective.evaluating():
            for done in range(count):
                progress.update(done)
                batch_sums = self.runner.objective_sums(next(batches).to(self.device), objective)
                sums = batch_sums if sums is None else sums + batch_sums
        return objective.metrics(self.runner.global_sum(sums, loss_values=True))

    def _answer_accuracy(self, model: nn.Module, step: int) -> float:
        source = self.loader.source
        problems = [ex for _, ex in itertools.islice(source.examples(), self.cfg.answer_problems)]
        result = answer_accuracy(model, source.format, problems, self.cfg.max_new_tokens, self.device,
                                 self.cfg.local_batch_size)
        if (self.evaluations == 0 or step == self.last_step) and self.cfg.sample_outputs > 0:
            which = "first" if self.evaluations == 0 else "last"
            logger.info(f"answer accuracy at step {step} ({which} evaluation): {result.correct}/{result.total}; "
                        f"sample completions:")
            for line in result.sample_lines(self.cfg.sample_outputs):
                logger.info(f"  {line}")
        return result.accuracy
