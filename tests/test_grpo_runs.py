"""GRPO through the trainer on one process: the log-probabilities recorded while sampling equal the training
forward's on the same tokens (float32, 1e-5); num_iterations 2 trains twice on one rollout with those
log-probabilities as the old policy's; TRL's metrics and held-out validation are logged; a run stopped in the middle
of a rollout's passes resumes exactly, and one resumed with another seed or shuffle is refused in one line; beta > 0
with reference 'base' equals an explicit frozen copy of the base."""

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan_lite.config import parse_args
from titan_lite.data.datasets import document_positions
from titan_lite.loss import IGNORE_INDEX
from titan_lite.objective.logps import tempered_logps

ROOT = Path(__file__).resolve().parents[1]
TEMPERATURE = 0.8


def write_prompts(folder: Path, count: int = 64) -> Path:
    """GSM8K-shaped rows: a question and a '#### N' answer."""
    rng = random.Random(0)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"question": f"What is {a} + {b}?", "answer": f"#### {a + b}"})
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def grpo_args(dump: Path, data: Path, *extra: str) -> list[str]:
    return ["--job.config_file", str(ROOT / "tests/integration/base.toml"), "--job.dump_folder", str(dump),
            *grpo_flags(data, *extra)]


def grpo_flags(data: Path, *extra: str) -> list[str]:
    return ["--training.dataset", "prompts", "--training.dataset_path", str(data), "--grpo.prompt_field", "question",
            "--grpo.template", "Q: {prompt}\nA:", "--grpo.num_generations", "4", "--grpo.max_completion_length", "6",
            "--grpo.temperature", str(TEMPERATURE), "--grpo.reward_funcs", "tests.grpo_rewards:vowels,answer_match",
            "--training.local_batch_size", "4", "--training.global_batch_size", "8",
            "--metrics.enable_tensorboard=false", *extra]


def config(dump: Path, data: Path, *extra: str):
    return parse_args(grpo_args(dump, data, *extra))


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def steps_of(trainer, count: int) -> list[tuple]:
    """(loss, the step's microbatches, the rollout's metrics, the objective's) of `count` steps."""
    data, out = iter(trainer.dataloader), []
    for step in range(1, count + 1):
        microbatches = trainer.next_microbatches(data)
        loss, _ = trainer.train_step(microbatches, step=step)
        out.append((loss, microbatches, trainer.dataloader.metrics(), trainer.objective_metrics))
    return out


