"""Instruction fine-tuning through run_train.sh as a user runs it: synthetic GSM8K-format problems, LoRA, FSDP over
2 processes, validation with token accuracy and answer accuracy (generation on every rank) in TensorBoard."""

import math
import re
import subprocess
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import REPO, run_train
from tests.warm_python import python_command


def test_lora_on_synthetic_gsm8k_logs_answer_accuracy(tmp_path: Path):
    data = tmp_path / "gsm8k.jsonl"
    made = subprocess.run([*python_command(), str(REPO / "scripts" / "make_synthetic_gsm8k.py"), "--output", str(data),
                           "--num_problems", "200"], capture_output=True, text=True, check=True)
    assert made.stdout.strip().splitlines()[-1].startswith("wrote 200 problems")
    run = run_train(["--training.dataset", "instruct", "--training.dataset_path", str(data),
                     "--training.epochs", "0.05", "--training.local_batch_size", "4",
                     "--model.converters", "lora", "--lora.rank", "4",
                     "--validation.enable", "--validation.dataset", "instruct", "--validation.freq", "2",
                     "--validation.seq_len", "64", "--validation.local_batch_size", "5", "--validation.steps", "1",
                     "--validation.answer_problems", "6", "--validation.max_new_tokens", "6",
                     "--validation.sample_outputs", "2"], tmp_path / "out", ngpu=2)
    assert run.returncode == 0, run.output[-3000:]
    # training.epochs: ceil(0.05 x the training split's ~190 problems / global batch 8) = 2 steps.
    samples, steps = map(int, re.search(r"training.epochs = 0.05: (\d+) samples per epoch / global batch 8 -> "
                                        r"(\d+) steps", run.output).groups())
    assert steps == math.ceil(0.05 * samples / 8) == 2 and 180 <= samples < 200
    # Every rank generates the same problems with the same gathered weights: the same verdicts.
    verdicts = re.findall(r"\[rank(\d)\]:.*answer accuracy at step 2 \(first evaluation\): (\d+/6)", run.output)
    assert sorted(rank for rank, _ in verdicts) == ["0", "1"] and len({v for _, v in verdicts}) == 1
    acc = EventAccumulator(str(run.dump_folder / "tb"))
    acc.Reload()
    (accuracy,) = acc.Scalars("validation/answer_accuracy")
    assert accuracy.step == 2 and accuracy.value == int(verdicts[0][1].split("/")[0]) / 6
    (token_accuracy,) = acc.Scalars("validation/token_accuracy")
    assert token_accuracy.step == 2 and 0.0 <= token_accuracy.value <= 1.0
    assert [e.step for e in acc.Scalars("validation/loss")] == [2]
