"""Runs ./run_train.sh the way a user does (base TOML + CLI overrides) and reads back the logged losses."""

import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[2]
BASE_TOML = REPO / "tests" / "integration" / "base.toml"
STEP_LINE = re.compile(r"(?<!validate )step:\s*(\d+)\s+loss:\s*([0-9.]+)")  # training lines, not validation
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Run:
    returncode: int
    output: str
    dump_folder: Path
    printed_losses: dict[int, float] = field(default_factory=dict)

    def tb_losses(self, rank_folder: str = "") -> dict[int, float]:
        """Per-step global loss as written to TensorBoard (float32, exact enough for 1e-6 comparisons)."""
        folder = self.dump_folder / "tb" / rank_folder
        acc = EventAccumulator(str(folder))
        acc.Reload()
        return {e.step: e.value for e in acc.Scalars("loss/global_avg")}


def run_train(overrides: list[str], dump_folder: Path, ngpu: int = 1, config: Path = BASE_TOML,
              env: dict | None = None, timeout: int = 600) -> Run:
    """CONFIG_FILE=config NGPU=ngpu ./run_train.sh --job.dump_folder dump_folder <overrides>."""
    full_env = {**os.environ, "CONFIG_FILE": str(config), "NGPU": str(ngpu), "OMP_NUM_THREADS": "1",
                "LOG_RANK": ",".join(str(r) for r in range(ngpu)), **(env or {})}
    full_env.pop("DRY_RUN", None) if not (env and "DRY_RUN" in env) else None
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(dump_folder), *overrides]
    # A new session, so a timeout kills torchrun's workers too, not just the launcher.
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"run_train.sh {' '.join(overrides)} timed out after {timeout}s:\n"
                             f"{stdout[-2000:]}{stderr[-2000:]}") from None
    output = stdout + stderr
    losses = {int(s): float(v) for s, v in STEP_LINE.findall(ANSI_COLOUR.sub("", output))}
    return Run(proc.returncode, output, Path(dump_folder), losses)


def assert_losses_close(run: Run, reference: dict[int, float], atol: float, rank_folder: str = "") -> None:
    got = run.tb_losses(rank_folder)
    assert run.returncode == 0, run.output[-3000:]
    assert sorted(got) == sorted(reference), (got, reference)
    for step, value in reference.items():
        assert abs(got[step] - value) <= atol, f"step {step}: {got[step]} vs reference {value}\n{run.output[-2000:]}"


def one_window_documents(count: int, seq_len: int) -> list[str]:
    """Word runs of the bundled Lear that tokenize to exactly seq_len + 1 tokens with bos and eos."""
    from titan_lite.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(str(REPO / "assets" / "tokenizer"))
    words = (REPO / "titan_lite/data/corpus/shakespeare/train/lear.txt").read_text().split()
    docs, start = [], 0
    while len(docs) < count and start < len(words):
        end, length = start, 0
        while length < seq_len + 1 and end < len(words):
            end += 1
            length = len(tokenizer.encode(" ".join(words[start:end]), bos=True, eos=True))
        if length == seq_len + 1:
            docs.append(" ".join(words[start:end]))
            start = end
        else:
            start += 1
    assert len(docs) == count
    return docs


def one_window_dataset(folder: Path, count: int, seq_len: int) -> list[str]:
    """Overrides for a jsonl corpus in which every document is exactly one training sequence.

    The loader splits documents round-robin over data-parallel ranks, so on ordinary text a 2 x 4 run and a 1 x 8
    run read different sequences. Here every split (ranks, accumulation, workers) covers the same sequences in each
    global batch, which makes a single process an exact reference for any layout.
    """
    path = Path(folder) / "one_window_docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in one_window_documents(count, seq_len)))
    return ["--training.dataset", "jsonl", "--training.dataset_path", str(path), "--training.seq_len", str(seq_len)]
