"""Distillation: the chunked KD loss against torch's kl_div and cross entropy (values and gradients, every kind and
temperature), its memory (no full [tokens, vocab] float32 tensor, no second logits-sized buffer), vocab-sharded
logits on 2 ranks, the self-teacher's base function, the config's refusals and the DRY_RUN plan."""

import json
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.helpers import spawn_gloo
from tests.integration.harness import BASE_TOML, REPO
from titan_lite.config import parse_args
from titan_lite.data.tokenizer import build_tokenizer
from titan_lite.errors import ConfigError
from titan_lite.job.plan import check_before_launch
from titan_lite.loss import IGNORE_INDEX
from titan_lite.models.flavors import flavor_args
from titan_lite.models.hf.config import args_to_hf_config
from titan_lite.objective import check_objective, kd
from titan_lite.objective.frozen import TOKENIZER_PROBE
from titan_lite.objective.kd import DistillLoss, distill_loss_sum
from titan_lite.transforms.lora.module import LoRALinear, adapters_off, principal_factors

VOCAB = 50


def reference_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor,
                   spec: DistillLoss) -> torch.Tensor:
    """alpha T^2 KL + (1 - alpha) CE summed over the trained tokens, by torch's kl_div and cross_entropy."""
    t = spec.temperature
    log_s = F.log_softmax(student.flatten(0, 1).float() / t, dim=-1)
    log_t = F.log_softmax(teacher.flatten(0, 1).float() / t, dim=-1)
    if spec.kind == "forward":  # kl_div(input, target) = KL(target || input)
        kl = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)
    else:
        kl = F.kl_div(log_t, log_s, log_target=True, reduction="none").sum(-1)
    valid = labels.flatten() != IGNORE_INDEX
    ce = F.cross_entropy(student.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                         reduction="sum")
    return spec.alpha * t * t * (kl * valid).sum() + (1 - spec.alpha) * ce


def batch(seed: int, vocab: int = VOCAB, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(2, 7, vocab, generator=g) * 3).to(dtype)
    teacher = (torch.randn(2, 7, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (2, 7), generator=g)
    labels[0, :3] = IGNORE_INDEX
    return student, teacher, labels


@pytest.mark.parametrize("kind", ["forward", "reverse"])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_the_loss_equals_kl_div_and_cross_entropy_in_value_and_gradient(monkeypatch, kind, temperature):
    monkeypatch.setattr(kd, "_CHUNK_ELEMENTS", 3 * VOCAB)  # 3 rows a block: 5 blocks, the last one short
    for alpha in (1.0, 0.3, 0.0):
        spec = DistillLoss(alpha, temperature, kind)
        student, teacher, labels = batch(int(temperature * 10) + len(kind))
        ours, theirs = student.clone().requires_grad_(), student.clone().requires_grad_()
        loss, parts = distill_loss_sum(ours, teacher.clone(), labels, spec)
        expected = reference_loss(theirs, teacher, labels, spec)
        (loss * 0.7).backward()
        (expected * 0.7).backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        # Both gradients are float32 computations: at T = 0.5 (logits of std 6) each is up to 1.3e-6 from a float64
        # reference, so they are compared at 2e-6.
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=2e-6)
        assert ours.grad[0, :3].abs().sum() == 0  # ignored tokens get no gradient
        kl_only = reference_loss(student, teacher, labels, DistillLoss(1.0, 1.0, kind) if temperature == 1 else
                                 DistillLoss(1.0, temperature, kind)) / temperature**2
        torch.testing.assert_close(parts[0], kl_only, rtol=1e-6, atol=1e-6)  # the logged KL, before T^2 and alpha
        ce = F.cross_entropy(student.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        torch.testing.assert_close(parts[1], ce, rtol=1e-6, atol=1e-6)


def test_identical_logits_cost_nothing_and_bf16_logits_get_a_bf16_gradient():
    student, _, labels = batch(3, dtype=torch.bfloat16)
    loss, parts = distill_loss_sum(student.clone().requires_grad_(), student.clone(), labels, DistillLoss())
    assert loss.item() == 0 and parts[0].item() == 0
    student, teacher, labels = batch(4, dtype=torch.bfloat16)
    ours, theirs = student.clone().requires_grad_(), student.float().requires_grad_()
    distill_loss_sum(ours, teacher.clone(), labels, DistillLoss(0.5, 2.0, "reverse"))[0].backward()
    reference_loss(theirs, teacher.float(), labels, DistillLoss(0.5, 2.0, "reverse")).backward()
    assert ours.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours.grad.float(), theirs.grad, rtol=0, atol=1e-2)


