"""LoRA adapters against Hugging Face PEFT (the oracle): titan_lite's exports load with PeftModel.from_pretrained on the
original HF model with no missing keys and the same logits; PEFT's adapters load into titan_lite with the same
logits; scripts/merge_lora.py equals PEFT's merge_and_unload."""

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

import titan_lite.checkpoint.peft as peft_io  # noqa: E402
from titan_lite.checkpoint.hf import write_hf_folder  # noqa: E402
from titan_lite.checkpoint.peft import ADAPTER_WEIGHTS, PREFIX  # noqa: E402
from titan_lite.checkpoint.resume import plan_initial  # noqa: E402
from titan_lite.config import parse_args  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.job.assembly import assemble_model  # noqa: E402
from titan_lite.job.plan import plan_job  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.flavors import flavor_args  # noqa: E402
from titan_lite.transforms.lora.adapters import lora_settings_from_peft  # noqa: E402
from titan_lite.transforms.lora.transform import lora_modules  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENS = torch.randint(0, 2048, (2, 20), generator=torch.Generator().manual_seed(11))
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    """A tiny Llama saved as an HF folder, every weight (norms too) away from its init."""
    args = flavor_args("tiny")
    model = Llama(args)
    model.init_weights(seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    folder = tmp_path_factory.mktemp("base") / "hf"
    write_hf_folder(dict(model.named_parameters()), args, str(folder), torch.float32, str(ROOT / "assets/tokenizer"))
    return folder


def hf_model(folder: Path):
    """transformers' class of the folder's family (LlamaForCausalLM, Qwen2ForCausalLM, ...)."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model) -> torch.Tensor:
    return model(TOKENS).logits


def titan_lora(hf_base: Path, *overrides: str, flavor: str = "tiny", assets: Path = ROOT / "assets/tokenizer"):
    """The tiny model from the HF folder through the trainer's assembly, with LoRA and the end-of-run export of its
    adapter (checkpointing and last_save_in_hf on); (plan, model)."""
    cfg = parse_args(["--model.flavor", flavor, "--training.seq_len", "32", "--activation_checkpoint.mode", "none",
                      "--model.hf_assets_path", str(assets), "--checkpoint.initial_load_in_hf",
                      "--checkpoint.initial_load_path", str(hf_base), "--model.converters", "lora",
                      "--checkpoint.enable", "--checkpoint.last_save_in_hf", *overrides])
    plan = plan_job(cfg, 1)
    return plan, assemble_model(plan, torch.device("cpu"), load=plan_initial(plan.cfg)).parts[0].eval()


@torch.no_grad()
def pretend_trained(model) -> None:
    """Adapters (and train_modules) as after training: B non-zero, magnitudes moved, trained weights changed."""
    gen = torch.Generator().manual_seed(2)
    for _, module in lora_modules([model]):
        module.lora_a.add_(0.1 * torch.randn(module.lora_a.shape, generator=gen))
        module.lora_b.normal_(0, 0.05, generator=gen)
        if module.magnitude is not None:
            module.magnitude.mul_(1 + 0.1 * torch.rand(module.magnitude.shape, generator=gen))
    for name, param in model.named_parameters():
        if param.requires_grad and name.startswith("output"):
            param.add_(0.01 * torch.randn(param.shape, generator=gen))


def load_with_peft(base_folder: Path, adapter: Path):
    """PeftModel.from_pretrained, failing on PEFT's lenient 'missing adapter keys' warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(hf_model(base_folder), str(adapter)).eval()
    messages = [str(w.message).lower() for w in caught]
    problems = [m for m in messages if "missing" in m or "unexpected" in m]
    assert not problems, problems
    return model


CASES = {
    "default": ["--lora.rank", "4", "--lora.alpha", "8", "--lora.use_rslora", "--lora.rank_pattern", "down_proj=2",
                "--lora.alpha_pattern", "layers\\.1\\..*q_proj=3", "--lora.train_modules", "lm_head"],
    "dora": ["--lora.rank", "4", "--lora.alpha", "16", "--lora.use_dora"],
    "pissa": ["--lora.rank", "4", "--lora.alpha", "8", "--lora.use_rslora", "--lora.init", "pissa"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_exported_adapter_loads_in_peft_with_the_same_logits(case, hf_base, tmp_path):
    plan, model = titan_lora(hf_base, *CASES[case])
    pretend_trained(model)
    transform = next(iter(plan.transforms))
    transform.export([model], tmp_path, step=7)
    with torch.no_grad():
        ours = model(TOKENS)
    base = hf_logits(hf_model(hf_base))
    theirs = hf_logits(load_with_peft(hf_base, tmp_path / "step-7-adapter"))  # on the ORIGINAL base, also for PiSSA
    assert (theirs - base).abs().max() > 1e-2  # the adapter is applied
    assert torch.allclose(theirs, ours, atol=1e-4), (theirs - ours).abs().max()
    if case == "pissa":  # the residual base plus the rank-r adapter is the same model
        residual = hf_logits(load_with_peft(tmp_path / "step-7-pissa-residual-base", tmp_path / "step-7-pissa-adapter"))
        assert torch.allclose(residual, ours, atol=1e-4)


# The families: adapters on q/k/v with biases (Qwen2.5) and next to q/k norms (Qwen3, tied embeddings), on folders
# transformers saved; PEFT applies titan_lite's adapter to transformers' own class.
FAMILY_CASES = {
    ("qwen2", "all_linear"): ["--lora.rank", "4", "--lora.alpha", "8", "--lora.rank_pattern", "q_proj=2"],
    ("qwen2", "dora_attention"): ["--lora.rank", "4", "--lora.alpha", "16", "--lora.use_dora",
                                  "--lora.target_modules", "wq,wk,wv,wo"],
    ("qwen3", "all_linear"): ["--lora.rank", "4", "--lora.alpha", "8", "--lora.use_rslora"],
}


@pytest.fixture(scope="module")
def family_bases(tmp_path_factory) -> dict[str, Path]:
    from tests.helpers import hf_family_folder

    return {family: Path(hf_family_folder(tmp_path_factory.mktemp(family), family)) for family in ("qwen2", "qwen3")}


@pytest.mark.parametrize("family, case", list(FAMILY_CASES), ids=["-".join(c) for c in FAMILY_CASES])
def test_family_adapter_loads_in_peft_with_the_merged_export_logits(family, case, family_bases, tmp_path):
    """PEFT on transformers' Qwen2/Qwen3 class with titan_lite's adapter = titan_lite's adapted model = its merged
    export loaded by transformers."""
    from titan_lite.checkpoint.hf import gather_full_state_dict

    base_folder = family_bases[family]
    plan, model = titan_lora(base_folder, *FAMILY_CASES[(family, case)], flavor="hf", assets=base_folder)
    assert (plan.model_args.family, plan.model_args.qkv_bias) == (family, family == "qwen2")
    pretend_trained(model)
    transform = next(iter(plan.transforms))
    transform.export([model], tmp_path, step=3)
    merged_sd, args = transform.export_state_dict(gather_full_state_dict([model], torch.float32), plan.model_args)
    write_hf_folder(merged_sd, args, str(tmp_path / "merged"), torch.float32, str(base_folder))
    with torch.no_grad():
        ours = model(TOKENS)
    base = hf_logits(hf_model(base_folder))
    theirs = hf_logits(load_with_peft(base_folder, tmp_path / "step-3-adapter"))
    merged = hf_model(tmp_path / "merged")
    assert type(merged).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    assert (theirs - base).abs().max() > 1e-2  # the adapter is applied
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    torch.testing.assert_close(hf_logits(merged), theirs, atol=1e-4, rtol=0)


def test_family_qlora_quantizes_weights_not_biases_and_matches_its_merged_export(family_bases, tmp_path):
    """QLoRA on Qwen2.5's biased q/k/v: the weights in NF4, the biases kept in float32 and added; the merged export
    (the dequantized base plus the adapters) gives transformers' Qwen2 class the adapted model's logits."""
    from titan_lite.checkpoint.hf import gather_full_state_dict
    from titan_lite.transforms.nf4 import is_nf4

    base_folder = family_bases["qwen2"]
    plan, model = titan_lora(base_folder, "--lora.rank", "4", "--lora.alpha", "8", "--lora.base_dtype", "nf4",
                             flavor="hf", assets=base_folder)
    wq = model.layers["0"].attention.wq
    assert is_nf4(wq.weight) and not is_nf4(wq.bias) and wq.bias.dtype == torch.float32
    pretend_trained(model)
    merged_sd, args = next(iter(plan.transforms)).export_state_dict(gather_full_state_dict([model], torch.float32),
                                                                     plan.model_args)
    write_hf_folder(merged_sd, args, str(tmp_path / "merged"), torch.float32, str(base_folder))
    with torch.no_grad():
        ours = model(TOKENS)
    assert (ours - hf_logits(hf_model(base_folder))).abs().max() > 1e-2
    torch.testing.assert_close(hf_logits(hf_model(tmp_path / "merged")), ours, atol=1e-4, rtol=0)


def test_unpermuted_rotary_rows_would_be_caught(hf_base, tmp_path, monkeypatch):
    """The logit comparison above detects an export that forgets to permute q/k lora_B rows to HF's layout."""
    monkeypatch.setattr(peft_io, "_rows_to_hf", lambda module, tensor, args: tensor)
    plan, model = titan_lora(hf_base, *CASES["default"])
    pretend_trained(model)
    next(iter(plan.transforms)).export([model], tmp_path, step=1)
    with torch.no_grad():
        ours = model(TOKENS)
    assert (hf_logits(load_with_peft(hf_base, tmp_path / "step-1-adapter")) - ours).abs().max() > 1e-3


@pytest.fixture(scope="module")
def peft_adapter(hf_base, tmp_path_factory) -> tuple[Path, torch.Tensor, dict]:
    """An adapter saved by PEFT itself (rsLoRA, DoRA, a rank pattern, lm_head trained), with its logits."""
    config = peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, use_dora=True, target_modules=PROJECTIONS,
                             rank_pattern={"down_proj": 2}, modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(hf_model(hf_base), config)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "lora_magnitude" in name or "modules_to_save" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    model.eval()
    folder = tmp_path_factory.mktemp("peft") / "adapter"
    model.save_pretrained(str(folder))
    merged = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    return folder, hf_logits(model), merged


def test_peft_adapter_loads_into_titan_lite(peft_adapter, hf_base):
    folder, logits, _ = peft_adapter
    settings = lora_settings_from_peft(folder)
    overrides = [f"--lora.{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in settings.items()]
    _, model = titan_lora(hf_base, *overrides)
    with torch.no_grad():
        assert torch.allclose(model(TOKENS), logits, atol=1e-4)


def test_adapter_mismatching_the_section_is_refused_before_launch(peft_adapter, hf_base):
    folder, _, _ = peft_adapter
    with pytest.raises(ConfigError, match="'lora.use_dora' = false but the adapter"):
        titan_lora(hf_base, "--lora.rank", "4", "--lora.alpha", "8", "--lora.adapter_path", str(folder))


def test_wrong_key_prefix_is_refused(peft_adapter, hf_base, tmp_path):
    folder, _, _ = peft_adapter
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    save_file({k.removeprefix(PREFIX): v for k, v in load_file(str(folder / ADAPTER_WEIGHTS)).items()},
              str(bad / ADAPTER_WEIGHTS))
    with pytest.raises(ConfigError, match="does not start with 'base_model.model.'"):
        lora_settings_from_peft(bad)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_merge_script_equals_peft_merge_and_unload(peft_adapter, hf_base, tmp_path, capsys):
    folder, logits, peft_merged = peft_adapter
    out = tmp_path / "merged"
    argv = ["--base", str(hf_base), "--adapter", str(folder), "--output_dir", str(out)]
    assert load_script("merge_lora").main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("merged 28 adapters") and str(out) in last
    merged = hf_model(out)
    assert torch.allclose(hf_logits(merged), logits, atol=1e-4)
    for name, tensor in merged.state_dict().items():
        assert torch.allclose(tensor, peft_merged[name], atol=1e-5), name


def test_merge_script_errors_are_one_line(hf_base, tmp_path, capsys):
    code = load_script("merge_lora").main(["--base", str(hf_base), "--adapter", str(tmp_path), "--output_dir",
                                           str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "adapter_config.json" in err and "\n" not in err
