"""The weights a rollout decodes with: LoRA's and DoRA's adapters folded into their base weights (the sampled
log-probabilities within 1e-5 of the training forward's in float32, every parameter bitwise restored after it, said
where it cannot be done); FSDP's weights gathered once per rollout or layer by layer (grpo.gather_once), the same
completions and losses either way, through run_train.sh on 2 processes; DRY_RUN's rollout pass counts them."""

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks.rollout_fold import trained_adapters
from tests.test_grpo_runs import base_folder, config, forward_logps, grpo_flags, write_prompts
from titan_lite.data.datasets import document_positions
from titan_lite.parallel.gather_once import gathers_once
from titan_lite.transforms.lora.fold import fold_blocker
from titan_lite.transforms.lora.module import LoRALinear


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def lora_flags(base: Path, *extra: str) -> list[str]:
    return ["--model.converters", "lora", "--checkpoint.initial_load_path", str(base),
            "--checkpoint.initial_load_in_hf", *extra]


@torch.no_grad()
def logits_of(model, batch) -> torch.Tensor:
    return model(batch.inputs, positions=document_positions(batch.documents), documents=batch.documents)


@pytest.mark.parametrize("variant", [[], ["--lora.use_dora"]], ids=["lora", "dora"])
def test_folded_adapters_sample_the_training_forwards_logps_and_the_base_comes_back_bit_for_bit(tmp_path, variant):
    from titan_lite.train import Trainer

    data, base = write_prompts(tmp_path), base_folder(tmp_path)
    trainer = Trainer(config(tmp_path / "run", data, *lora_flags(base, *variant)))
    model = trainer.model_parts[0]
    trained_adapters(model, scale=0.3)  # wide: a missing piece of the fold shows
    before = {n: t.clone() for n, t in model.state_dict().items()}
    batch = next(iter(trainer.dataloader))  # a rollout, decoded with the adapters folded
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    trained, sampled = forward_logps(model, batch)
    assert trained.numel() > 20 and (trained - sampled).abs().max() <= 1e-5
    modules = [m for m in model.modules() if isinstance(m, LoRALinear)]
    with trainer.transforms.folded_for_decoding(trainer.model_parts):
        assert all(m.folded for m in modules)
        folded = logits_of(model, batch)
    unfolded = logits_of(model, batch)
    with trainer.transforms.base_function(trainer.model_parts):
        base_logits = logits_of(model, batch)
    assert (folded - unfolded).abs().max() <= 1e-5 < (unfolded - base_logits).abs().max() / 100
    assert not any(m.folded for m in modules) and torch.equal(logits_of(model, batch), unfolded)


def test_where_folding_would_not_be_exact_the_adapter_is_kept_apart():
    module = LoRALinear(8, 8, 2, 1.0)
    assert fold_blocker(module, torch.float32) is None
    assert "compute dtype is bfloat16" in fold_blocker(module, torch.bfloat16)
    module.weight.data = module.weight.data.bfloat16()
    assert "base is stored in bfloat16" in fold_blocker(module, torch.float32)


def test_gather_once_follows_the_setting_and_under_auto_the_memory():
    cpu = torch.device("cpu")
    assert gathers_once("always", 10 * 2**30, 2**30, cpu) == (True, "grpo.gather_once = 'always'")
    assert gathers_once("never", 1, 2**30, cpu)[0] is False
    fits, why = gathers_once("auto", 2**30, 2 * 2**30, cpu)
    assert fits and why == ("auto: the unsharded weights beside the rollout's cache need 1.00 GiB, fit in 90% of this "
                            "rank's free 2.00 GiB")
    assert gathers_once("auto", 2**30, 2**30, cpu)[0] is False and gathers_once("auto", 1, None, cpu)[0] is False


def scalars(folder: Path) -> dict[str, list[float]]:
    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)]
            for tag in ("loss/global_avg", "grad_norm", "reward", "entropy", "completions/mean_length")}


