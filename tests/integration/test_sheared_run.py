"""Sheared pruning through ./run_train.sh: an exact resume mid-pruning (gate logits, multipliers,
their optimizer state and the step that drives the target ramp and the mask noise all come back), the metrics in
TensorBoard, and the pruned model exported as an HF folder with the target shapes."""

import importlib.util
import json
import shutil

import pytest
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.harness import CKPT, REPO, run_train

SHEARED = ["--model.converters", "sheared", "--sheared.layer_sparsity", "0.25", "--sheared.head_sparsity", "0.5",
           "--sheared.hidden_sparsity", "0.25", "--sheared.intermediate_sparsity", "0.5",
           "--sheared.warmup_steps", "4", "--sheared.mask_lr", "0.5", "--checkpoint.last_save_in_hf",
           "--training.steps", "6", "--lr_scheduler.total_steps", "20", "--checkpoint.interval", "3",
           "--job.save_config_file", "config.toml"]
WATCHED = ["loss/global_avg", "sheared/sparsity_head", "sheared/lambda1_head", "sheared/lambda2_hidden",
           "sheared/sparsity_layer", "sheared/expected_params"]


def scalars(folder) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in WATCHED}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def safetensors_of(folder) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_resume_mid_pruning_is_exact_and_the_export_has_the_target_shapes(tmp_path, capsys):
    full = run_train(CKPT + SHEARED, tmp_path / "full")
    assert full.returncode == 0, full.output[-3000:]
    reference = scalars(tmp_path / "full" / "tb")
    assert sorted(reference["sheared/lambda1_head"]) == list(range(1, 7))
    assert reference["sheared/lambda1_head"][6] < 0 < reference["sheared/lambda2_hidden"][6]  # ascent
    assert reference["sheared/sparsity_head"][6] > reference["sheared/sparsity_head"][1]

    # A run that stopped after step 3 (its checkpoint copied from the full run) continues to step 6.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoint" / "step-3", resumed_dir / "checkpoint" / "step-3")
    resumed = run_train(CKPT + SHEARED, resumed_dir)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "resuming after step 3" in resumed.output
    after = scalars(resumed_dir / "tb")
    for tag in WATCHED:
        assert {s: reference[tag][s] for s in range(4, 7)} == after[tag], tag  # bitwise

    config = json.loads((tmp_path / "full" / "checkpoint" / "step-6-hf" / "config.json").read_text())
    shapes = {k: config[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                     "hidden_size", "intermediate_size", "head_dim")}
    assert shapes == dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, hidden_size=48,
                          intermediate_size=96, head_dim=16)
    assert "sheared: materialised" in full.output

    # scripts/materialize_pruned.py on the final checkpoint writes the same pruned model as the run's export.
    script = load_script("materialize_pruned")
    out = tmp_path / "pruned"
    assert script.main(["--checkpoint", str(tmp_path / "full" / "checkpoint" / "step-6"),
                        "--config", str(tmp_path / "full" / "config.toml"), "--output_dir", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("materialised ") and "(3 layers, 2 heads / 2 KV heads, dim 48, intermediate 96)" in last
    exported, written = safetensors_of(tmp_path / "full" / "checkpoint" / "step-6-hf"), safetensors_of(out)
    assert sorted(exported) == sorted(written) and all((exported[k] == written[k]).all() for k in exported)
    assert script.main(["--checkpoint", str(tmp_path / "nothing"), "--config", str(tmp_path / "full" / "config.toml"),
                        "--output_dir", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nothing'}: no .metadata file; expected a DCP " \
                                              "checkpoint step folder"
    with pytest.raises(SystemExit) as help_exit:
        script.main(["--help"])
    assert help_exit.value.code == 0
