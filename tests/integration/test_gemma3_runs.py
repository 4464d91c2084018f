"""Gemma 3 (text) through run_train.sh: FSDP with activation checkpointing and compile, TP 2 (q/k norms replicated,
the four sandwich norms on sequence shards), CP 2 (each layer's window on global positions, each layer type's rope)
and PP 2 (the scaled embedding on the first stage, the per-layer-type rope on each) equal one process on the same
global batch within 1e-5 over several steps. Every run starts from one HF folder of tiny_gemma3 whose norm weights
are drawn far from their (1 + w) default, so a norm placed, sharded or skipped wrongly shows."""

from pathlib import Path

import pytest
import torch

from tests.integration.harness import REPO, assert_losses_close, one_window_dataset, run_train

SEQ_LEN = 64  # the sliding layers' window is 8: well inside every sequence and every CP shard
GLOBAL_BATCH = 8
STEPS = 4
ATOL = 1e-5


def wide_gemma3_folder(folder: Path) -> str:
    """tiny_gemma3 (untied, for pipeline stages) as an HF Gemma3ForCausalLM folder with the bundled tokenizer; every
    norm weight ~ N(0, 0.5) and every other weight perturbed."""
    from titan_lite.checkpoint.hf import write_hf_folder
    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args

    args = flavor_args("tiny_gemma3")
    model = Llama(args)
    model.init_weights(seed=5)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if name.endswith("norm.weight") else 0.02
            param.add_(scale * torch.randn(param.shape, generator=generator))
    write_hf_folder(dict(model.named_parameters()), args, str(folder), torch.float32, str(REPO / "assets/tokenizer"))
    return str(folder)


@pytest.fixture(scope="module")
def common(tmp_path_factory) -> list[str]:
    folder = wide_gemma3_folder(tmp_path_factory.mktemp("gemma3") / "hf")
    data = one_window_dataset(tmp_path_factory.mktemp("data"), GLOBAL_BATCH * (STEPS + 1), SEQ_LEN)
    return [*data, "--training.steps", str(STEPS), "--model.name", "gemma3", "--model.flavor", "tiny_gemma3",
            "--model.hf_assets_path", folder, "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path",
            folder]


@pytest.fixture(scope="module")
def reference(common, tmp_path_factory) -> dict[int, float]:
    run = run_train([*common, "--training.local_batch_size", str(GLOBAL_BATCH)], tmp_path_factory.mktemp("one"))
    losses = run.tb_losses()
    assert run.returncode == 0 and sorted(losses) == list(range(1, STEPS + 1)), run.output[-3000:]
    assert all(5.0 < v < 9.0 for v in losses.values()), losses
    return losses


# (id, local batch, overrides, the layout the start-up line must name): 2 processes each
CASES = [
    ("fsdp2_full_ac_compile", 4, ["--activation_checkpoint.mode", "full", "--compile.enable", "--compile.backend",
                                  "aot_eager"], "dp_replicate 1 x dp_shard 2 x cp 1 x tp 1"),
    ("tp2_selective_ac", 8, ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
                             "--activation_checkpoint.selective_ac_option", "op"],
     "dp_replicate 1 x dp_shard 1 x cp 1 x tp 2"),
    ("cp2", 8, ["--parallelism.context_parallel_degree", "2"], "dp_replicate 1 x dp_shard 1 x cp 2 x tp 1"),
    ("pp2_1f1b", 8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
                     "2"], "dp_shard 1 x cp 1 x tp 1 x pp 2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, local_batch, overrides, layout", CASES, ids=[c[0] for c in CASES])
def test_gemma3_layout_matches_one_process(name, local_batch, overrides, layout, common, reference, tmp_path):
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"} if "--compile.enable" in overrides else None
    run = run_train([*common, "--training.local_batch_size", str(local_batch), *overrides], tmp_path, ngpu=2, env=env)
    assert layout in run.output, run.output[-3000:]
    assert_losses_close(run, reference, ATOL)


# ------------------------------------------------------------------------------------------ LoRA and QLoRA

LORA = ["--model.converters", "lora", "--lora.rank", "4", "--lora.alpha", "8", "--training.local_batch_size", "4",
        "--checkpoint.enable", "--checkpoint.interval", str(STEPS), "--checkpoint.last_save_in_hf"]


