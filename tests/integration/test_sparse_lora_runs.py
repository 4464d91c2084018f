"""Sparse recovery through run_train.sh: masked LoRA (lora.keep_sparsity on) on a 2:4-pruned HF folder, one process
against FSDP 2 and TP 2; the merged exports keep exactly the base's zeros, equal scripts/merge_lora.py's merge of the
PEFT adapter, and evaluate to the unmerged model's perplexity; scripts/check_sparsity.py reports it."""

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.integration.harness import REPO, one_window_dataset, perturbed_hf_folder, run_train
from tests.integration.test_pruning_runs import VALIDATION_TEXT, linear_weights
from tests.warm_python import python_command

SEQ_LEN, STEPS = 32, 3
LORA = ["--model.converters", "lora", "--lora.rank", "4", "--lora.alpha", "8", "--lora.use_rslora",
        "--lora.keep_sparsity", "on", "--training.local_batch_size", "4", "--training.steps", str(STEPS),
        "--checkpoint.enable", "--checkpoint.interval", str(STEPS), "--checkpoint.last_save_in_hf"]


def script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([*python_command(), str(REPO / "scripts" / name), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def pruned(tmp_path_factory) -> Path:
    """The tiny model (perturbed initial weights), 2:4-pruned by Wanda with scripts/prune.py."""
    root = tmp_path_factory.mktemp("sparse")
    perturbed_hf_folder(root / "dense", "tiny")
    done = script("prune.py", "--hf_assets_path", str(root / "dense"), "--output_dir", str(root / "pruned"),
                  "--method", "wanda", "--pattern", "2:4", "--nsamples", "8", "--seq_len", "64")
    assert done.returncode == 0, done.stderr[-2000:]
    return root / "pruned"


@pytest.fixture(scope="module")
def runs(pruned, tmp_path_factory) -> dict[str, Path]:
    data = one_window_dataset(tmp_path_factory.mktemp("data"), 4 * (STEPS + 1), SEQ_LEN)
    start = ["--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(pruned)]
    layouts = {"single": (1, []), "fsdp": (2, ["--training.local_batch_size", "2"]),  # the same global batch
               "tp": (2, ["--parallelism.tensor_parallel_degree", "2"])}
    out = {}
    for name, (ngpu, extra) in layouts.items():
        run = run_train([*data, *LORA, *start, *extra], tmp_path_factory.mktemp(name), ngpu=ngpu)
        assert run.returncode == 0, run.output[-3000:]
        assert "lora: keep_sparsity: each update is masked by its base's zeros (50.00%" in run.output
        out[name] = run.dump_folder / "checkpoint"
    return out


@pytest.mark.slow
def test_fsdp_and_tp_merges_keep_the_base_zeros_and_match_one_process(pruned, runs):
    base = linear_weights(pruned)
    single = linear_weights(runs["single"] / f"step-{STEPS}-hf")
    assert len(base) == 4 * 7
    for layout in ("fsdp", "tp"):
        merged = linear_weights(runs[layout] / f"step-{STEPS}-hf")
        for name, weight in base.items():
            assert torch.equal(merged[name] == 0, weight == 0), (layout, name)
            assert ((merged[name] == 0).view(weight.shape[0], -1, 4).sum(-1) == 2).all(), (layout, name)
            torch.testing.assert_close(merged[name], single[name], atol=2e-5, rtol=0)
    assert all(not torch.equal(single[n], base[n]) for n in base)  # the adapters trained


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def last_lines(capsys, count: int) -> list[str]:
    return capsys.readouterr().out.strip().splitlines()[-count:]


@pytest.mark.slow
def test_merge_script_check_script_and_unmerged_perplexity_agree(pruned, runs, tmp_path, capsys):
    """In-process (the scripts' main): the masked merge equals the run's export, check_sparsity.py confirms the
    base's zeros and 2:4, a dense merge fails the check, and the unmerged adapter's perplexity equals the merge's."""
    adapter = runs["single"] / f"step-{STEPS}-adapter"
    assert "PEFT applies this adapter DENSELY" in (adapter / "README.md").read_text()
    merge, check, evaluate = (load_script(n) for n in ("merge_lora", "check_sparsity", "eval_ppl"))
    merged, dense = tmp_path / "merged", tmp_path / "dense-merge"
    assert merge.main(["--base", str(pruned), "--adapter", str(adapter), "--output_dir", str(merged)]) == 0
    assert "the base's zeros kept" in last_line(capsys)
    exported = linear_weights(runs["single"] / f"step-{STEPS}-hf")
    for name, weight in linear_weights(merged).items():
        torch.testing.assert_close(weight, exported[name], atol=1e-6, rtol=0)
    assert check.main(["--hf", str(merged), "--pattern", "2:4", "--same_zeros_as", str(pruned)]) == 0
    assert last_lines(capsys, 2) == [
        f"result: 28 linears, 50.00% zeros; 2:4 holds in 28/28, 4:8 holds in 28/28; zeros identical to {pruned} in "
        "28/28",
        f"check passed: 2:4 holds in every linear (28/28); zeros identical to {pruned} in every linear (28/28)"]
    assert merge.main(["--base", str(pruned), "--adapter", str(adapter), "--output_dir", str(dense),
                       "--keep_sparsity", "off"]) == 0
    assert check.main(["--hf", str(dense), "--pattern", "2:4"]) == 1
    summary, verdict = last_lines(capsys, 2)
    assert "2:4 holds in 0/28" in summary and verdict == "check FAILED: 2:4 holds in 0/28 linears (--pattern 2:4)"
    ppl = {}
    for label, extra in (("merged", ["--hf_assets_path", str(merged)]),
                         ("unmerged", ["--hf_assets_path", str(pruned), "--adapter", str(adapter)])):
        assert evaluate.main([*extra, "--data", str(VALIDATION_TEXT), "--seq_len", "64", "--max_windows", "8"]) == 0
        ppl[label] = float(last_line(capsys).removeprefix("perplexity: "))
    assert ppl["merged"] == pytest.approx(ppl["unmerged"], rel=1e-5)
