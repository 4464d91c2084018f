"""Data mixtures in the trainer on 2 gloo processes: FSDP ranks compute identical weights, a resume (mid-window,
after an update) repeats the uninterrupted run's losses and weights exactly, and pipeline parallel (per-domain
losses from the last stage) matches."""

import json
import random
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import spawn_gloo
from titan_lite.config import parse_args
from titan_lite.data.datasets import BUNDLED_DATASETS
from titan_lite.train import Trainer

STEPS = 4


def write_domains(folder: Path) -> list[str]:
    """Two domains: a Shakespeare play, and numbers (far harder for a fresh model to predict)."""
    play = folder / "play.txt"
    play.write_text((BUNDLED_DATASETS["shakespeare"] / "julius_caesar.txt").read_text(encoding="utf-8"))
    rng = random.Random(0)
    numbers = folder / "numbers.jsonl"
    numbers.write_text("".join(json.dumps({"text": " ".join(str(rng.randrange(1000)) for _ in range(40))}) + "\n"
                               for _ in range(200)))
    return [str(play), str(numbers)]


def run(folder: Path, paths: list[str], steps: int, *overrides: str) -> tuple[dict, dict]:
    """Train to `steps` in `folder` (resuming from its checkpoint if any); per-step losses and weights."""
    cfg = parse_args([
        "--job.config_file", "tests/integration/base.toml", "--job.dump_folder", str(folder),
        "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(steps),
        "--lr_scheduler.total_steps", str(STEPS), "--metrics.enable_tensorboard=false",
        "--checkpoint.interval", "3",
        "--data_mixture.enable", "--data_mixture.dataset_paths", ",".join(paths), "--data_mixture.domains",
        "play,numbers", "--data_mixture.weights", "0.7,0.3", "--data_mixture.reference_losses", "3.0,2.0",
        "--data_mixture.update_freq", "2", "--data_mixture.eta", "0.2", *overrides])
    trainer = Trainer(cfg)
    losses, weights = {}, {}
    train_step = trainer.train_step

    def recording(microbatches, step):
        loss, grad_norm = train_step(microbatches, step)
        losses[step], weights[step] = loss, list(trainer.mixture.weights)
        return loss, grad_norm

    trainer.train_step = recording
    trainer.train()
    return losses, weights


def worker(rank: int, tmp: Path) -> None:
    paths = write_domains(tmp) if rank == 0 else None
    box = [paths]
    dist.broadcast_object_list(box)
    paths = box[0]
    full = run(tmp / "full", paths, STEPS)
    first = run(tmp / "resumed", paths, 3, "--checkpoint.enable")  # saves step 3: mid-window, after an update
    rest = run(tmp / "resumed", paths, STEPS, "--checkpoint.enable")
    pp = run(tmp / "pp", paths, STEPS, "--parallelism.pipeline_parallel_degree", "2",
             "--training.local_batch_size", "4")
    (tmp / f"rank{rank}.json").write_text(json.dumps({"full": full, "first": first, "rest": rest, "pp": pp}))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("mixture")
    spawn_gloo(worker, 2, tmp)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_data_parallel_ranks_compute_identical_weights(results):
    (losses, weights), (_, weights_1) = results[0]["full"], results[1]["full"]
    assert weights == weights_1
    assert weights["1"] == pytest.approx([0.7, 0.3])  # no update before step update_freq
    assert weights["2"] != weights["1"] and weights["3"] == weights["2"] and weights["4"] != weights["3"]
    assert len(losses) == STEPS


def test_weights_move_towards_the_domain_furthest_above_its_reference(results):
    # A fresh model's loss is far above both references; numbers' reference is lower, so its gap is larger.
    _, weights = results[0]["full"]
    assert weights["2"][1] > 0.3 and weights["4"][1] > weights["2"][1]


def test_resume_repeats_losses_and_weights_exactly(results):
    for r in range(2):
        losses, weights = results[r]["full"]
        (first_losses, first_weights), (rest_losses, rest_weights) = results[r]["first"], results[r]["rest"]
        assert {**first_losses, **rest_losses} == losses
        assert {**first_weights, **rest_weights} == weights
        assert sorted(rest_losses) == ["4"]


def test_pipeline_parallel_matches_data_parallel(results):
    losses, weights = results[0]["full"]
    for r in range(2):  # both stages: the weights come from the last stage's losses, summed over the stages
        pp_losses, pp_weights = results[r]["pp"]
        assert pp_losses == pytest.approx(losses, abs=1e-5) if r == 0 else True
        for step, w in weights.items():
            assert pp_weights[step] == pytest.approx(w, abs=1e-5)