@torch.no_grad()
def forward_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(the training forward's log-probabilities of the labels at the temperature, the sampled ones), on labels."""
    logits = model(batch.inputs, positions=document_positions(batch.documents), documents=batch.documents)
    logps, _ = tempered_logps(logits, batch.labels, TEMPERATURE)
    valid = batch.labels != IGNORE_INDEX
    return logps[valid], batch.values[..., 0][valid]


def test_sampled_logps_are_the_training_forwards_and_iterations_reuse_the_rollout(tmp_path):
    from titan_lite.train import Trainer

    data = write_prompts(tmp_path)
    trainer = Trainer(config(tmp_path / "run", data, "--grpo.num_iterations", "2", "--validation.enable",
                             "--validation.dataset", "prompts", "--validation.steps", "1",
                             "--validation.local_batch_size", "3"))
    model = trainer.model_parts[0]
    first = next(iter(trainer.dataloader))
    trained, sampled = forward_logps(model, first)
    assert trained.numel() > 20 and (trained - sampled).abs().max() <= 1e-5
    trainer.dataloader.current = None  # the rollout above is not the run's
    (loss1, mb1, rollout1, obj1), (loss2, mb2, rollout2, obj2), (_, mb3, _, _) = steps_of(trainer, 3)
    # step 2 trains on step 1's rollout, its old log-probabilities those of sampling; step 3 samples anew
    assert all(x.equal(y) for x, y in zip(mb1, mb2, strict=True))
    assert not torch.equal(mb1[0].inputs, mb3[0].inputs) and rollout1 == rollout2
    assert obj1["clip_ratio/region_mean"] == 0 and loss2 != loss1
    assert set(rollout1) >= {"reward", "reward_std", "rewards/vowels/mean", "rewards/answer_match/mean",
                             "completions/mean_length", "completions/clipped_ratio", "frac_reward_zero_std",
                             "rollout/generation_s", "rollout/tokens_per_s"}
    assert 0 < rollout1["rewards/vowels/mean"] < 1 and set(obj1) == {"entropy", "clip_ratio/low_mean",
                                                                      "clip_ratio/high_mean", "clip_ratio/region_mean"}
    results = trainer.validator.evaluate(trainer.model_parts, step=3)
    assert set(results) == {"reward", "rewards/vowels/mean", "rewards/answer_match/mean", "answer_accuracy",
                            "completions/mean_length"}
    assert results["answer_accuracy"] == results["rewards/answer_match/mean"]


def test_gpt_oss_rollouts_record_the_training_forwards_logps_past_the_window(tmp_path):
    """gpt-oss (tiny_gpt_oss from a folder with wide sinks and biases, a 16-token window in its sliding layers):
    prompts and completions longer than the window, sampled through the KV cache (each layer's window and sinks),
    record the log-probabilities the packed training forward gives (1e-5); two steps train and move the loss."""
    from tests.integration.harness import wide_gpt_oss_folder
    from titan_lite.train import Trainer

    folder = wide_gpt_oss_folder(tmp_path / "gpt_oss")
    trainer = Trainer(config(tmp_path / "run", write_prompts(tmp_path), "--model.flavor", "tiny_gpt_oss",
                             "--model.hf_assets_path", folder, "--checkpoint.initial_load_in_hf",
                             "--checkpoint.initial_load_path", folder, "--grpo.max_completion_length", "24"))
    model, batch = trainer.model_parts[0], next(iter(trainer.dataloader))
    trained, sampled = forward_logps(model, batch)
    lengths = [int((row == doc).sum()) for row in batch.documents for doc in row.unique()]
    assert max(lengths) > 2 * 16 and trained.numel() > 40, lengths
    assert (trained - sampled).abs().max() <= 1e-5, (trained - sampled).abs().max()
    trainer.dataloader.current = None  # the rollout above is not the run's
    (loss1, _, rollout, _), (loss2, _, _, _) = steps_of(trainer, 2)
    assert torch.isfinite(torch.tensor([loss1, loss2])).all() and loss1 != loss2 and rollout["reward"] >= 0


def test_qwen3_5_rollouts_record_the_training_forwards_logps_through_the_recurrent_state(tmp_path):
    """Qwen3.5 (tiny_qwen3_5: three Gated DeltaNet layers, chunks of 16 steps, before a gated attention): completions
    decoded one token at a time from the cache's conv windows and recurrent states record the log-probabilities the
    packed training forward's chunked delta rule gives (1e-5) on documents longer than a chunk; two steps train and
    move the loss."""
    from titan_lite.train import Trainer

    trainer = Trainer(config(tmp_path / "run", write_prompts(tmp_path), "--model.flavor", "tiny_qwen3_5",
                             "--grpo.max_completion_length", "24"))
    model, batch = trainer.model_parts[0], next(iter(trainer.dataloader))
    trained, sampled = forward_logps(model, batch)
    lengths = [int((row == doc).sum()) for row in batch.documents for doc in row.unique()]
    print(f"longest document {max(lengths)} tokens, {trained.numel()} completion tokens, max |trained - sampled| "
          f"{(trained - sampled).abs().max().item():.2e}")
    assert max(lengths) > 16 and trained.numel() > 40, lengths
    assert (trained - sampled).abs().max() <= 1e-5, (trained - sampled).abs().max()
    trainer.dataloader.current = None  # the rollout above is not the run's
    (loss1, _, rollout, _), (loss2, _, _, _) = steps_of(trainer, 2)
    assert torch.isfinite(torch.tensor([loss1, loss2])).all() and loss1 != loss2 and rollout["reward"] >= 0


def test_sampled_logprobs_train_the_truncated_distribution_the_rollout_drew_from(tmp_path):
    """grpo.logprobs = "sampled" at top p 0.7, top k 20: the rollout's log-probabilities are the training forward's
    of the truncated, renormalised distribution (1e-5), above the full one's; the first step clips nothing."""
    from titan_lite.objective.grpo import loss_spec
    from titan_lite.train import Trainer

    cfg = config(tmp_path / "run", write_prompts(tmp_path), "--grpo.logprobs", "sampled", "--grpo.top_p", "0.7",
                 "--grpo.top_k", "20")
    trainer = Trainer(cfg)
    model, batch = trainer.model_parts[0], next(iter(trainer.dataloader))
    full, sampled = forward_logps(model, batch)
    with torch.no_grad():
        logits = model(batch.inputs, positions=document_positions(batch.documents), documents=batch.documents)
        truncated, _ = tempered_logps(logits, batch.labels, TEMPERATURE, keep=loss_spec(cfg).keep())
    truncated = truncated[batch.labels != IGNORE_INDEX]
    assert truncated.numel() > 20 and (truncated - sampled).abs().max() <= 1e-5
    assert (sampled >= full - 1e-5).all() and (sampled - full).max() > 1e-2
    trainer.dataloader.current = None  # the rollout above is not the run's
    (_, _, _, objective), = steps_of(trainer, 1)
    assert objective["clip_ratio/region_mean"] == 0


def test_a_run_stopped_between_a_rollouts_passes_resumes_exactly(tmp_path):
    """num_iterations 2: checkpoint step 3 holds the rollout step 4 trains on again (and the prompt stream's position
    and the sampling seed's count); the resumed run's step 4 equals the uninterrupted run's, metrics included."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.integration.harness import tb_losses
    from titan_lite.train import Trainer

    data = write_prompts(tmp_path)
    flags = ["--grpo.num_iterations", "2", "--grpo.beta", "0.05", "--grpo.reference", str(base_folder(tmp_path)),
             "--metrics.enable_tensorboard", "--checkpoint.enable", "--checkpoint.interval", "10",
             "--lr_scheduler.total_steps", "4"]
    Trainer(config(tmp_path / "whole", data, *flags, "--training.steps", "4")).train()
    Trainer(config(tmp_path / "resumed", data, *flags, "--training.steps", "3")).train()
    Trainer(config(tmp_path / "resumed", data, *flags, "--training.steps", "4")).train()
    whole, resumed = tb_losses(tmp_path / "whole" / "tb"), tb_losses(tmp_path / "resumed" / "tb")
    assert sorted(whole) == [1, 2, 3, 4] and resumed == pytest.approx(whole, abs=1e-6), (whole, resumed)
    scalars = {}
    for run in ("whole", "resumed"):
        events = EventAccumulator(str(tmp_path / run / "tb"))
        events.Reload()
        scalars[run] = {tag: [e.value for e in events.Scalars(tag)] for tag in ("reward", "kl", "entropy")}
    assert scalars["whole"] == pytest.approx(scalars["resumed"], abs=1e-6) and scalars["whole"]["kl"][3] > 0


def test_a_resume_with_another_seed_or_shuffle_is_refused_in_one_line(tmp_path):
    """The prompt stream's saved position names its order (the rows, training.shuffle, the seed): a resumed run with a
    changed debug.seed or training.shuffle would answer other prompts than the saved run, so it stops in one line."""
    from tests.integration.harness import run_train

    data, dump = write_prompts(tmp_path), tmp_path / "run"
    first = run_train(grpo_flags(data, "--training.steps", "2", "--checkpoint.enable"), dump)
    assert first.returncode == 0 and (dump / "checkpoint" / "step-2").is_dir(), first.output[-3000:]
    saved = "{'samples_in_epoch_0': 64, 'shuffle': True, 'seed': 0}"
    for change, now in ((["--debug.seed", "1"], "{'samples_in_epoch_0': 64, 'shuffle': True, 'seed': 1}"),
                        (["--training.shuffle=false"], "{'samples_in_epoch_0': 64, 'shuffle': False, 'seed': None}")):
        run = run_train(grpo_flags(data, "--training.steps", "3", "--checkpoint.enable", *change), dump)
        errors = [line for line in run.output.splitlines() if line.startswith("error: ")]
        assert run.returncode == 2 and "Traceback" not in run.output, run.output[-3000:]
        assert errors == [f"error: the checkpoint's data position of dataset 'prompts' is for another order ({saved}), "
                          f"this run's is {now}: the data, training.shuffle or the seed changed"], run.output[-3000:]


def base_folder(tmp_path: Path) -> Path:
    from tests.integration.harness import perturbed_hf_folder

    folder = tmp_path / "base"
    return folder if folder.exists() else perturbed_hf_folder(folder, "tiny")


def test_reference_base_equals_an_explicit_frozen_copy(tmp_path):
    """beta > 0 with LoRA: the policy's base (adapters off) as the reference trains exactly as the base's HF folder
    loaded as a frozen reference; the KL starts at 0 (the fresh adapters change nothing) and then grows."""
    from titan_lite.train import Trainer

    base, data = base_folder(tmp_path), write_prompts(tmp_path)
    lora = ["--model.converters", "lora", "--checkpoint.initial_load_path", str(base),
            "--checkpoint.initial_load_in_hf", "--grpo.beta", "0.1", "--optimizer.lr", "0.05"]
    own = [(loss, objective["kl"]) for loss, _, _, objective in steps_of(Trainer(config(tmp_path / "own", data,
                                                                                          *lora)), 3)]
    copy = [(loss, objective["kl"]) for loss, _, _, objective in
            steps_of(Trainer(config(tmp_path / "copy", data, *lora, "--grpo.reference", str(base))), 3)]
    assert own == pytest.approx(copy, abs=1e-6), (own, copy)
    assert own[0][1] == pytest.approx(0, abs=1e-7) and own[2][1] > 1e-6


def test_the_grpo_benchmark_runs_a_tiny_step_and_its_case_reads_it(capsys):
    """benchmarks/grpo.py on the tiny flavor, one step, in this process; the grpo_step case reads its result line."""
    from benchmarks.cases import CASES
    from benchmarks.framework import RunOutput
    from benchmarks.grpo import main

    assert main(["--flavor", "tiny", "--steps", "1", "--warmup", "0", "--max_new", "8", "--seq_len", "128",
                 "--most_words", "8"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    packed, padded = CASES["grpo_step"]().variants
    m = packed.metrics(RunOutput(line, 0, 1.0, 1.0, 2**30))
    assert m["generation_s"] > 0 and m["reference_s"] > 0 and m["policy_s"] > 0 and m["rollout_tokens_per_s"] > 0
    assert 0 < m["trained_tokens_per_s"] < m["train_tokens_per_s"] and 0 <= m["padding_pct"] < 100
    assert padded.command(type("S", (), {"steps": 1, "warmup": 0, "threads": 1})())[0][-5:] == \
        ["padded", "--steps", "1", "--warmup", "0"]


def test_dry_run_plans_the_cpu_example_on_two_ranks_with_a_held_reference(tmp_path):
    """The CPU example's config on 2 ranks (FSDP), with beta and a reference folder (not there yet: planned from its
    flavor): the rollout and training lines, the reference's weights in the step's estimate, the rollout's pass."""
    from benchmarks.figures import run_plan

    code, out, err = run_plan(2, "train_configs/grpo_synthetic_gsm8k_cpu.toml", [
        "--grpo.beta", "0.04", "--grpo.reference", str(tmp_path / "ref"), "--grpo.reference_flavor", "debugmodel",
        "--dry_run.device_memory_gib", "8"])
    assert code == 5, out + err  # the SFT model, the reference and the data are not there yet: the checklist
    assert ("grpo rollouts: 16 prompts x 8 completions = 128 per step, 64 sampled on each data-parallel rank, decoded "
            "by the decode engine in 64 slots, in lockstep with the other ranks unless FSDP's weights are gathered "
            "once and nothing else shards the forward: a cache of 65 columns each (prompts up to 45 tokens + 20 new) "
            "and a staging area of 8 prompt(s) for a group's prefill") in out
    assert ("grpo: loss dapo, clip [1 - 0.2, 1 + 0.2], beta 0.04 x k3 KL, temperature 1; reference: debugmodel "
            "from") in out
    assert "reference 3,081,856 local x bfloat16 (frozen)" in out  # half of the reference's weights, on each rank
    assert "reference: 2 all-gathered groups during its forward; grpo: per-token values and log-probability row " \
           "blocks" in out
    rollout = out.split("each step's rollout (generation with the KV cache), per device:")[1]
    assert "kv cache" in rollout and "staging" in rollout and "verdict: fits" in rollout
    assert "dry run OK: 2 ranks" in out


