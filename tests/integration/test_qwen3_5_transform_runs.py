"""Qwen3.5's transforms as users run them (run_train.sh): distillation into a dense Qwen3.5 student from a teacher of
another family (a Llama folder), whose first step's logged KL and cross entropy equal a direct computation from
transformers' two models' logits on that step's batch (every step's loss alpha T^2 KL + (1 - alpha) CE of its logged
parts); LoRA on a Qwen3.5-MoE folder, whose trained adapter (attention, DeltaNet, shared and routed experts) loaded
by peft on transformers' Qwen3_5MoeForCausalLM gives the run's merged export's logits, and whose losses under EP 2
equal one process's."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.integration.harness import REPO, assert_losses_close, one_window_dataset, perturbed_hf_folder, run_train

transformers = pytest.importorskip("transformers")

SEQ_LEN, GLOBAL_BATCH, STEPS, ALPHA, T = 32, 4, 2, 0.5, 2.0


@pytest.mark.slow
def test_distillation_into_qwen3_5_from_a_llama_teacher_equals_the_direct_kd_of_their_logits(tmp_path):
    from tests.integration.test_distill_runs import scalars
    from tests.test_qwen3_5 import hf_model
    from titan_lite.data.tokenizer import build_tokenizer

    student = tmp_path / "student"
    hf_model(vocab_size=2048).save_pretrained(student)
    shutil.copy2(REPO / "assets" / "tokenizer" / "tokenizer.model", student)
    teacher = perturbed_hf_folder(tmp_path / "teacher", "tiny")
    data = one_window_dataset(tmp_path, GLOBAL_BATCH * (STEPS + 1), SEQ_LEN)
    run = run_train([*data, "--model.flavor", "hf", "--model.hf_assets_path", str(student),
                     "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(student),
                     "--training.steps", str(STEPS), "--training.local_batch_size", str(GLOBAL_BATCH),
                     "--distill.enable", "--distill.alpha", str(ALPHA), "--distill.temperature", str(T),
                     "--distill.teacher_path", str(teacher)], tmp_path / "run")
    assert run.returncode == 0, run.output[-3000:]
    losses, kl, ce = run.tb_losses(), scalars(run, "distill/kl"), scalars(run, "distill/ce")
    assert sorted(losses) == sorted(kl) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert abs(loss - (ALPHA * T * T * kl[step] + (1 - ALPHA) * ce[step])) < 1e-5, (step, loss, kl, ce)

    tokenizer = build_tokenizer(str(REPO / "assets" / "tokenizer"))
    corpus = Path(data[data.index("--training.dataset_path") + 1]).read_text().splitlines()
    docs = [json.loads(line)["text"] for line in corpus[:GLOBAL_BATCH]]  # step 1's batch: one document per row
    ids = torch.tensor([tokenizer.encode(d, bos=True, eos=True) for d in docs])
    inputs, labels = ids[:, :-1], ids[:, 1:]
    auto = transformers.AutoModelForCausalLM
    theirs = [auto.from_pretrained(f, dtype=torch.float32).eval() for f in (student, teacher)]
    assert [type(m).__name__ for m in theirs] == ["Qwen3_5ForCausalLM", "LlamaForCausalLM"]
    with torch.no_grad():
        s, t = (m(inputs).logits for m in theirs)
    log_s, log_t = F.log_softmax(s.flatten(0, 1) / T, -1), F.log_softmax(t.flatten(0, 1) / T, -1)
    direct_kl = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1).mean().item()
    direct_ce = F.cross_entropy(s.flatten(0, 1), labels.flatten()).item()
    assert direct_kl > 0.05, direct_kl  # the two families' models differ
    assert kl[1] == pytest.approx(direct_kl, abs=1e-5) and ce[1] == pytest.approx(direct_ce, abs=1e-5), (
        kl[1], direct_kl, ce[1], direct_ce)


def moe_folder(folder):
    """tests/test_qwen3_5_moe.py's small wide Qwen3.5-MoE with the bundled tokenizer's vocabulary and tokenizer."""
    from tests.test_qwen3_5_moe import hf_moe

    hf_moe(vocab_size=2048).save_pretrained(folder)
    shutil.copy2(REPO / "assets" / "tokenizer" / "tokenizer.model", folder)
    return folder


@pytest.mark.slow
def test_a_lora_run_on_qwen3_5_moe_exports_for_peft_and_equals_itself_under_ep2(tmp_path):
    """all-linear LoRA for 3 steps on one global batch of 8: the adapter of the one-process run loaded by peft on
    transformers' class gives its merged export's logits; under EP 2 (expert adapters sharded with their experts,
    the rest FSDP-sharded over the same 2 gloo ranks) the losses equal the one process's."""
    peft = pytest.importorskip("peft")
    folder = moe_folder(tmp_path / "base")
    common = [*one_window_dataset(tmp_path, 8 * 4, 48), "--model.flavor", "hf", "--model.hf_assets_path", str(folder),
              "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path", str(folder), "--training.steps",
              "3", "--model.converters", "lora", "--lora.rank", "4", "--lora.init", "gaussian"]
    one = run_train([*common, "--training.local_batch_size", "8", "--checkpoint.enable", "--checkpoint.last_save_in_hf",
                     "--checkpoint.export_dtype", "float32"], tmp_path / "one")
    assert one.returncode == 0, one.output[-3000:]
    assert sorted(one.tb_losses()) == [1, 2, 3]
    assert "lora: target 'all-linear' matched 31 linear modules" in one.output
    ep = run_train([*common, "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"],
                   tmp_path / "ep", ngpu=2)
    assert "dp_shard 2 x cp 1 x tp 1 x pp 1 (experts: ep 2 x efsdp 1)" in ep.output, ep.output[-3000:]
    assert_losses_close(ep, one.tb_losses(), 1e-5)

    out = tmp_path / "one" / "checkpoint"
    config = json.loads((out / "step-3-adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert {"gate_proj", "in_proj_qkv", "q_proj"} <= set(config["target_modules"])
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(3))
    auto = transformers.AutoModelForCausalLM
    base = auto.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(tokens).logits
    with_adapter = peft.PeftModel.from_pretrained(base, str(out / "step-3-adapter")).eval()
    merged = auto.from_pretrained(out / "step-3-hf", dtype=torch.float32).eval()
    with torch.no_grad():
        got, want = with_adapter(tokens).logits, merged(tokens).logits
    assert (got - before).abs().max() > 1e-4  # training moved the adapters
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