class NewStorages(TorchDispatchMode):
    """Bytes of the storages created under it that are alive together at most, and the largest float32 one."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.live, self.peak, self.largest_float32 = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if key in self.known or nbytes == 0:
                continue
            self.known.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            if t.dtype == torch.float32:
                self.largest_float32 = max(self.largest_float32, nbytes)
            weakref.finalize(storage, self.freed, key, nbytes)
        return out

    def freed(self, key: int, nbytes: int) -> None:
        self.known.discard(key)
        self.live -= nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_loss_holds_no_full_float32_copy_and_no_second_logits_buffer(monkeypatch, dtype):
    """Forward and backward allocate float32 blocks of 4 rows and nothing of [tokens, vocab]: the gradient is
    written into the teacher's logits. torch's kl_div on the same logits holds several float32 copies."""
    tokens, vocab = 64, 4096
    monkeypatch.setattr(kd, "_CHUNK_ELEMENTS", 4 * vocab)
    g = torch.Generator().manual_seed(0)
    student = torch.randn(1, tokens, vocab, generator=g).to(dtype).requires_grad_()
    teacher = torch.randn(1, tokens, vocab, generator=g).to(dtype)
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    full_float32, block_float32 = tokens * vocab * 4, 4 * vocab * 4
    with NewStorages([student, teacher, labels]) as ours:
        distill_loss_sum(student, teacher, labels, DistillLoss(0.5, 2.0, "reverse"))[0].backward()
    assert ours.largest_float32 <= block_float32
    assert ours.peak < tokens * vocab * 2  # all of it together: less than one bf16 copy of the logits
    assert student.grad.data_ptr() == teacher.data_ptr()  # the teacher's buffer became the gradient
    plain = student.detach().clone().requires_grad_()
    with NewStorages([plain, teacher, labels]) as theirs:
        reference_loss(plain, teacher, labels, DistillLoss(0.5, 2.0, "reverse")).backward()
    assert theirs.largest_float32 == full_float32 and theirs.peak > 3 * full_float32


def _vocab_sharded_worker(rank: int) -> None:
    """Both ranks hold half the vocabulary (uneven for 51) as loss parallel lays out the logits: the loss and each
    rank's gradient columns equal one process's."""
    mesh = init_device_mesh("cpu", (2,))
    cases = [(vocab, spec) for vocab in (50, 51) for spec in (DistillLoss(1.0, 2.0, "forward"),
                                                              DistillLoss(0.4, 0.5, "reverse"),
                                                              DistillLoss(0.0, 1.0, "forward"))]
    for vocab, spec in cases:
        student, teacher, labels = batch(7, vocab)
        plain = student.clone().requires_grad_()
        expected = reference_loss(plain, teacher, labels, spec)
        expected.backward()
        sharded = distribute_tensor(student, mesh, [Shard(2)]).requires_grad_()
        loss, parts = distill_loss_sum(sharded, distribute_tensor(teacher, mesh, [Shard(2)]), labels, spec)
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sharded.grad.full_tensor(), plain.grad, rtol=1e-6, atol=2e-6)


def test_vocab_sharded_logits_on_two_ranks_equal_one_process():
    spawn_gloo(_vocab_sharded_worker, 2)


# ------------------------------------------------------------------------------------------ the self-teacher


def test_adapters_off_gives_the_base_function_for_lora_dora_and_pissa():
    """Inside adapters_off a trained adapter is invisible: W x for LoRA and DoRA, and for PiSSA (whose frozen weight
    is the residual W - s B0 A0) the original W x again; outside it the adapter is back."""
    g = torch.Generator().manual_seed(0)
    original, x = torch.randn(12, 16, generator=g), torch.randn(3, 5, 16, generator=g)
    for kind in ("lora", "dora", "pissa"):
        module = LoRALinear(16, 12, rank=4, scale=0.5, dora=kind == "dora", keep_init=kind == "pissa")
        with torch.no_grad():
            module.lora_a.copy_(torch.randn(4, 16, generator=g))
            module.lora_b.copy_(torch.randn(12, 4, generator=g))
            module.weight.copy_(original)
            if kind == "dora":
                module.magnitude.copy_(torch.rand(12, generator=g) + 1)
            if kind == "pissa":
                lora_a, lora_b = principal_factors(original, 4, 0.5)
                module.pissa_a0.copy_(lora_a)
                module.pissa_b0.copy_(lora_b)
                module.weight.copy_(original - 0.5 * lora_b @ lora_a)
        adapted = module(x)
        with adapters_off([module]):
            torch.testing.assert_close(module(x), x @ original.T, rtol=1e-5, atol=1e-5)
        assert module.adapters_off is False and torch.equal(module(x), adapted)
        assert not torch.allclose(adapted, x @ original.T, atol=1e-3)


# ------------------------------------------------------------------------------------------ refusals


def teacher_folder(tmp: Path, vocab: int = 2048, swap_tokens: bool = False) -> str:
    """A folder with a tiny teacher's config.json (vocabulary `vocab`) and the bundled tokenizer, or that tokenizer
    with the ids of two tokens swapped (the same size, other ids)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(args_to_hf_config(replace(flavor_args("tiny"), vocab_size=vocab),
                                                                  torch.float32)))
    lines = (REPO / "assets/tokenizer/tokenizer.model").read_text().splitlines()
    if swap_tokens:  # the ranks of the probe's first word and of the token after it in the file
        i = build_tokenizer(str(REPO / "assets/tokenizer")).encode(TOKENIZER_PROBE, bos=False)[0]
        (a, rank_a), (b, rank_b) = lines[i].split(), lines[i + 1].split()
        lines[i], lines[i + 1] = f"{a} {rank_b}", f"{b} {rank_a}"
    (tmp / "tokenizer.model").write_text("\n".join(lines) + "\n")
    return str(tmp)


