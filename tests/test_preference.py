"""Preference tuning against TRL: on one fixed batch of pairs packed as documents, every loss, reward and
log-probability equals TRL's on the same weights (DPOTrainer's own loss for sigmoid, robust, hinge, IPO and RPO's NLL;
CPOTrainer's loss for cDPO and SimPO; ORPOTrainer's odds ratio for ORPO), and so do the gradients; the chunked
log-probabilities hold no float32 [tokens, vocab] copy; the reference 'base' equals an explicit frozen copy of the
base, and DPO with fresh adapters starts at ln 2; a precomputed reference resumes exactly; bad settings are one line."""

import logging
import math
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.test_distill import NewStorages, teacher_folder
from titan_lite.checkpoint.hf import write_hf_folder
from titan_lite.config import parse_args
from titan_lite.data.datasets import document_positions, packed_sample
from titan_lite.errors import ConfigError
from titan_lite.job.plan import check_before_launch
from titan_lite.loss import IGNORE_INDEX
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.objective import check_objective
from titan_lite.objective.frozen import FrozenForward, frozen_config
from titan_lite.objective.logps import token_logps
from titan_lite.objective.preference import (
    ContextParallelSum,
    PreferenceObjective,
    pair_batch,
    pair_units,
    reference_spec,
)
from titan_lite.objective.preference_loss import PreferenceLoss

ROOT = Path(__file__).resolve().parents[1]
BASE_TOML = ROOT / "tests" / "integration" / "base.toml"
ATOL = 1e-5
# (prompt length, chosen length, rejected length) of the fixed batch's pairs
SHAPES = [(4, 3, 5), (7, 2, 2), (3, 6, 1), (5, 4, 4), (9, 1, 3)]


