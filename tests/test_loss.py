"""The training loss: row-chunked cross entropy on CPU equals F.cross_entropy in value and gradient."""

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