def wide_deepseek_v3_folder(folder: Path) -> str:
    """debugmodel_deepseek_v3 as an HF DeepseekV3ForCausalLM folder with the bundled tokenizer: correction biases ~
    N(0, 0.1) (they choose the experts the sampled and trained tokens go to), every weight perturbed."""
    from titan_lite.checkpoint.hf import write_hf_folder
    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args

    args = flavor_args("debugmodel_deepseek_v3")
    model = Llama(args)
    model.init_weights(seed=5)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            std = 0.1 if name.endswith("e_score_correction_bias") else 0.02
            tensor.add_(std * torch.randn(tensor.shape, generator=generator))
    write_hf_folder(model.state_dict(), args, str(folder), torch.float32, str(ROOT / "assets/tokenizer"))
    return str(folder)


def packed_lengths(batch) -> list[int]:
    return [int((row == doc).sum()) for row in batch.documents for doc in row.unique()]


def test_deepseek_v3_rollouts_record_the_training_forwards_logps_through_the_latent_cache(tmp_path):
    """DeepSeek-V3 (debugmodel_deepseek_v3 from a folder with wide correction biases): completions decoded through the
    KV cache that holds each layer's compressed latent and shared rope key (not the expanded K/V) record the
    log-probabilities the packed training forward gives (1e-5); two steps train and move the loss."""
    from titan_lite.train import Trainer

    folder = wide_deepseek_v3_folder(tmp_path / "deepseek_v3")
    trainer = Trainer(config(tmp_path / "run", write_prompts(tmp_path), "--model.flavor", "debugmodel_deepseek_v3",
                             "--model.hf_assets_path", folder, "--checkpoint.initial_load_in_hf",
                             "--checkpoint.initial_load_path", folder, "--grpo.max_completion_length", "12"))
    model, batch = trainer.model_parts[0], next(iter(trainer.dataloader))
    trained, sampled = forward_logps(model, batch)
    assert max(packed_lengths(batch)) > 20 and trained.numel() > 40, packed_lengths(batch)
    assert (trained - sampled).abs().max() <= 1e-5, (trained - sampled).abs().max()
    trainer.dataloader.current = None  # the rollout above is not the run's
    (loss1, _, rollout, _), (loss2, _, _, _) = steps_of(trainer, 2)
    assert torch.isfinite(torch.tensor([loss1, loss2])).all() and loss1 != loss2 and rollout["reward"] >= 0


