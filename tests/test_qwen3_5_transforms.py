"""Qwen3.5's transforms against transformers' Qwen3_5ForCausalLM and peft: LoRA on every linear (the Gated DeltaNet
projections too) exported as a PEFT adapter that peft applies to transformers' class with the merged export's logits,
QLoRA's NF4 base, Wanda and SparseGPT on every linear, depth pruning by block (the schedule follows the kept blocks),
and the structured methods that cannot cut a DeltaNet refused in one line."""

import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.test_lora_peft import load_with_peft, pretend_trained, titan_lora  # noqa: E402
from tests.test_qwen3_5 import hf_model  # noqa: E402
from titan_lite.checkpoint.hf import gather_full_state_dict, write_hf_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(5))
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The small wide-weight Qwen3.5 of tests/test_qwen3_5.py (vocabulary of the bundled tokenizer), saved by
    transformers with that tokenizer beside it."""
    folder = tmp_path_factory.mktemp("qwen3_5_base")
    hf_model(vocab_size=2048).save_pretrained(folder)
    shutil.copy2(ROOT / "assets" / "tokenizer" / "tokenizer.model", folder)
    return folder


def hf_logits(folder_or_model) -> torch.Tensor:
    model = folder_or_model
    if isinstance(folder_or_model, Path):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder_or_model, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.mark.parametrize("case", ["lora", "dora"])
def test_lora_on_every_linear_loads_in_peft_with_the_merged_export_logits(case, base, tmp_path):
    extra = ["--lora.use_dora"] if case == "dora" else []
    plan, model = titan_lora(base, "--lora.rank", "4", "--lora.alpha", "8", *extra, flavor="hf", assets=base)
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_a")}
    assert adapted == {"wq", "wk", "wv", "wo", "w1", "w2", "w3", *DELTANET}
    assert not hasattr(model.layers["3"].attention, "in_proj_qkv")  # layer 3 attends
    pretend_trained(model)
    transform = next(iter(plan.transforms))
    transform.export([model], tmp_path, step=2)
    merged_sd, args = transform.export_state_dict(gather_full_state_dict([model], torch.float32), plan.model_args)
    write_hf_folder(merged_sd, args, str(tmp_path / "merged"), torch.float32, str(base))
    with torch.no_grad():
        ours = model(TOKENS)
    theirs_model = load_with_peft(base, tmp_path / "step-2-adapter")
    peft_targets = {n.rsplit(".", 1)[-1] for n, m in theirs_model.named_modules() if hasattr(m, "lora_A")}
    assert set(DELTANET) <= peft_targets
    theirs = hf_logits(theirs_model)
    assert (theirs - hf_logits(base)).abs().max() > 1e-2  # the adapter is applied
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    torch.testing.assert_close(hf_logits(tmp_path / "merged"), theirs, atol=1e-4, rtol=0)