def perturbed(seed: int) -> Llama:
    model = Llama(flavor_args("tiny"))
    model.init_weights(seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    return model


def fixed_pairs() -> list[tuple[list[int], list[int], list[int]]]:
    g = torch.Generator().manual_seed(7)
    return [tuple(torch.randint(3, 1700, (n,), generator=g).tolist() for n in shape) for shape in SHAPES]


def packed(pairs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One window holding every pair as two documents (as data/preference.py packs them), padded by 6 tokens."""
    tokens, documents, trained = [], [], []
    for row, (prompt, chosen, rejected) in enumerate(pairs):
        for answer, ids in enumerate((chosen, rejected)):
            tokens += prompt + ids
            documents += [2 * row + answer] * len(prompt + ids)
            trained += [False] * len(prompt) + [True] * len(ids)
    sample = packed_sample(tokens + [0] * 6, documents + [-1] * 6, trained + [False] * 6)
    return tuple(t[None] for t in sample)


def trl_batch(pairs) -> dict[str, torch.Tensor]:
    """TRL's padded batch: the chosen sequences, then the rejected ones, right-padded, with the completion mask."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    length = max(len(p) + len(a) for p, a in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (prompt, answer) in enumerate(rows):
        n = len(prompt) + len(answer)
        ids[i, :n] = torch.tensor(prompt + answer)
        attention[i, :n] = 1
        completion[i, len(prompt):n] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Our policy and reference (the tiny flavor, perturbed two ways) and the same weights in transformers."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    from tests.test_chat_workflow import chat_script

    folder = tmp_path_factory.mktemp("trl")
    tokenizer = chat_script().chat_tokenizer_folder(folder / "tokenizer")
    ours, hf = {}, {}
    for name, seed in (("policy", 3), ("reference", 11)):
        model = perturbed(seed)
        write_hf_folder(dict(model.named_parameters()), model.args, str(folder / name), torch.float32, str(tokenizer))
        ours[name] = model
        hf[name] = transformers.LlamaForCausalLM.from_pretrained(str(folder / name), dtype=torch.float32)
    return ours, hf, transformers.AutoTokenizer.from_pretrained(str(tokenizer)), folder


@pytest.fixture(scope="module")
def dpo_trainer(models):
    """TRL's DPOTrainer on the transformers policy and reference (built once; each case sets its loss)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    _, hf, tokenizer, folder = models
    args = DPOConfig(output_dir=str(folder / "trl"), report_to=[], use_cpu=True, bf16=False,
                     dataset_num_proc=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(model=hf["policy"], ref_model=hf["reference"], args=args, processing_class=tokenizer,
                             train_dataset=Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c"}]))
    trainer.model.train()
    return trainer


def ours(models, spec: PreferenceLoss):
    """Our loss (the trainer's normalisation: the pair losses' sum over the pairs, plus the NLL term), metrics and
    gradients of the output and embedding weights on the packed batch."""
    model = models[0]
    inputs, labels, documents = packed(fixed_pairs())
    policy, reference = model["policy"], model["reference"]
    policy.zero_grad()
    objective = PreferenceObjective(None, spec, FrozenForward([reference]), None, ContextParallelSum(None, 1))
    units = pair_units(labels, documents)
    objective.start_step(units)
    batch = pair_batch(labels, documents, lambda *t: t)

    def forward(m):
        return m(inputs, positions=document_positions(documents), documents=documents)
    loss = objective.loss_sum(forward(policy), labels, objective.reference(forward, batch), batch) / units[0]
    loss.backward()
    grads = {"lm_head.weight": policy.output.weight.grad,
             "model.embed_tokens.weight": policy.tok_embeddings.weight.grad}
    return loss.item(), objective.metrics(objective.sums), grads


def trl_dpo(dpo_trainer, spec: PreferenceLoss, models):
    """TRL DPOTrainer's loss, metrics and gradients for the settings of `spec` (sigmoid, robust, hinge, ipo, sft)."""
    hf = models[1]["policy"]
    hf.zero_grad()
    types_ = ["robust" if spec.robust else spec.loss] + (["sft"] if spec.sft_weight else [])
    dpo_trainer.loss_types, dpo_trainer.loss_weights = types_, [1.0] + ([spec.sft_weight] if spec.sft_weight else [])
    dpo_trainer.beta, dpo_trainer.label_smoothing = spec.beta, spec.label_smoothing
    dpo_trainer._metrics["train"].clear()
    loss = dpo_trainer._compute_loss(dpo_trainer.model, trl_batch(fixed_pairs()), False)
    loss.backward()
    metrics = {k: v[-1] for k, v in dpo_trainer._metrics["train"].items()}
    return loss.item(), metrics, {n: p.grad for n, p in hf.named_parameters() if n in ("lm_head.weight",
                                                                                          "model.embed_tokens.weight")}


def trl_logps(models, name: str, average: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen, rejected) log-probabilities of TRL's get_batch_logps on the transformers model's logits, and those
    logits."""
    from trl.experimental.cpo import CPOTrainer

    batch = trl_batch(fixed_pairs())
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
    logits = models[1][name](batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=average)
    return *logps.chunk(2), logits


def trl_reference_free(models, spec: PreferenceLoss):
    """cDPO and SimPO through CPOTrainer.cpo_loss, ORPO through ORPOTrainer.odds_ratio_loss (with the NLL of the
    chosen answers' tokens: TRL's ORPOTrainer also counts the prompt's, the ORPO paper and titan_lite the answer's)."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    hf = models[1]["policy"]
    hf.zero_grad()
    device = types.SimpleNamespace(device=torch.device("cpu"))
    settings = types.SimpleNamespace(beta=spec.beta, label_smoothing=spec.label_smoothing, simpo_gamma=spec.simpo_gamma,
                                     alpha=0.0, loss_type="sigmoid" if spec.loss == "sigmoid" else "simpo",
                                     accelerator=device)
    chosen, rejected, logits = trl_logps(models, "policy", average=spec.loss != "sigmoid")
    if spec.loss == "sigmoid":  # cDPO: the CPO loss of the log-ratios
        with torch.no_grad():
            ref_chosen, ref_rejected, _ = trl_logps(models, "reference", average=False)
        losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(settings, chosen - ref_chosen,
                                                                       rejected - ref_rejected)
        loss = losses.mean()
    elif spec.loss == "simpo":
        losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(settings, chosen, rejected)
        loss = losses.mean()
    else:
        losses, chosen_rewards, rejected_rewards, _, _ = ORPOTrainer.odds_ratio_loss(settings, chosen, rejected)
        batch = trl_batch(fixed_pairs())
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX)
        half = len(SHAPES)
        nll = torch.nn.functional.cross_entropy(logits[:half, :-1].flatten(0, 1), labels[:half, 1:].flatten())
        loss = nll - losses.mean()
    loss.backward()
    metrics = {"rewards/chosen": chosen_rewards.mean().item(), "rewards/rejected": rejected_rewards.mean().item(),
               "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
               "logps/chosen": chosen.mean().item(), "logps/rejected": rejected.mean().item()}
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return loss.item(), metrics, {n: p.grad for n, p in hf.named_parameters() if n in ("lm_head.weight",
                                                                                          "model.embed_tokens.weight")}


CASES = {
    "sigmoid": PreferenceLoss("sigmoid", beta=0.1),
    "robust": PreferenceLoss("sigmoid", beta=0.3, label_smoothing=0.2, robust=True),
    "hinge": PreferenceLoss("hinge", beta=0.5),
    "ipo": PreferenceLoss("ipo", beta=0.3),
    "rpo": PreferenceLoss("sigmoid", beta=0.2, sft_weight=0.7),
    "cdpo": PreferenceLoss("sigmoid", beta=0.25, label_smoothing=0.15),
    "simpo": PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1),
    "orpo": PreferenceLoss("orpo", beta=0.1),
}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@pytest.mark.parametrize("case", list(CASES))
def test_loss_rewards_logps_and_gradients_equal_trl(case, models, dpo_trainer):
    spec = CASES[case]
    loss, metrics, grads = ours(models, spec)
    in_dpo_trainer = case in ("sigmoid", "robust", "hinge", "ipo", "rpo")
    trl_loss, trl_metrics, trl_grads = (trl_dpo(dpo_trainer, spec, models) if in_dpo_trainer
                                        else trl_reference_free(models, spec))
    assert loss == pytest.approx(trl_loss, abs=ATOL), (loss, trl_loss)
    assert case in ("hinge", "ipo") or loss > 0.01  # a loss with a gradient, not a trivial zero
    names = METRICS + (("logits/chosen", "logits/rejected") if in_dpo_trainer else ())
    for name in names:
        assert metrics[name] == pytest.approx(trl_metrics[name], abs=ATOL), (name, metrics[name], trl_metrics[name])
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_logps_hold_no_float32_copy(monkeypatch, dtype):
    """Forward and backward allocate float32 blocks of 4 rows and one gradient buffer in the logits' dtype; the
    values and gradient equal log_softmax's."""
    from titan_lite.objective import vocab

    tokens, vocab_size = 64, 4096
    monkeypatch.setattr(vocab, "CHUNK_ELEMENTS", 4 * vocab_size)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens, vocab_size, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab_size, (1, tokens), generator=g)
    labels[0, :20] = IGNORE_INDEX
    weights = torch.randn(1, tokens, generator=g)
    with NewStorages([logits, labels, weights]) as storages:
        logps, _ = token_logps(logits, labels)
        (logps * weights).sum().backward()
    block = 4 * vocab_size * 4
    assert storages.largest_float32 <= block or (dtype == torch.float32 and storages.largest_float32 ==
                                                 tokens * vocab_size * 4)  # float32 logits: the gradient itself
    assert storages.peak <= tokens * vocab_size * dtype.itemsize + 4 * block + 4096  # the gradient and a few blocks
    plain = logits.detach().float().requires_grad_()
    expected = torch.log_softmax(plain, -1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    (expected * (labels != IGNORE_INDEX) * weights).sum().backward()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(logps, expected * (labels != IGNORE_INDEX), atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(logits.grad.float(), plain.grad, atol=tolerance, rtol=tolerance)


# ------------------------------------------------------------------------------------------ through the trainer


def tiny_pairs(folder: Path, count: int = 60) -> Path:
    import json
    import random

    rng = random.Random(0)
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append({"prompt": f"{a} + {b} =", "chosen": f" {a + b}", "rejected": f" {a + b + rng.choice([-1, 1])}"})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(folder: Path, data: Path, *extra: str):
    return parse_args(["--job.config_file", str(BASE_TOML), "--job.dump_folder", str(folder),
                       "--training.dataset", "preference", "--training.dataset_path", str(data),
                       "--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
                       "--metrics.enable_tensorboard=false", "--optimizer.lr", "0.02", *extra])


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def losses_of(trainer, steps: int) -> list[float]:
    data = iter(trainer.dataloader)
    return [trainer.train_step(trainer.next_microbatches(data), step=step)[0] for step in range(1, steps + 1)]


def test_reference_base_equals_a_frozen_copy_and_dpo_starts_at_ln2(tmp_path):
    """LoRA with reference 'base' trains exactly as with the base's HF folder as an explicit frozen reference, and
    the first step of DPO with fresh adapters (policy = reference) is exactly ln 2."""
    from tests.integration.harness import perturbed_hf_folder
    from titan_lite.train import Trainer

    base = perturbed_hf_folder(tmp_path / "base", "tiny")
    data = tiny_pairs(tmp_path)
    lora = ["--model.converters", "lora", "--checkpoint.initial_load_path", str(base),
            "--checkpoint.initial_load_in_hf"]
    own = losses_of(Trainer(config(tmp_path / "own", data, *lora)), 2)
    copy = losses_of(Trainer(config(tmp_path / "copy", data, *lora, "--preference.reference", str(base))), 2)
    assert own[0] == math.log(2)
    assert own == pytest.approx(copy, abs=1e-6) and own[1] != own[0], (own, copy)


@pytest.mark.slow  # three trainers, one of them on an NF4 base
@pytest.mark.parametrize("variant", [["--lora.init", "pissa"], ["--lora.init", "pissa", "--lora.base_dtype", "nf4"],
                                     ["--lora.use_dora"]], ids=["pissa", "qpissa", "dora"])
def test_the_base_of_pissa_qpissa_and_dora_is_the_starting_model(tmp_path, variant):
    """Adapters off with PiSSA's (QPiSSA's) initial factors added back to the (quantized) residual is the model
    training starts from, and DoRA's base is the loaded model: the first DPO step is ln 2."""
    from tests.integration.harness import perturbed_hf_folder
    from titan_lite.train import Trainer

    base = perturbed_hf_folder(tmp_path / "base", "tiny")
    lora = ["--model.converters", "lora", "--checkpoint.initial_load_path", str(base),
            "--checkpoint.initial_load_in_hf"]
    first = losses_of(Trainer(config(tmp_path / "run", tiny_pairs(tmp_path), *lora, *variant)), 1)[0]
    assert first == pytest.approx(math.log(2), abs=1e-6), (variant, first)


def test_bad_references_are_one_line(tmp_path):
    data = tiny_pairs(tmp_path)

    def refusal(*flags: str) -> str:
        with pytest.raises(ConfigError) as error:
            check_objective(check_before_launch(config(tmp_path / "out", data, *flags), 1))
        assert "\n" not in str(error.value)
        return str(error.value)
    assert refusal() == (
        "'preference.reference' = 'base' runs the policy with its adapters switched off as the reference, but no "
        "transform of 'model.converters' = [] keeps a base apart from what it trains: the policy would equal its "
        "reference (nothing to learn); add adapters (--model.converters lora) or name a reference folder")
    assert "with 'lora.train_modules' = ['output']: those modules train in full" in refusal(
        "--model.converters", "lora", "--lora.train_modules", "output")
    wide = teacher_folder(tmp_path / "wide", vocab=4096)
    assert refusal("--preference.reference", wide) == (
        f"the reference '{wide}' has a vocabulary of 4,096 tokens but the policy ('model.flavor' = 'tiny') has 2,048: "
        "preference tuning compares their log-probabilities of the same token ids, so both need the same tokenizer "
        "and vocabulary")
    assert "'preference.reference' = " in refusal("--preference.reference", str(tmp_path / "absent"))


def test_precomputed_reference_resumes_exactly_and_metrics_reach_tensorboard(tmp_path, capsys):
    """The reference's log-probabilities are computed once before training, checkpointed and loaded on resume, never
    recomputed: the resumed run continues exactly although the reference folder changed in between. The training
    and validation metrics are written under TRL's names."""
    from safetensors.torch import load_file, save_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.integration.harness import perturbed_hf_folder, tb_losses
    from titan_lite.train import Trainer

    reference = perturbed_hf_folder(tmp_path / "reference", "tiny")
    data = tiny_pairs(tmp_path, 80)
    flags = ["--preference.reference", str(reference), "--preference.precompute_reference",
             "--metrics.enable_tensorboard", "--checkpoint.enable", "--checkpoint.interval", "2",
             "--lr_scheduler.total_steps", "4", "--validation.enable", "--validation.dataset", "preference",
             "--validation.freq", "2", "--validation.seq_len", "64", "--validation.local_batch_size", "2"]
    Trainer(config(tmp_path / "whole", data, *flags, "--training.steps", "4")).train()
    Trainer(config(tmp_path / "resumed", data, *flags, "--training.steps", "2")).train()
    weights = load_file(str(reference / "model.safetensors"))  # another reference: recomputing would differ
    save_file({k: v + 0.1 for k, v in weights.items()}, str(reference / "model.safetensors"))
    first = capsys.readouterr().out
    assert first.count("preference: reference log-probabilities of ") == 2  # both first runs computed them
    Trainer(config(tmp_path / "resumed", data, *flags, "--training.steps", "4")).train()
    out = capsys.readouterr().out
    assert "the reference log-probabilities come from the checkpoint" in out and "computed in" not in out
    whole, resumed = tb_losses(tmp_path / "whole" / "tb"), tb_losses(tmp_path / "resumed" / "tb")
    assert sorted(whole) == [1, 2, 3, 4] and resumed == pytest.approx(whole, abs=1e-6), (whole, resumed)
    events = EventAccumulator(str(tmp_path / "whole" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                 "logps/rejected", "logits/chosen", "logits/rejected"):
        assert name in tags and f"validation/{name}" in tags, (name, tags)
    assert [e.step for e in events.Scalars("validation/rewards/accuracies")] == [2, 4]


def test_a_held_out_split_smaller_than_one_batch_is_one_line(tmp_path):
    """A held-out split that fills no whole validation batch is refused in one line naming the setting (it was a
    traceback in the preference metrics)."""
    from titan_lite.train import Trainer

    flags = ["--validation.enable", "--validation.dataset", "preference", "--validation.freq", "1",
             "--validation.seq_len", "64", "--validation.local_batch_size", "4", "--validation.steps", "1",
             "--training.steps", "1"]
    trainer = Trainer(config(tmp_path / "run", tiny_pairs(tmp_path, 40), *flags))
    with pytest.raises(ConfigError) as refused:
        trainer.validator.batch_count()
    assert str(refused.value) == ("validation: the held-out preference split fills no whole batch of "
                                  "'validation.local_batch_size' = 4 per data-parallel rank: lower it, or hold out "
                                  "more data")


def test_preference_benchmark_cases_read_their_results():
    """benchmarks/preference.py's result lines as the cases read them: useful tokens per second, seconds and tokens
    per pair of both prompt layouts, and the reference's cost in a step against its forward alone."""
    import json

    from benchmarks.cases import CASES
    from benchmarks.framework import RunOutput
    from benchmarks.worker import RESULT_PREFIX

    def read(variant, result: dict) -> dict:
        full = {"peak_rss_bytes": 2**30, "machine_busy_s": None, "own_cpu_s": 1.0, "wall_s": 1.0, **result}
        return variant.metrics(RunOutput(RESULT_PREFIX + json.dumps(full), 0, 1.0, 1.0, 2**30))

    packed, padded = CASES["preference_packing"]().variants
    assert (packed.layout, padded.layout) == ("packed", "padded")
    m = read(packed, {"step_s": [2.0, 2.0], "trained_per_step": [300, 500], "total_per_step": [2048, 2048],
                      "pairs_per_step": [5, 3]})
    assert m["trained_tokens_per_s"] == 200 and m["pairs_per_s"] == 2 and m["step_s"] == 2.0
    (prompt,) = CASES["preference_prompt"]().variants
    m = read(prompt, {"duplicated_s": [4.0, 6.0], "shared_s": [3.0, 3.0], "duplicated_tokens": [1000, 600],
                      "shared_tokens": [700, 400], "pairs": [2, 2], "logps_max_difference": 1e-6})
    assert m["duplicated_s_per_pair"] == 2.5 and m["shared_s_per_pair"] == 1.5
    assert m["duplicated_tokens_per_pair"] == 400 and m["shared_tokens_per_pair"] == 275
    case = CASES["preference_reference"]()
    base, path = case.variants
    m = read(base, {"dpo_step_s": [3.0, 3.0], "given_step_s": [2.0, 2.0], "reference_forward_s": [1.0, 1.0],
                    "parameter_bytes_held": 2**30})
    assert m["reference_cost_s"] == 1.0 and m["parameter_gib_held"] == 1.0
    cost = case.ratios[0]
    assert (cost.metric, cost.denominator_metric, cost.target) == ("reference_cost_s", "reference_forward_s", 1.05)


@pytest.mark.slow  # plans 8B twice (policy and reference) in two DRY_RUNs
def test_dry_run_plans_a_held_reference_and_a_precomputed_ones_pass(monkeypatch, capsys, tmp_path):
    """In-process DRY_RUN of the 8B recipe with a reference folder of the 8B flavor (not downloaded): held through
    training, its weights are in every rank's plan; precomputed, the pass before training holds both models and is
    refused in one line when it does not fit."""
    from titan_lite.dry_run import dry_run

    monkeypatch.setenv("NGPU", "1")
    monkeypatch.setenv("NNODES", "1")
    monkeypatch.chdir(ROOT)
    pairs = tiny_pairs(tmp_path, 4)
    argv = ["--job.config_file", str(ROOT / "train_configs/llama3_8b_dpo_lora.toml"), "--model.hf_assets_path",
            "./assets/tokenizer", "--training.dataset_path", str(pairs), "--validation.enable=false",
            "--preference.chat_template", "", "--preference.reference", str(tmp_path / "absent"),
            "--preference.reference_flavor", "8B", "--dry_run.device_memory_gib", "80"]
    assert dry_run(parse_args(argv)) == 5  # the reference and the base weights are not there
    out = capsys.readouterr().out
    assert f"[ ] 'preference.reference' = '{tmp_path / 'absent'}': no Hugging Face folder or DCP checkpoint" in out
    assert "preference: loss sigmoid, beta 0.1; reference: 8B from" in out
    assert "reference 8,030,261,248 local x bfloat16 (frozen)" in out  # held: in the training step's plan
    assert "preference data: the first 1 sequences hold 4 pairs (4.0 per sequence)" in out
    with pytest.raises(ConfigError) as error:
        dry_run(parse_args([*argv, "--preference.precompute_reference", "--dry_run.device_memory_gib", "24"]))
    out = capsys.readouterr().out
    assert "precomputing the reference's log-probabilities before training" in out
    assert "  reference       14.96 GiB  reference 8,030,261,248 local x bfloat16 (frozen)" in out
    assert str(error.value).startswith("the reference's precomputation does not fit: it needs an estimated ")


def test_a_reference_that_is_a_file_is_named_as_one(tmp_path):
    """A reference path that names a file (a safetensors, say) says it must be a folder, not to set its flavor."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    cfg = parse_args(["--training.dataset", "preference", "--preference.reference", str(weights)])
    with pytest.raises(ConfigError) as error:
        frozen_config(cfg, reference_spec(cfg), "cpu")
    assert str(error.value) == (
        f"'preference.reference' = '{weights}' is a file; the reference must be a folder: a Hugging Face folder "
        "(config.json and safetensors) or a DCP step folder of a titan_lite run (or 'base')")


def test_the_reference_precomputation_says_what_it_reads_before_its_first_batch(tmp_path, caplog):
    """Tokenizing and packing thousands of pairs before the first batch takes a minute: it is announced, then
    reported every few seconds, never silent."""
    from tests.test_preference_data import PAIRS, TOK, config, source, write_jsonl
    from titan_lite.objective.reference_pass import _read_windows

    path = write_jsonl(tmp_path / "d.jsonl", PAIRS)
    with caplog.at_level(logging.INFO, logger="titan_lite"):
        windows = _read_windows(source(config(path), TOK), "reference log-probabilities (training)", every_s=0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == f"reference log-probabilities (training): reading, tokenizing and packing the pairs of '{path}'"
    assert lines[-1] == f"reference log-probabilities (training): {len(windows)} windows of pairs packed so far"