RUNS = {  # DoRA on FSDP 2: per layer with the adapters apart, gathered once (auto) and folded, per layer and folded
    # (blocks that never reshard after forward: the rollout's gathered folded weights must not reach training);
    # on TP 2 folded on each rank's shards of the colwise and rowwise weights (TP equals FSDP: test_grpo_parity.py)
    "apart": ["--grpo.gather_once", "never", "--grpo.fold_adapters=false"],
    "gathered_folded": ["--grpo.gather_once", "auto"],
    "per_layer_folded": ["--grpo.gather_once", "never", "--parallelism.fsdp_reshard_after_forward", "never"],
    "tp2_folded": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
}


@pytest.mark.slow  # four 2-process runs
def test_fsdp_gather_once_and_folded_adapters_equal_per_layer_decoding(tmp_path):
    """The same completions (rewards, lengths), losses, KL and gradient norms over two steps whether FSDP's weights
    are gathered once per rollout or per layer, and whether the adapters are folded (on the unsharded weights, or on
    each rank's shards, FSDP's or TP's) or not; the frozen weights bitwise unchanged at the end of the folded runs."""
    from tests.integration.harness import ADAPTER_EXPORT, run_train

    data, base = write_prompts(tmp_path), base_folder(tmp_path)
    common = lora_flags(base, "--lora.use_dora", "--grpo.beta", "0.1", "--optimizer.lr", "0.05", "--training.steps",
                        "2", "--metrics.enable_tensorboard")
    results, logs = {}, {}
    for name, extra in RUNS.items():
        run = run_train(grpo_flags(data, *common, *extra, *(ADAPTER_EXPORT if "folded" in name else [])),
                        tmp_path / name, ngpu=2)
        assert run.returncode == 0, run.output[-3000:]
        results[name], logs[name] = scalars(tmp_path / name), run.output
    apart = results["apart"]
    assert apart["loss/global_avg"][1] != 0 and apart["reward"][0] > 0
    for name in ("gathered_folded", "per_layer_folded", "tp2_folded"):
        for tag, values in results[name].items():
            assert values == pytest.approx(apart[tag], abs=1e-5), (name, tag, values, apart[tag])
    assert re.search(r"rollout: gathers FSDP's weights once and keeps them gathered while it decodes \(auto: the "
                     r"unsharded weights beside the rollout's cache need [0-9.]+ GiB, fit in", logs["gathered_folded"])
    assert "rollout: all-gathers FSDP's weights layer by layer in every decode step (grpo.gather_once = 'never')" \
        in logs["apart"]
    for name in ("gathered_folded", "per_layer_folded", "tp2_folded"):
        assert logs[name].count("lora: the rollout decodes with 28 adapters folded into their base weights") == 2
        assert logs[name].count("frozen tensors on this rank are bitwise unchanged since loading") == 2
    assert "adapters folded" not in logs["apart"] and "rollout:" not in logs["tp2_folded"]  # TP decodes as it does


def test_dry_run_counts_the_weights_gathered_once_in_the_rollouts_pass():
    from benchmarks.figures import run_plan

    for mode, row in (("auto", "FSDP's weights gathered once for the rollout (grpo.gather_once = 'auto')"),
                      ("never", "FSDP gathers layer by layer in every decode step (grpo.gather_once = 'never')")):
        code, out, err = run_plan(2, "train_configs/grpo_synthetic_gsm8k_cpu.toml", [
            "--grpo.gather_once", mode, "--dry_run.device_memory_gib", "8"])
        rollout = out.split("each step's rollout (generation with the KV cache), per device:")[1]
        assert row in rollout and "verdict: fits" in rollout, out + err


def test_the_fold_benchmark_runs_tiny_and_its_case_reads_it(capsys):
    """benchmarks/rollout_fold.py on the tiny flavor, one round, in this process: folded and apart decode the same
    tokens (LoRA, and QLoRA's dense fold); the rollout_fold case reads its result line."""
    from benchmarks.cases import CASES
    from benchmarks.framework import RunOutput
    from benchmarks.rollout_fold import main

    lora, qlora = CASES["rollout_fold"]().variants
    for variant in (lora, qlora):
        assert main(["--base", variant.base, "--flavor", "tiny", "--rounds", "1", "--warmup", "0", "--batch", "4",
                     "--max_new", "6", "--prompt_len", "8"]) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        m = variant.metrics(RunOutput(line, 0, 1.0, 1.0, 2**30))
        assert m["same_tokens"] == 1 and m["logps_max_difference"] <= 1e-5 and m["folded_tokens_per_s"] > 0