REFUSALS = [
    (lambda tmp: ["--distill.enable"], "'distill.enable' = true needs 'distill.teacher_path'"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", "base", "--distill.alpha", "1.5"],
     "'distill.alpha' must be in (0, 1], got 1.5"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", "base", "--distill.alpha", "0"],
     "'distill.alpha' = 0 weighs the teacher's KL term by 0: the run would load the teacher and run it every step for "
     "nothing; set alpha in (0, 1], or drop 'distill.enable' to train on cross entropy alone"),
    (lambda tmp: ["--distill.teacher_path", "base", "--distill.alpha", "0.5"],
     "'distill.teacher_path' = 'base' (and 1 more [distill] setting) has no effect: they take effect only with "
     "'distill.enable' = true, and that is false; set --distill.enable or drop the setting"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", teacher_folder(tmp), "--distill.teacher_flavor",
                  "tiny_qwen4"], "'distill.teacher_flavor': unknown model flavor 'tiny_qwen4' (did you mean "
     "'tiny_qwen3'?); known: "),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", "base", "--distill.temperature", "0"],
     "'distill.temperature' must be positive"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", "base", "--parallelism.pipeline_parallel_degree", "2"],
     "does not run under pipeline parallelism"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", "base"],
     "no transform of 'model.converters' = [] keeps a base apart from what it trains"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", "base", "--model.converters", "lora"],
     "with 'distill.alpha' = 1: the student starts as its own base, so the KL and its gradient are zero"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", teacher_folder(tmp, vocab=4096)],
     "has a vocabulary of 4,096 tokens but the student ('model.flavor' = 'tiny') has 2,048"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", teacher_folder(tmp, swap_tokens=True)],
     "(2,048 tokens) is not the student's in './assets/tokenizer' (2,048 tokens)"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", str(tmp / "absent")],
     "/absent' does not exist (a Hugging Face folder, a DCP step folder of a titan_lite run, or 'base')"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", str(tmp / "absent"), "--distill.teacher_flavor",
                  "tiny"], "/absent' does not exist (a Hugging Face folder, a DCP step folder of a titan_lite run"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", str(tmp)],
     "has no config.json, so the teacher's shape is unknown: name its flavor in 'distill.teacher_flavor'"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", str(teacher_folder(tmp))],
     "no model.safetensors or model.safetensors.index.json"),
    (lambda tmp: ["--distill.enable", "--distill.teacher_path", dcp_step_folder(tmp)],
     "is a DCP checkpoint, but its run's config"),
]


def dcp_step_folder(tmp: Path) -> str:
    """A folder that looks like a DCP step (a .metadata file) in a run folder without its config.toml."""
    step = tmp / "run" / "checkpoint" / "step-3"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    return str(step)


@pytest.mark.parametrize("argv, message", REFUSALS, ids=range(len(REFUSALS)))
def test_a_bad_distill_setting_is_one_line_before_launch(tmp_path, argv, message):
    with pytest.raises(ConfigError) as error:
        check_objective(check_before_launch(parse_args(["--job.config_file", str(BASE_TOML), "--job.dump_folder",
                                                        str(tmp_path / "out"), *argv(tmp_path)]), 1))
    assert message in str(error.value) and "\n" not in str(error.value)