def test_gemma3_rollouts_record_the_training_forwards_logps_past_the_window(tmp_path):
    """Gemma 3 (tiny_gemma3 from a folder with wide norms: window 8 in its sliding layers, a rope per layer type):
    prompts and completions longer than the window, decoded through each layer's window cache, record the
    log-probabilities the packed training forward gives (1e-5); two steps train and move the loss."""
    from tests.integration.test_gemma3_runs import wide_gemma3_folder
    from titan_lite.train import Trainer

    folder = wide_gemma3_folder(tmp_path / "gemma3")
    trainer = Trainer(config(tmp_path / "run", write_prompts(tmp_path), "--model.name", "gemma3", "--model.flavor",
                             "tiny_gemma3", "--model.hf_assets_path", folder, "--checkpoint.initial_load_in_hf",
                             "--checkpoint.initial_load_path", folder, "--grpo.max_completion_length", "16"))
    model, batch = trainer.model_parts[0], next(iter(trainer.dataloader))
    trained, sampled = forward_logps(model, batch)
    assert max(packed_lengths(batch)) > 3 * 8 and trained.numel() > 40, packed_lengths(batch)
    assert (trained - sampled).abs().max() <= 1e-5, (trained - sampled).abs().max()
    trainer.dataloader.current = None  # the rollout above is not the run's
    (loss1, _, rollout, _), (loss2, _, _, _) = steps_of(trainer, 2)
    assert torch.isfinite(torch.tensor([loss1, loss2])).all() and loss1 != loss2 and rollout["reward"] >= 0
