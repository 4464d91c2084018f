"""The training loss: row-chunked cross entropy on CPU equals F.cross_entropy in value and gradient; the one row-block
kernel behind it, the log-probabilities and distillation equals plain autograd."""

import pytest
import torch
import torch.nn.functional as F

from titan_lite import loss as tl_loss
from titan_lite.loss import IGNORE_INDEX, cross_entropy_sum


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_chunked_cross_entropy_matches_plain_with_ignored_labels(monkeypatch, dtype, tol):
    monkeypatch.setattr(tl_loss, "_CHUNK_ELEMENTS", 3 * 50)  # 3 rows a block: 5 blocks, the last one short
    logits = (torch.randn(2, 7, 50) * 4).to(dtype)
    labels = torch.randint(0, 50, (2, 7))
    labels[0, :3] = IGNORE_INDEX
    ours, plain = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = cross_entropy_sum(ours, labels)
    expected = F.cross_entropy(plain.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                               ignore_index=IGNORE_INDEX)
    (loss * 0.3).backward()
    (expected * 0.3).backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-5)
    assert ours.grad.dtype == dtype
    torch.testing.assert_close(ours.grad.float(), plain.grad.float(), rtol=tol, atol=tol)
    assert ours.grad[0, :3].abs().sum() == 0  # ignored tokens get no gradient


def test_chunked_cross_entropy_without_gradients():
    logits, labels = torch.randn(1, 4, 9), torch.randint(0, 9, (1, 4))
    with torch.no_grad():
        value = cross_entropy_sum(logits, labels)
    torch.testing.assert_close(value, F.cross_entropy(logits[0], labels[0], reduction="sum"))


def test_chunked_cross_entropy_keeps_only_probabilities_in_the_logits_dtype():
    """What backward keeps of bf16 logits is one bf16 [tokens, vocab] buffer (no float32 copy): the plan's figure."""
    logits, labels = torch.randn(6, 40).to(torch.bfloat16).requires_grad_(), torch.randint(0, 40, (6,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = cross_entropy_sum(logits[None], labels[None])
    big = [t for t in saved if t.numel() == logits.numel()]
    assert [t.dtype for t in big] == [torch.bfloat16]
    loss.backward()
    expected = torch.softmax(logits.detach().float(), dim=-1)
    expected[torch.arange(6), labels] -= 1
    torch.testing.assert_close(logits.grad.float(), expected, rtol=0, atol=1e-2)


# ------------------------------------------------------------------------------------------ the one row-block kernel


def test_row_blocks_cover_every_row_once_in_order():
    blocks = tl_loss.row_blocks(10, 7, torch.device("cpu"), (21, 7 * 1000))
    assert blocks == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    assert tl_loss.row_blocks(4, 10**9, torch.device("cpu"), (1, 1)) == [slice(i, i + 1) for i in range(4)]


def test_softmax_rows_writes_the_softmax_and_returns_the_row_sums():
    block = torch.randn(5, 11) * 3
    probs = torch.empty(5, 11, dtype=torch.bfloat16)
    row_max, sums = tl_loss.softmax_rows(block, probs, more_sums=lambda exp, x: [x.sum(dim=1)])
    torch.testing.assert_close(row_max + sums[0].log(), block.logsumexp(dim=1))
    torch.testing.assert_close(sums[1], block.sum(dim=1))
    torch.testing.assert_close(probs.float(), block.softmax(dim=1), rtol=1e-2, atol=1e-2)


def test_the_chunked_losses_gradients_equal_unchunked_autograd(monkeypatch):
    """Cross entropy, log-probabilities (at a temperature, with entropy) and distillation, each in blocks of 3 rows
    (the last one short): their values and gradients equal plain autograd over the whole logits."""
    from titan_lite.objective import kd, vocab
    from titan_lite.objective.kd import DistillLoss, distill_loss_sum
    from titan_lite.objective.logps import tempered_logps

    vocab_size, temperature = 13, 0.7
    monkeypatch.setattr(tl_loss, "_CHUNK_ELEMENTS", 3 * vocab_size)
    monkeypatch.setattr(vocab, "CHUNK_ELEMENTS", 3 * vocab_size)
    monkeypatch.setattr(kd, "_CHUNK_ELEMENTS", 3 * vocab_size)
    torch.manual_seed(0)
    logits = torch.randn(2, 7, vocab_size) * 3
    teacher = torch.randn(2, 7, vocab_size) * 3
    labels = torch.randint(0, vocab_size, (2, 7))
    labels[1, :4] = IGNORE_INDEX
    valid = labels != IGNORE_INDEX
    weights = torch.randn(2, 7)

    def both(ours, plain):
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        ours_value, plain_value = ours(a), plain(b)
        ours_value.backward()
        plain_value.backward()
        torch.testing.assert_close(ours_value, plain_value, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)

    both(lambda x: cross_entropy_sum(x, labels) * 0.3,
         lambda x: F.cross_entropy(x.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX) * 0.3)

    def plain_logps(x):
        logps = F.log_softmax(x / temperature, dim=-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
        return (logps * valid * weights).sum()
    both(lambda x: (tempered_logps(x, labels, temperature, entropy=True)[0] * weights).sum(), plain_logps)
    _, entropy = tempered_logps(logits, labels, temperature, entropy=True)
    p = F.softmax(logits / temperature, dim=-1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1) * valid, rtol=1e-5, atol=1e-5)

    for kind in ("forward", "reverse"):
        spec = DistillLoss(alpha=0.6, temperature=2.0, kind=kind)

        def plain_distill(x, spec=spec):
            log_p, log_q = F.log_softmax(x / spec.temperature, -1), F.log_softmax(teacher / spec.temperature, -1)
            kl = (log_q.exp() * (log_q - log_p)).sum(-1) if spec.kind == "forward" else \
                (log_p.exp() * (log_p - log_q)).sum(-1)
            ce = F.cross_entropy(x.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
            return spec.alpha * spec.temperature ** 2 * (kl * valid).sum() + (1 - spec.alpha) * ce.sum()
        both(lambda x, spec=spec: distill_loss_sum(x, teacher.clone(), labels, spec)[0], plain_distill)
