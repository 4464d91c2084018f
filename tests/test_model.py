"""The Llama model: published parameter counts, RoPE scaling, init independent of layout, causal behaviour, GQA."""

import pytest
import torch
import torch.nn.functional as F

from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import FLAVORS, flavor_args
from titan_lite.models.parts import sdpa
from titan_lite.models.parts.rope import apply_rope, apply_rope_real_pairs, rope_cache, rope_frequencies
from titan_lite.models.parts.sdpa import grouped_attention

PUBLISHED = {
    "8B": 8_030_261_248,  # Llama 3.1 8B
    "1B": 1_235_814_400,  # Llama 3.2 1B
    "3B": 3_212_749_824,  # Llama 3.2 3B
    "70B": 70_553_706_496,  # Llama 3.1 70B
    "405B": 405_853_388_800,  # Llama 3.1 405B
    "llama2_7B": 6_738_415_616,  # Llama 2 7B
    "smollm2_135M": 134_515_008,  # SmolLM2-135M
}


@pytest.mark.parametrize("flavor, count", PUBLISHED.items())
def test_parameter_counts_match_published(flavor, count):
    with torch.device("meta"):
        assert Llama(flavor_args(flavor)).num_params() == count


def test_llama31_rope_scaling_bands():
    args = flavor_args("8B")
    base = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim))
    scaled = rope_frequencies(args)
    wavelen = 2 * torch.pi / base
    high = wavelen < 8192 / 4  # short wavelengths untouched
    low = wavelen > 8192 / 1  # long wavelengths divided by the factor
    assert torch.equal(scaled[high], base[high])
    assert torch.allclose(scaled[low], base[low] / 8)
    mid = ~(high | low)
    assert mid.any() and bool(((scaled[mid] < base[mid]) & (scaled[mid] > base[mid] / 8)).all())


def test_rope_rotates_pairs_and_preserves_norm():
    args = flavor_args("tiny")
    cache = rope_cache(args)
    x = torch.randn(1, 5, 2, args.head_dim)
    y = apply_rope(x, cache[:5])
    assert torch.allclose(y[:, 0], x[:, 0])  # position 0 is the identity
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    angle = cache[3, 0]
    x0, x1 = x[0, 3, 0, 0], x[0, 3, 0, 1]
    assert torch.allclose(y[0, 3, 0, :2], torch.stack([x0 * angle[0] - x1 * angle[1], x0 * angle[1] + x1 * angle[0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_complex_rope_equals_real_pairs_forward_and_backward(dtype):
    """Eager RoPE is one complex multiplication; compiled RoPE the real-pair arithmetic: the same numbers."""
    cache = rope_cache(flavor_args("tiny"))
    x = torch.randn(2, 7, 3, 16, dtype=dtype)
    grad = torch.randn(2, 7, 3, 16, dtype=dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = apply_rope(a, cache[:7]), apply_rope_real_pairs(b, cache[:7])
    ya.backward(grad)
    yb.backward(grad)
    assert ya.dtype == dtype
    torch.testing.assert_close(ya, yb, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-6)


def test_init_depends_only_on_seed_and_name():
    a, b = Llama(flavor_args("tiny")), Llama(flavor_args("tiny"))
    torch.manual_seed(123)
    a.init_weights(seed=7)
    torch.manual_seed(456)
    b.init_weights(seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    c = Llama(flavor_args("tiny"))
    c.init_weights(seed=8)
    assert not torch.equal(c.output.weight, a.output.weight)


def test_causal_logits_do_not_see_the_future():
    model = Llama(flavor_args("tiny"))
    model.init_weights(seed=0)
    tokens = torch.randint(0, 2048, (1, 16))
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 2048
    assert torch.allclose(model(tokens)[0, :10], model(changed)[0, :10], atol=1e-6)
    assert not torch.allclose(model(tokens)[0, 10:], model(changed)[0, 10:])


def test_tied_embeddings_share_one_tensor():
    with torch.device("meta"):
        model = Llama(flavor_args("1B"))
    assert model.output.weight is model.tok_embeddings.weight
    assert all(f in FLAVORS for f in ("debugmodel", "1B", "3B", "8B", "70B", "405B", "smollm2_135M", "llama2_7B"))


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
def test_grouped_attention_shares_each_kv_head_with_consecutive_query_heads(monkeypatch, masked):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 8, 4, generator=gen)
    k, v = torch.randn(2, 2, 8, 4, generator=gen), torch.randn(2, 2, 8, 4, generator=gen)
    mask = (torch.rand(8, 8, generator=gen) > 0.3) | torch.eye(8, dtype=torch.bool)  # every query sees some key
    kwargs = dict(attn_mask=mask) if masked else dict(is_causal=True)
    expanded = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), **kwargs)
    assert torch.allclose(grouped_attention(q, k, v, **kwargs), expanded, atol=1e-6)
    # The explicit expansion taken where no fused kernel reads GQA (e.g. masked fp32 on CUDA).
    monkeypatch.setattr(sdpa, "_fused_kernel_takes_gqa", lambda *a: False)
    assert torch.equal(grouped_attention(q, k, v, **kwargs), expanded)


def test_cpu_rms_norm_matches_torch_values_and_gradients():
    """The model's eager CPU RMSNorm (a two-pass autograd function) against torch's F.rms_norm, and gradcheck."""
    from titan_lite.models.parts.norms import RMSNorm, _RMSNormFunction

    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 7, 64, requires_grad=True)
    grad = torch.randn(3, 7, 64)
    ours = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    out_ref = F.rms_norm(x, [64], norm.weight, 1e-5)
    ref = torch.autograd.grad(out_ref, (x, norm.weight), grad)
    torch.testing.assert_close(norm(x), out_ref)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b)
    norm.weight.requires_grad_(False)  # frozen (LoRA): only the input's gradient
    (dx,) = torch.autograd.grad(norm(x), (x,), grad)
    torch.testing.assert_close(dx, ref[0])
    x64 = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFunction.apply(a, b, 1e-6), (x64, w64))
