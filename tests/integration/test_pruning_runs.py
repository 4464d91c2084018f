"""What users run: a [pruning] training run (prune at the start, sparse fine-tuning, resume on another layout) and
the scripts (scripts/prune.py into an HF folder that transformers loads, scripts/eval_ppl.py, --estimate_only)."""

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import REPO, run_train
from tests.warm_python import python_command
from titan_lite.checkpoint.hf import weight_files, write_hf_folder
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args

PRUNE = ["--model.converters", "prune", "--pruning.pattern", "2:4", "--pruning.nsamples", "8",
         "--pruning.seq_len", "64"]
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")
VALIDATION_TEXT = REPO / "titan_lite/data/corpus/shakespeare/validation/midsummer_nights_dream.txt"


def linear_weights(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for path in sorted(set(weight_files(folder).values()))
            for name, tensor in load_file(str(path)).items() if LINEAR.fullmatch(name)}


def scalars(dump_folder: Path, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(dump_folder / "tb"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_masks_stay_exact_through_fine_tuning_and_a_resume_on_two_ranks(tmp_path):
    first = run_train([*PRUNE, "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "2",
                       "--checkpoint.last_save_model_only", "false", "--checkpoint.last_save_in_hf"], tmp_path)
    assert first.returncode == 0, first.output[-3000:]
    assert "prune: memory plan per device" in first.output and "peak memory measured" in first.output
    # The resume runs on 2 FSDP ranks: the masks (bool buffers) reshard from the 1-process checkpoint.
    second = run_train([*PRUNE, "--training.steps", "4", "--training.local_batch_size", "4", "--checkpoint.enable",
                        "--checkpoint.interval", "2", "--checkpoint.last_save_in_hf"], tmp_path, ngpu=2)
    assert second.returncode == 0, second.output[-3000:]
    assert "the masks and pruned weights come from the checkpoint" in second.output
    after_pruning = linear_weights(tmp_path / "checkpoint" / "step-2-hf")
    after_resume = linear_weights(tmp_path / "checkpoint" / "step-4-hf")
    assert len(after_pruning) == 4 * 7
    for name, w in after_pruning.items():
        zeros = w == 0
        assert (zeros.view(w.shape[0], -1, 4).sum(-1) == 2).all(), name
        assert torch.equal(after_resume[name] == 0, zeros), name  # the same positions, still exactly zero
        assert not torch.equal(after_resume[name], w), name  # while the kept weights trained
    assert set(scalars(tmp_path, "pruning/sparsity").values()) == {0.5}
    assert set(scalars(tmp_path, "pruning/mask_violations").values()) == {0.0}
    report = json.loads((tmp_path / "checkpoint" / "sparsity-report-step-4.json").read_text())
    assert report["pruned_linears"]["sparsity"] == 0.5 and report["pattern"] == "2:4"


def test_lora_recovery_keeps_the_pruned_base_and_an_adapter_only_resume_is_exact(tmp_path):
    """converters = ["prune", "lora"]: the frozen base stays 2:4-sparse; a resume from an adapter-only checkpoint
    prunes the reloaded base again (deterministically) and continues with the uninterrupted run's losses."""
    prune_lora = [*PRUNE, "--model.converters", "prune,lora", "--checkpoint.enable", "--checkpoint.interval", "2"]
    whole = run_train([*prune_lora, "--training.steps", "4"], tmp_path / "whole")
    assert whole.returncode == 0, whole.output[-3000:]
    assert "frozen tensors on this rank are bitwise unchanged since loading" in whole.output
    assert set(scalars(tmp_path / "whole", "pruning/mask_violations").values()) == {0.0}
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    second = run_train([*prune_lora, "--training.steps", "4"], resumed)
    assert second.returncode == 0, second.output[-3000:]
    assert "resuming after step 2" in second.output and "wanda 2:4 pruned" in second.output
    expected, got = scalars(tmp_path / "whole", "loss/global_avg"), scalars(resumed, "loss/global_avg")
    assert sorted(got) == [3, 4] and all(abs(got[s] - expected[s]) <= 1e-6 for s in got), (got, expected)


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([*python_command(), str(REPO / "scripts" / script), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    """A tiny model (its initial weights) as an HF folder with the bundled tokenizer."""
    folder = tmp_path_factory.mktemp("hf") / "tiny"
    args = flavor_args("tiny")
    model = Llama(args)
    model.init_weights(seed=0)
    write_hf_folder(dict(model.named_parameters()), args, str(folder), torch.float32, str(REPO / "assets/tokenizer"))
    return folder


def transformers_perplexity(folder: Path, seq_len: int) -> float:
    """exp(mean NLL) over the same windows, computed by transformers' LlamaForCausalLM."""
    from transformers import LlamaForCausalLM

    from titan_lite.data.tokenizer import build_tokenizer
    from titan_lite.eval.perplexity import read_text, text_windows

    windows = text_windows(build_tokenizer(str(folder)).encode(read_text(str(VALIDATION_TEXT)), bos=True, eos=False),
                           seq_len, max_windows=16)
    model = LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    return math.exp(sum(losses) / len(losses))


def test_prune_script_writes_a_folder_transformers_loads_with_the_same_perplexity(hf_model, tmp_path):
    out = tmp_path / "pruned"
    pruned = run_script("prune.py", "--hf_assets_path", str(hf_model), "--output_dir", str(out), "--method",
                        "sparsegpt", "--nsamples", "8", "--seq_len", "64")
    assert pruned.returncode == 0, pruned.stdout[-2000:] + pruned.stderr[-2000:]
    assert "memory plan per device" in pruned.stdout and "peak memory per device: measured" in pruned.stdout
    assert pruned.stdout.strip().splitlines()[-1].startswith(f"pruned model written to {out}: 50.00%")
    report = json.loads((out / "sparsity_report.json").read_text())
    assert report["method"] == "sparsegpt" and len(report["layers"]) == 28
    assert all(layer["sparsity"] == 0.5 for layer in report["layers"].values())
    evaluated = run_script("eval_ppl.py", "--hf_assets_path", str(out), "--data", str(VALIDATION_TEXT),
                           "--seq_len", "64", "--max_windows", "16")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    ours = float(evaluated.stdout.strip().splitlines()[-1].removeprefix("perplexity: "))
    assert ours == pytest.approx(transformers_perplexity(out, 64), rel=5e-3)


def test_estimate_only_plans_8b_on_the_meta_device():
    run = run_script("prune.py", "--flavor", "8B", "--hf_assets_path", "assets/tokenizer", "--estimate_only",
                     "--method", "sparsegpt", "--nsamples", "128", "--seq_len", "2048", "--device_memory_gib", "24")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "8,030,261,248 parameters" in run.stdout
    assert run.stdout.strip().splitlines()[-1].startswith("estimate: peak ")
    assert run.stdout.strip().splitlines()[-1].endswith("per device fits 24.00 GiB")
