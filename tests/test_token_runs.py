"""Training from token files, in the trainer: in order it trains exactly like the same run from the raw text (losses
step by step, and validation); shuffled, a run interrupted at step 2 (an epoch boundary) and resumed repeats the
uninterrupted run's losses exactly; FSDP on 2 processes from token files equals one process, and so does a resume of
the one-process checkpoint on 2 data-parallel ranks."""

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import spawn_gloo
from titan_lite.config import parse_args
from titan_lite.config.schema import Instruct
from titan_lite.data.dataloader import pretraining_source
from titan_lite.data.datasets import BUNDLED_DATASETS
from titan_lite.data.indexed import token_windows
from titan_lite.data.token_chunks import RecordEncoder
from titan_lite.data.token_writer import write_token_folder
from titan_lite.data.tokenizer import build_tokenizer
from titan_lite.errors import ConfigError
from titan_lite.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
WINDOW = 33  # seq_len 32 + 1
GLOBAL_BATCH = 8  # 17 windows of data: an epoch is 2 steps and a window


def write_data(folder: Path) -> tuple[Path, Path, Path, Path]:
    """(raw text, its token files, raw validation text, its token files): documents of a play, 17 windows in all."""
    tok = build_tokenizer(str(ROOT / "assets" / "tokenizer"))
    text = (BUNDLED_DATASETS["shakespeare"] / "othello.txt").read_text(encoding="utf-8")
    docs, tokens, at = [], 0, 0
    while tokens < (2 * GLOBAL_BATCH + 1) * WINDOW:
        docs.append(text[at:at + 300])
        tokens, at = tokens + len(tok.encode(docs[-1], bos=True, eos=True)), at + 300
    raw, held = folder / "raw.jsonl", folder / "held.jsonl"
    raw.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    held.write_text("".join(json.dumps({"text": text[at + i:at + i + 250]}) + "\n" for i in range(0, 2500, 250)))
    for path in (raw, held):
        write_token_folder(folder / f"{path.stem}_tokens", [str(path)], RecordEncoder("text", tok),
                           report=lambda line: None)
    return raw, folder / "raw_tokens", held, folder / "held_tokens"


def rows_token_folder(folder: Path, count: int = 40) -> Path:
    """Token files of GSM8K-shaped instruction rows (question, answer): they keep the rows' tokens, not their text."""
    rows = folder / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(count)))
    tok = build_tokenizer(str(ROOT / "assets" / "tokenizer"))
    write_token_folder(folder / "rows_tokens", [str(rows)], RecordEncoder("instruct", tok, Instruct()),
                       report=lambda line: None)
    return folder / "rows_tokens"


def run(folder: Path, data: Path, steps: int, *overrides: str) -> dict[int, float]:
    """Train to `steps` in `folder` (resuming from its checkpoint if any); the loss of each step."""
    cfg = parse_args(["--job.config_file", str(ROOT / "tests/integration/base.toml"), "--job.dump_folder", str(folder),
                      "--training.dataset", "text", "--training.dataset_path", str(data), "--training.seq_len", "32",
                      "--training.local_batch_size", "4", "--training.global_batch_size", str(GLOBAL_BATCH),
                      "--training.steps", str(steps), "--lr_scheduler.total_steps", str(STEPS),
                      "--checkpoint.interval", "2", "--metrics.enable_tensorboard=false", *overrides])
    trainer = Trainer(cfg)
    losses, train_step = {}, trainer.train_step

    def recording(microbatches, step):
        loss, grad_norm = train_step(microbatches, step)
        losses[step] = loss
        return loss, grad_norm

    trainer.train_step = recording
    trainer.train()
    if trainer.validator is not None:
        losses[0] = trainer.validator.validate(trainer.model_parts)
    return losses


