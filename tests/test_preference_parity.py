"""Packed pairs without cross-talk, exactly: the trainer's first preference step (DPO against a frozen reference
folder, with RPO's NLL term) has the loss and gradients of the same pairs run one answer at a time (each answer's
prompt + answer alone through a plain model, the policy's and the reference's), within 1e-5 in float32, packed and
padded on one process, and under FSDP 2, TP 2 (vocab-sharded logits; packed and padded), PP 2 (the reference run as
a forward-only pipeline pass, or precomputed through one) and CP 2."""

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import spawn_gloo
from tests.integration.harness import perturbed_hf_folder
from titan_lite.checkpoint.hf import load_hf_weights
from titan_lite.config import parse_args
from titan_lite.dtensor import full_tensor
from titan_lite.loss import IGNORE_INDEX
from titan_lite.models.decoder import Llama
from titan_lite.models.parameters import canonical_name

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, GLOBAL_BATCH, BETA, SFT = 128, 4, 0.5, 0.3
ATOL = 1e-5
LAYOUTS = {  # name: (local batch, overrides), a global batch of 4 windows each
    "fsdp2": (2, []),
    "tp2": (4, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]),
    "tp2 padded": (4, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
                       "--preference.packing=false"]),  # one pair per sequence, padded to a multiple of the TP degree
    "pp2": (4, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (4, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"]),
    "pp2 precomputed": (4, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree",
                            "2", "--preference.precompute_reference"]),
}


def write_pairs(folder: Path) -> Path:
    """Short arithmetic prompts with a right and a wrong answer of different lengths (a few pairs per window)."""
    rng = random.Random(0)
    rows = []
    for _ in range(80):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        wrong = a + b + rng.choice([-10, -1, 1, 100])
        rows.append({"prompt": f"{a} + {b} =" + " ?" * rng.randint(0, 3), "chosen": f" {a + b}.",
                     "rejected": f" {wrong}" + "!" * rng.randint(0, 3)})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(dump: Path, data: Path, reference: Path, local_batch: int, *extra: str):
    return parse_args(["--job.config_file", str(ROOT / "tests/integration/base.toml"), "--job.dump_folder", str(dump),
                       "--training.dataset", "preference", "--training.dataset_path", str(data),
                       "--preference.reference", str(reference), "--preference.beta", str(BETA),
                       "--preference.sft_weight", str(SFT), "--training.seq_len", str(SEQ_LEN),
                       "--training.local_batch_size", str(local_batch), "--training.global_batch_size",
                       str(GLOBAL_BATCH), "--training.max_norm", "0", "--metrics.enable_tensorboard=false", *extra])


def trainer_first_step(cfg):
    """The trainer's first step: its global loss, every gradient this rank holds (whole tensors), the trainer and the
    rows of the step's pairs."""
    from titan_lite.train import Trainer

    trainer = Trainer(cfg)
    grads: dict[str, torch.Tensor] = {}

    def capture(*args, **kwargs):
        for part in trainer.model_parts:
            grads.update({canonical_name(n): full_tensor(p.grad) for n, p in part.named_parameters()})

    trainer.optimizer.step = capture
    trainer.objective.before_training()  # a precomputed reference's pass
    loss, _ = trainer.train_step(trainer.next_microbatches(iter(trainer.dataloader)), step=1)
    return loss, grads, trainer, first_step_pairs(trainer)


