"""docs/lora.md's CPU LoRA workflow as a newcomer runs it, shortened: in a shell without an activated venv, the
commands exactly as the guide spells them (`.venv/bin/python scripts/...`), then the base + adapter the run leaves
checked against PEFT (the oracle) and the merged model against the run's own merged export."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .harness import REPO


def fresh_shell_env() -> dict[str, str]:
    """A login shell's environment: no venv activated, no PYTHONPATH pointing at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "CONFIG_FILE", "NGPU")}
    env["PATH"] = ":".join(p for p in env.get("PATH", "/usr/bin:/bin").split(":") if ".venv" not in p)
    return {**env, "OMP_NUM_THREADS": "1"}


def sh(command: str, code: int = 0) -> str:
    """Run one documented command line with bash from the checkout; its output (it must exit with `code`)."""
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=fresh_shell_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == code, f"{command}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow  # one short training run and five script runs: about a minute on 2 busy cores
def test_cpu_lora_workflow_as_written(tmp_path):
    data, run = tmp_path / "train.jsonl", tmp_path / "run"
    sh(f".venv/bin/python scripts/make_synthetic_gsm8k.py --output {data} --num_problems 200 --seed 0")
    sh(f"CONFIG_FILE=train_configs/lora_synthetic_gsm8k_cpu.toml ./run_train.sh --training.dataset_path {data} "
       f"--training.steps 4 --lr_scheduler.warmup_steps 1 --validation.freq 4 --validation.local_batch_size 4 "
       f"--validation.answer_problems 4 --job.dump_folder {run}")
    ckpt = run / "checkpoint"
    base, adapter, merged = ckpt / "step-4-base-hf", ckpt / "step-4-adapter", tmp_path / "merged"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)

    out = sh(f".venv/bin/python scripts/merge_lora.py --base {base} --adapter {adapter} --output_dir {merged}")
    assert out.strip().splitlines()[-1].startswith("merged 42 adapters from")  # 6 layers x 7 projections
    ours, exported = tensors(merged), tensors(ckpt / "step-4-hf")
    assert ours.keys() == exported.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], exported[name], rtol=1e-5, atol=1e-6)

    twice = sh(f".venv/bin/python scripts/merge_lora.py --base {ckpt / 'step-4-hf'} --adapter {adapter} "
               f"--output_dir {tmp_path / 'twice'}", code=2)
    assert twice.strip().splitlines() == [f"error: --base '{ckpt / 'step-4-hf'}' already has --adapter '{adapter}' "
                                          f"merged into it (recorded in its config.json 'titan_lite_merged_adapters' "
                                          f"as '{adapter}'); merge into the original base instead"]

    prompt = "$'Question: What is 3 + 4?\\nAnswer: '"
    generated = sh(f".venv/bin/python scripts/generate.py --hf {base} --adapter {adapter} --prompt {prompt} "
                   "--max_new_tokens 4")
    assert generated.strip().splitlines()[-1].startswith("generated 1 completions, 4 new tokens in ")
    accuracy = [sh(f".venv/bin/python scripts/eval_answers.py {model} --config "
                   f"train_configs/lora_synthetic_gsm8k_cpu.toml --data {data} --problems 4 --max_new_tokens 4"
                   ).strip().splitlines()[-1].split(" (")[0]
                for model in (f"--hf {merged}", f"--hf {base} --adapter {adapter}")]
    assert accuracy[0] == accuracy[1] and accuracy[0].startswith("answer accuracy: ") and "/4 = " in accuracy[0]

    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    ids = torch.tensor([[1, 50, 300, 7, 900, 12]])
    with torch.no_grad():
        served = peft.PeftModel.from_pretrained(
            transformers.LlamaForCausalLM.from_pretrained(str(base), dtype=torch.float32), str(adapter)).eval()
        merged_model = transformers.LlamaForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
        torch.testing.assert_close(served(ids).logits, merged_model(ids).logits, rtol=1e-4, atol=1e-4)