def two_ranks(rank: int, tmp: Path, tokens: str) -> None:
    fresh = run(tmp / "fsdp", Path(tokens), STEPS)
    resumed = run(tmp / "resumed_on_2", Path(tokens), STEPS, "--checkpoint.enable")
    (tmp / f"rank{rank}.json").write_text(json.dumps({"fresh": fresh, "resumed": resumed}))
    dist.barrier()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("token_runs")
    raw, tokens, held, held_tokens = write_data(tmp)
    out = {}
    for name, data, validation in (("raw", raw, held), ("tokens", tokens, held_tokens)):
        out[name] = run(tmp / name, data, STEPS, "--training.shuffle", "false", "--validation.enable",
                        "--validation.dataset", "text", "--validation.dataset_path", str(validation),
                        "--validation.seq_len", "32", "--validation.freq", "100")
    out["shuffled"] = run(tmp / "shuffled", tokens, STEPS, "--checkpoint.enable")
    for name in ("resumed", "resumed_on_2"):
        (tmp / name / "checkpoint").mkdir(parents=True)
        shutil.copytree(tmp / "shuffled" / "checkpoint" / "step-2", tmp / name / "checkpoint" / "step-2")
    out["resumed"] = run(tmp / "resumed", tokens, STEPS, "--checkpoint.enable")
    if dist.is_initialized():
        dist.destroy_process_group()
    spawn_gloo(two_ranks, 2, tmp, str(tokens))
    out["two"] = json.loads((tmp / "rank0.json").read_text())
    return out


@pytest.mark.slow  # the module's 8 tiny runs (4 here, 2 on each of 2 processes): about 25 s on 2 busy cores
def test_in_order_token_files_train_exactly_like_the_raw_text(results):
    assert results["tokens"] == results["raw"]  # training losses of every step, and the validation loss (step 0)
    assert sorted(results["raw"]) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_a_shuffled_run_resumed_at_an_epoch_boundary_repeats_its_losses(results):
    shuffled = results["shuffled"]
    assert results["resumed"] == {3: shuffled[3], 4: shuffled[4]}
    assert shuffled != results["tokens"]  # shuffled: other windows than in order


@pytest.mark.slow
def test_fsdp_on_two_ranks_and_a_resume_on_another_degree_equal_one_process(results):
    shuffled, two = results["shuffled"], results["two"]
    assert {int(k): v for k, v in two["fresh"].items()} == pytest.approx(shuffled, abs=1e-5)
    assert {int(k): v for k, v in two["resumed"].items()} == pytest.approx({3: shuffled[3], 4: shuffled[4]}, abs=1e-5)


def test_resuming_a_token_folders_position_on_raw_text_says_what_saved_it(tmp_path):
    raw, tokens, _, _ = write_data(tmp_path)
    tok = build_tokenizer(str(ROOT / "assets" / "tokenizer"))
    _, state = next(token_windows("text", str(tokens), tok, 32, True, "training.dataset_path").samples())
    with pytest.raises(ConfigError, match=r"^the checkpoint's data position is one read by index \(token files, or "
                                          r"shuffled rows\), but this run reads dataset 'text' as raw text, in order: "
                                          r"point 'training.dataset_path' at the token folder"):
        next(pretraining_source("text", str(raw), tok, 32).samples(state))


def test_answer_accuracy_on_a_token_folder_of_rows_names_the_setting(tmp_path, monkeypatch, capsys):
    from tests.test_bad_inputs import Case, test_bad_input_is_one_line_exit_2

    folder = rows_token_folder(tmp_path)
    argv = ["--training.dataset", "instruct", "--training.dataset_path", str(folder), "--validation.enable",
            "--validation.dataset", "instruct", "--validation.local_batch_size", "1", "--validation.answer_problems",
            "2"]
    test_bad_input_is_one_line_exit_2(Case("answer problems from token files", "'validation.answer_problems' "
                                           "generates answers to the rows' problems, but 'training.dataset_path' = "
                                           f"'{folder}' holds token files", argv), tmp_path, monkeypatch, capsys)
