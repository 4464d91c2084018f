"""Runs ./run_train.sh the way a user does (base TOML + CLI overrides) and reads back the logged losses."""

import json
import os
import re
import resource
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.warm_python import COLD

REPO = Path(__file__).resolve().parents[2]
BASE_TOML = REPO / "tests" / "integration" / "base.toml"
STEP_LINE = re.compile(r"(?<!validate )step:\s*(\d+)/\d+\s+loss:\s*([0-9.]+)")  # training lines, not validation
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
# Every resume test runs the same 20-step LR schedule, so a shorter run's checkpoint continues it exactly.
SCHEDULE = ["--lr_scheduler.total_steps", "20", "--checkpoint.interval", "5"]
CKPT = ["--checkpoint.enable"]
# A LoRA run's PEFT adapter at the end (the end-of-run exports need checkpointing on and last_save_in_hf), without the
# merged full model.
ADAPTER_EXPORT = ["--checkpoint.enable", "--checkpoint.last_save_in_hf", "--lora.export_merged=false"]


@dataclass
class Run:
    returncode: int
    output: str
    dump_folder: Path
    printed_losses: dict[int, float] = field(default_factory=dict)

    def tb_losses(self, rank_folder: str = "") -> dict[int, float]:
        """Per-step global loss as written to TensorBoard (float32, exact enough for 1e-6 comparisons)."""
        return tb_losses(self.dump_folder / "tb" / rank_folder)


def tb_losses(folder: Path) -> dict[int, float]:
    """Per-step global loss in a TensorBoard folder; a restarted run's events replace the steps its killed attempt had
    logged after the checkpoint it resumed from."""
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("loss/global_avg")}


def steps(n: int) -> list[str]:
    """n steps of the shared 20-step schedule."""
    return ["--training.steps", str(n), *SCHEDULE]


def train_env(ngpu: int, config: Path, env: dict | None, cold: bool = False) -> dict:
    """run_train.sh's environment; `cold`: its python starts afresh even in the test session's warm environment
    (tests/warm_python.py), for a run whose process tree, signals or limits the test inspects."""
    full_env = {**os.environ, "CONFIG_FILE": str(config), "NGPU": str(ngpu), "OMP_NUM_THREADS": "1",
                "LOG_RANK": ",".join(str(r) for r in range(ngpu)), **(COLD if cold else {}), **(env or {})}
    full_env.pop("DRY_RUN", None) if not (env and "DRY_RUN" in env) else None
    return full_env


def file_size_limit(max_bytes: int):
    """A preexec_fn: writing a file past max_bytes fails with EFBIG (a disk that fills up, for one process tree)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))


def run_train(overrides: list[str], dump_folder: Path, ngpu: int = 1, config: Path = BASE_TOML,
              env: dict | None = None, timeout: int = 600, prefix: tuple[str, ...] = (),
              max_file_bytes: int | None = None) -> Run:
    """CONFIG_FILE=config NGPU=ngpu [prefix] ./run_train.sh --job.dump_folder dump_folder <overrides>."""
    full_env = train_env(ngpu, config, env, cold=bool(prefix) or max_file_bytes is not None)
    cmd = [*prefix, str(REPO / "run_train.sh"), "--job.dump_folder", str(dump_folder), *overrides]
    # A new session, so a timeout kills torchrun's workers too, not just the launcher.
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=file_size_limit(max_file_bytes) if max_file_bytes else None)
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


def start_train(overrides: list[str], dump_folder: Path, log: Path, ngpu: int = 1,
                env: dict | None = None) -> subprocess.Popen:
    """run_train.sh in the background (its own session), output to `log`; proc.pid is the launcher's."""
    cmd = [str(REPO / "run_train.sh"), "--job.dump_folder", str(dump_folder), *overrides]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=train_env(ngpu, BASE_TOML, env, cold=True), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_line(proc: subprocess.Popen, log: Path, pattern: str, timeout: float = 300) -> re.Match:
    """The first match of `pattern` in the log once it appears; fails if the run ends or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text())
        if m:
            return m
        assert proc.poll() is None, f"the run ended before {pattern!r}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} after {timeout}s:\n{log.read_text()[-3000:]}")


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    """The run's exit code; a run still going after `timeout` is killed with its whole session."""
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def trainer_pids(launcher_pid: int) -> list[int]:
    """The ranks (python -m titan_lite.train) started under a launcher, found through /proc."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                commands[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue  # a process that just exited
    def under(pid: int) -> bool:
        while pid in parents and pid != launcher_pid:
            pid = parents[pid]
        return pid == launcher_pid
    def is_rank(cmd: list[bytes]) -> bool:  # the first module run (torchrun's own command line names it later)
        return b"-m" in cmd and cmd[cmd.index(b"-m") + 1:cmd.index(b"-m") + 2] == [b"titan_lite.train"]
    return sorted(p for p, cmd in commands.items() if is_rank(cmd) and under(p))


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


def perturbed_hf_folder(folder: Path, flavor: str) -> Path:
    """A `flavor` model, initialised with seed 5 and perturbed (so no weight is at its init), written to `folder` as
    an HF folder with the bundled tokenizer: the start of runs that load initial weights."""
    import torch

    from titan_lite.checkpoint.hf import write_hf_folder
    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args

    args = flavor_args(flavor)
    model = Llama(args)
    model.init_weights(seed=5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    write_hf_folder(dict(model.named_parameters()), args, str(folder), torch.float32, str(REPO / "assets/tokenizer"))
    return folder


GPT_OSS_BIASES = (".bias", "experts.b1", "experts.b2", "experts.b3")


def wide_gpt_oss_folder(folder: Path) -> str:
    """tiny_gpt_oss as an HF GptOssForCausalLM folder with the bundled tokenizer: sinks ~ N(0, 1) and every bias ~
    N(0, 0.3) (a sink or o bias sharded or summed wrongly shows from the first step), every other weight perturbed."""
    import torch

    from titan_lite.checkpoint.hf import write_hf_folder
    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args

    args = flavor_args("tiny_gpt_oss")
    model = Llama(args)
    model.init_weights(seed=5)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = 1.0 if name.endswith("sinks") else 0.3 if name.endswith(GPT_OSS_BIASES) else 0.02
            param.add_(std * torch.randn(param.shape, generator=generator))
    write_hf_folder(dict(model.named_parameters()), args, str(folder), torch.float32, str(REPO / "assets/tokenizer"))
    return str(folder)