def first_step_pairs(trainer) -> list[int]:
    """The rows of the pairs in the first global batch (every rank's): those of its first windows (or pairs)."""
    windows = zip(trainer.dataloader.source.samples(), range(trainer.dataloader.layout.global_batch), strict=False)
    return sorted({int(d) // 2 for (sample, _), _ in windows for d in sample[2].tolist() if d >= 0})


def answers_alone(trainer, rows: list[int]) -> list[tuple[list[int], list[bool], list[int], list[bool]]]:
    """Each pair's prompt + chosen and prompt + rejected, encoded alone as the source encodes them."""
    source = trainer.dataloader.source
    encoded = dict(source.encoded())
    return [tuple(x for ids, mask in encoded[row].documents() for x in (ids, mask)) for row in rows]


def one_at_a_time(trainer, pairs, reference_folder: Path) -> tuple[float, dict[str, torch.Tensor]]:
    """DPO (beta) + SFT x the chosen tokens' mean NLL, with every answer run alone from position 0 through a plain
    policy (the trainer's initial weights) and a plain reference (the folder's)."""
    args = trainer.plan.model_args
    policy, reference = Llama(args), Llama(args)
    policy.init_weights(seed=0)
    reference.init_weights(seed=0)
    load_hf_weights([reference], str(reference_folder), args)

    def logps(model, ids, mask):
        tokens = torch.tensor(ids)
        labels = torch.where(torch.tensor(mask[1:]), tokens[1:], IGNORE_INDEX)
        per_token = -F.cross_entropy(model(tokens[None, :-1])[0], labels, reduction="none", ignore_index=IGNORE_INDEX)
        return per_token.sum(), int((labels != IGNORE_INDEX).sum())

    losses, nll, chosen_tokens = [], 0.0, 0
    for chosen, chosen_mask, rejected, rejected_mask in pairs:
        (pc, nc), (pr, _) = logps(policy, chosen, chosen_mask), logps(policy, rejected, rejected_mask)
        with torch.no_grad():
            (rc, _), (rr, _) = logps(reference, chosen, chosen_mask), logps(reference, rejected, rejected_mask)
        losses.append(-F.logsigmoid(BETA * ((pc - rc) - (pr - rr))))
        nll, chosen_tokens = nll - pc, chosen_tokens + nc
    loss = torch.stack(losses).mean() + SFT * nll / chosen_tokens
    loss.backward()
    return loss.item(), {n: p.grad for n, p in policy.named_parameters()}


def assert_matches(layout: str, loss: float, grads: dict[str, torch.Tensor], reference: tuple[float, dict]) -> None:
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= ATOL, f"{layout}: loss {loss} vs one answer at a time {ref_loss}"
    assert grads, f"{layout}: no gradients"
    worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
    assert worst <= ATOL, f"{layout}: gradients differ by up to {worst:.2e}"


def _layouts_worker(rank: int, dump: str, data: str, reference: str) -> None:
    for name, (local_batch, overrides) in LAYOUTS.items():
        cfg = config(Path(dump) / name, Path(data), Path(reference), local_batch, *overrides)
        loss, grads, trainer, rows = trainer_first_step(cfg)
        assert trainer.parallel_dims.world_size == 2 and trainer.plan.block_causal
        pairs = answers_alone(trainer, rows)
        assert_matches(name, loss, grads, one_at_a_time(trainer, pairs, Path(reference)))
        dist.barrier()


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow  # four trainers (and their references) on 2 processes
def test_packed_pairs_equal_one_answer_at_a_time_on_fsdp_tp_pp_cp(tmp_path):
    data, reference = write_pairs(tmp_path), perturbed_hf_folder(tmp_path / "reference", "tiny")
    spawn_gloo(_layouts_worker, 2, str(tmp_path / "runs"), str(data), str(reference))


def test_packed_and_padded_pairs_equal_one_answer_at_a_time_on_one_process(tmp_path):
    data, reference = write_pairs(tmp_path), perturbed_hf_folder(tmp_path / "reference", "tiny")
    loss, grads, trainer, rows = trainer_first_step(config(tmp_path / "packed", data, reference, GLOBAL_BATCH))
    assert len(rows) >= 2 * GLOBAL_BATCH  # several pairs share each window
    pairs = answers_alone(trainer, rows)
    assert_matches("packed", loss, grads, one_at_a_time(trainer, pairs, reference))
    # padded: one pair per sequence, the same pairs in one global batch
    padded = config(tmp_path / "padded", data, reference, len(rows), "--preference.packing=false",
                    "--training.global_batch_size", str(len(rows)))
    padded_loss, padded_grads, _, padded_rows = trainer_first_step(padded)
    assert padded_rows == rows
    assert_matches("padded", padded_loss, padded_grads, (loss, grads))