@pytest.mark.slow
def test_lora_under_tp2_matches_one_process_and_its_peft_adapter_is_the_merged_export(common, tmp_path):
    """Adapters on all seven projections: TP 2 gives one process's losses; the PEFT adapter (Gemma 3's module names)
    on transformers' Gemma3ForCausalLM gives the logits of the run's merged export."""
    import transformers
    from peft import PeftModel

    one = run_train([*common, *LORA], tmp_path / "one")
    assert one.returncode == 0, one.output[-3000:]
    run = run_train([*common, *LORA, "--parallelism.tensor_parallel_degree", "2"], tmp_path / "tp2", ngpu=2)
    assert "dp_replicate 1 x dp_shard 1 x cp 1 x tp 2" in run.output
    assert_losses_close(run, one.tb_losses(), ATOL)
    folder = tmp_path / "tp2" / "checkpoint"
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder / f"step-{STEPS}-hf").eval()
    assert type(merged).__name__ == "Gemma3ForCausalLM"
    base_folder = common[common.index("--checkpoint.initial_load_path") + 1]
    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder).eval()
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, str(folder / f"step-{STEPS}-adapter")).eval()
        theirs, ours = adapted(tokens).logits, merged(tokens).logits
    assert (theirs - before).abs().max() > 1e-3  # the run trained the adapters
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_qlora_nf4_base_trains_close_to_the_full_precision_base(common, reference, tmp_path):
    """lora.base_dtype nf4: every block projection of the frozen base held in NF4; the first step's loss (adapters
    start at zero) is the NF4 model's, near the float32 model's."""
    run = run_train([*common, "--model.converters", "lora", "--lora.rank", "4", "--lora.base_dtype", "nf4",
                     "--training.local_batch_size", "8"], tmp_path)
    losses = run.tb_losses()
    assert run.returncode == 0 and sorted(losses) == list(range(1, STEPS + 1)), run.output[-3000:]
    assert "lora: 28 frozen block linears on this rank quantized to NF4 (QLoRA)" in run.output  # 4 layers x 7
    print(f"first-step loss: nf4 base {losses[1]:.6f}, float32 model {reference[1]:.6f}")
    assert 0 < abs(losses[1] - reference[1]) < 0.05, (losses, reference)


# ------------------------------------------------------------------------------------------ scripts/prune.py

PRUNE_CASES = [
    ("wanda_owl", ["--method", "wanda", "--layer_ratios", "owl"]),
    ("sparsegpt_2_4", ["--method", "sparsegpt", "--pattern", "2:4"]),
    ("depth", ["--method", "depth", "--layers_to_remove", "1"]),
    ("taylor_heads_and_geglu_channels", ["--method", "taylor_structured", "--head_ratio", "0.5", "--ffn_ratio",
                                         "0.25"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, method", PRUNE_CASES, ids=[c[0] for c in PRUNE_CASES])
def test_prune_script_writes_a_gemma3_folder_transformers_loads_with_our_logits(name, method, common, tmp_path):
    """Wanda with OWL's layer ratios, SparseGPT 2:4, depth (a block and its layer type removed) and Taylor
    (heads with their q/k norms kept whole, GeGLU channels): transformers' Gemma3ForCausalLM on the written folder
    gives titan_lite's logits on it; the masks and shapes are what was asked."""
    import json

    import transformers
    from safetensors.torch import load_file

    from tests.hf_oracle import load_titan
    from tests.integration.test_pruning_runs import run_script
    from titan_lite.models.hf.names import hf_name

    source, out = Path(common[common.index("--checkpoint.initial_load_path") + 1]), tmp_path / "pruned"
    run = run_script("prune.py", "--hf_assets_path", str(source), "--output_dir", str(out), "--nsamples", "8",
                     "--seq_len", "64", *method)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    if name == "depth":
        assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    elif name.startswith("taylor"):
        assert (config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"],
                config["head_dim"], config["query_pre_attn_scalar"]) == (2, 2, 144, 32, 24)
    else:  # the zeros written are the report's, per linear (OWL: a sparsity per layer averaging the target)
        report = json.loads((out / "sparsity_report.json").read_text())
        assert report["pruned_linears"]["count"] == 28
        for linear, entry in report["layers"].items():
            assert int((weights[hf_name(f"{linear}.weight")] == 0).sum()) == entry["zeros"], linear
        if name == "wanda_owl":
            ratios = [layer["sparsity"] for layer in report["owl"]["layers"].values()]
            assert abs(sum(ratios) / 4 - 0.5) < 1e-9 and max(ratios) - min(ratios) > 0.05, ratios
        else:
            assert report["pruned_linears"]["sparsity"] == 0.5
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        assert type(theirs).__name__ == "Gemma3ForCausalLM"
        torch.testing.assert_close(load_titan(out)(tokens), theirs(tokens).logits, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------ distillation


@pytest.mark.slow
def test_distillation_from_a_gemma3_teacher_folder(common, tmp_path):
    """The teacher assembled from the Gemma 3 folder the student also starts from: at step 1 both give the same
    logits (KL exactly 0: the teacher's per-layer rope, windows and scaled embedding are the student's); the logged
    parts make up the loss, alpha T^2 KL + (1 - alpha) CE, and training moves the student away from its teacher."""
    from tests.integration.test_distill_runs import scalars

    teacher = common[common.index("--checkpoint.initial_load_path") + 1]
    run = run_train([*common, "--training.local_batch_size", "8", "--distill.enable", "--distill.alpha", "0.5",
                     "--distill.temperature", "2", "--distill.teacher_path", teacher], tmp_path)
    assert run.returncode == 0, run.output[-3000:]
    losses, kl, ce = run.tb_losses(), scalars(run, "distill/kl"), scalars(run, "distill/ce")
    assert sorted(losses) == sorted(kl) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert abs(loss - (0.5 * 4 * kl[step] + 0.5 * ce[step])) < 1e-5, (step, loss, kl[step], ce[step])
    assert kl[1] == 0.0 and kl[STEPS] > 0, kl
