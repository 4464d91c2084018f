"""The family flavors through run_train.sh under the layouts the Llama parity tests use: per-step losses equal one
process on the same global batch. tiny_qwen3 has q/k norms over head_dim 32 and tied embeddings, tiny_qwen2 q/k/v
biases. FSDP x TP (the q/k norms' replicated weights sharded again by FSDP) with AC and compile, and PP; the tests of
test_parallelize.py and test_context_parallel.py check TP, FSDP, replication, compile and CP gradients of both, and
of the Mistral window, tensor by tensor."""

from pathlib import Path

import pytest

from tests.integration.harness import assert_losses_close, one_window_dataset, run_train

SEQ_LEN = 64
GLOBAL_BATCH = 8
STEPS = 4
ATOL = 1e-5


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    return [*one_window_dataset(tmp_path_factory.mktemp("data"), GLOBAL_BATCH * (STEPS + 1), SEQ_LEN),
            "--training.steps", str(STEPS)]


@pytest.fixture(scope="module")
def references(data, tmp_path_factory) -> dict[str, dict[int, float]]:
    """One process per flavor, one micro-batch of 8 sequences per step."""
    out = {}
    for flavor in ("tiny_qwen3", "tiny_qwen2"):
        run = run_train([*data, "--model.flavor", flavor, "--training.local_batch_size", str(GLOBAL_BATCH)],
                        tmp_path_factory.mktemp(flavor))
        losses = run.tb_losses()
        assert run.returncode == 0 and sorted(losses) == list(range(1, STEPS + 1)), run.output[-3000:]
        assert all(5.0 < v < 9.0 for v in losses.values()), losses
        out[flavor] = losses
    return out


# (id, flavor, processes, local batch, overrides, the layout the start-up line must name)
CASES = [
    ("qwen3_fsdp2_tp2_selective_ac_compile", "tiny_qwen3", 4, 4,
     ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
      "--activation_checkpoint.selective_ac_option", "op", "--compile.enable", "--compile.backend", "aot_eager"],
     "dp_replicate 1 x dp_shard 2 x cp 1 x tp 2"),
    ("qwen2_pp2_1f1b_full_ac", "tiny_qwen2", 2, 8,
     ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2",
      "--activation_checkpoint.mode", "full"], "dp_shard 1 x cp 1 x tp 1 x pp 2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, flavor, ngpu, local_batch, overrides, layout", CASES, ids=[c[0] for c in CASES])
def test_family_layout_matches_one_process(name, flavor, ngpu, local_batch, overrides, layout, data, references,
                                           tmp_path):
    run = run_train([*data, "--model.flavor", flavor, "--training.local_batch_size", str(local_batch), *overrides],
                    tmp_path, ngpu=ngpu)
    assert layout in run.output, run.output[-3000:]
    assert_losses_close(run, references[flavor], ATOL)


# ------------------------------------------------------------------------------- LoRA on transformers' Qwen2.5

LORA = ["--model.converters", "lora", "--lora.rank", "4", "--lora.alpha", "8", "--lora.use_dora",
        "--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", str(STEPS),
        "--checkpoint.last_save_in_hf"]


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory) -> str:
    from tests.helpers import hf_family_folder

    return hf_family_folder(tmp_path_factory.mktemp("qwen2") / "hf", "qwen2", num_hidden_layers=4)


def lora_run(data: list[str], folder: str, dump: Path, ngpu: int = 1, *overrides: str):
    run = run_train([*data, "--model.flavor", "hf", "--model.hf_assets_path", folder, "--checkpoint.initial_load_in_hf",
                     "--checkpoint.initial_load_path", folder, *LORA, *overrides], dump, ngpu=ngpu)
    assert run.returncode == 0, run.output[-3000:]
    return run


@pytest.mark.slow
def test_qwen2_lora_under_tp_matches_one_process_and_its_adapter_is_its_merged_export_in_peft(data, qwen2_folder,
                                                                                            tmp_path):
    """DoRA adapters on the biased q/k/v (the biases sharded with them under TP 2): the losses of one process; the
    PEFT adapter on transformers' Qwen2 class gives the logits of the run's merged export."""
    import torch
    import transformers
    from peft import PeftModel

    single = lora_run(data, qwen2_folder, tmp_path / "one")
    run = lora_run(data, qwen2_folder, tmp_path / "tp2", 2, "--parallelism.tensor_parallel_degree", "2")
    assert "dp_replicate 1 x dp_shard 1 x cp 1 x tp 2" in run.output
    assert_losses_close(run, single.tb_losses(), ATOL)
    folder = tmp_path / "tp2" / "checkpoint"
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder / f"step-{STEPS}-hf").eval()
    assert type(merged).__name__ == "Qwen2ForCausalLM"
    base = transformers.AutoModelForCausalLM.from_pretrained(qwen2_folder).eval()
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, str(folder / f"step-{STEPS}-adapter")).eval()
        theirs, ours = adapted(tokens).logits, merged(tokens).logits
    assert (theirs - before).abs().max() > 1e-3  # the run trained the adapters
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
