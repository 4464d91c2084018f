"""lora.keep_sparsity in-process: the masked update W + (s B A) * (W != 0) on every forward path (fused eager,
autograd, DoRA, dropout, compile) against the formula, merged logits equal the unmerged model's (fp32, 1e-5) with the
base's N:M zeros kept, and the refusals."""

import pytest
import torch

from tests.test_lora import LORA, TINY, TOKENS, single_process_group  # noqa: F401  (autouse fixture)
from titan_lite.config import parse_args
from titan_lite.errors import ConfigError
from titan_lite.job.assembly import assemble_model
from titan_lite.job.plan import plan_job
from titan_lite.models.decoder import Llama
from titan_lite.models.parameters import canonical_name
from titan_lite.transforms.lora import LoRALinear
from titan_lite.transforms.lora.sparse import _MaskedLoRAProduct, check_base_sparsity
from titan_lite.transforms.lora.transform import lora_modules


def two_of_four(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A random 2:4 keep-mask: two kept entries in every group of four inputs."""
    scores = torch.rand(shape[0], shape[1] // 4, 4, generator=torch.Generator().manual_seed(seed))
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(2, dim=-1).indices, True)
    return keep.reshape(shape)


def masked_module(dora: bool = False, dropout: float = 0.0, dtype=torch.float32) -> LoRALinear:
    torch.manual_seed(0)
    module = LoRALinear(32, 24, rank=4, scale=2.5, dora=dora, dropout=dropout, keep_sparsity=True).to(dtype)
    with torch.no_grad():
        for p in (module.weight, module.lora_a, module.lora_b):
            torch.nn.init.normal_(p)
        module.weight.mul_(two_of_four((24, 32), 1))
        if dora:
            module.magnitude.uniform_(0.5, 1.5)
    return module


def formula(module: LoRALinear, x: torch.Tensor, dropped: torch.Tensor | None = None) -> torch.Tensor:
    """The masked adapter written out with plain autograd ops."""
    w = module.weight
    update = module.scale * (module.lora_b @ module.lora_a) * (w != 0)
    if module.magnitude is None:
        return x @ w.T + (x if dropped is None else dropped) @ update.T
    gain = module.magnitude / torch.linalg.vector_norm(w + update, dim=1).detach()
    return gain * (x @ (w + update).T)


def grads(out: torch.Tensor, inputs: tuple, grad: torch.Tensor) -> tuple:
    return torch.autograd.grad(out, inputs, grad)


def test_masked_product_passes_gradcheck_with_and_without_a_dropout_input():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    dropped = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(6, 8, dtype=torch.float64) * two_of_four((6, 8), 2)).requires_grad_()
    lora_a = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    lora_b = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    for d in (None, dropped):
        # The weight's zeros must stay zero under finite differences: gradcheck the adapters and inputs only.
        assert torch.autograd.gradcheck(lambda x, d, a, b: _MaskedLoRAProduct.apply(x, d, weight.detach(), a, b, 1.5),
                                        (x, d, lora_a, lora_b))
    out = _MaskedLoRAProduct.apply(x, None, weight, lora_a, lora_b, 1.5)
    expected = x @ weight.T + x @ (1.5 * (lora_b @ lora_a) * (weight != 0)).T
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), weight), torch.autograd.grad(expected.sum(), weight))


@pytest.mark.parametrize("path", ["fused", "autocast", "dora", "dropout", "compile", "base_linear"])
def test_every_forward_path_equals_the_masked_formula_with_gradients(path):
    module = masked_module(dora=path == "dora", dropout=0.3 if path == "dropout" else 0.0)
    x = torch.randn(3, 5, 32, requires_grad=True)
    grad = torch.randn(3, 5, 24)
    trained = (x, module.lora_a, module.lora_b) + ((module.magnitude,) if module.dora else ())
    if path == "base_linear":  # another transform's base product (float8's hook): the masked update added apart
        module.base_linear = lambda inputs, weight: torch.nn.functional.linear(inputs, weight)
    if path == "dropout":
        torch.manual_seed(7)
        out = module(x)
        torch.manual_seed(7)
        expected = formula(module, x, module.dropout(x))
    elif path == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = module(x)
        assert out.dtype == torch.bfloat16
        expected = formula(module, x)
        torch.testing.assert_close(out.float(), expected, atol=0.5, rtol=0.05)
        return
    else:
        forward = torch.compile(module, backend="aot_eager", fullgraph=True) if path == "compile" else module
        out = forward(x)
        expected = formula(module, x)
    torch.testing.assert_close(out, expected)
    for a, b in zip(grads(out, trained, grad), grads(expected, trained, grad), strict=True):
        torch.testing.assert_close(a, b)


def test_the_fused_path_saves_no_dense_update_for_the_backward():
    """Only the weight itself of [out, in] shape is kept (under FSDP a saved dense update would pin a full copy of
    every gathered weight until the backward)."""
    module = masked_module()
    x = torch.randn(4, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        module(x)
    assert saved and not [t for t in saved if t.shape == module.weight.shape
                          and t.data_ptr() != module.weight.data_ptr()]


@pytest.mark.parametrize("variant", [[], ["--lora.use_rslora"], ["--lora.use_dora"]], ids=["lora", "rslora", "dora"])
def test_merged_logits_equal_the_unmerged_masked_model_and_keep_the_zeros(variant):
    """A 2:4-pruned base (the prune transform, keep_sparsity auto) with a trained-looking adapter: the merge (the
    run's HF export path) equals the adapted model's logits in fp32 within 1e-5 and has exactly the base's zeros."""
    plan = plan_job(parse_args([*TINY, *LORA, *variant, "--model.converters", "prune,lora", "--pruning.method",
                                "magnitude", "--pruning.pattern", "2:4"]), 1)
    model = assemble_model(plan, torch.device("cpu")).parts[0].eval()
    modules = lora_modules([model])
    with torch.no_grad():
        for i, (_, module) in enumerate(modules):
            module.lora_b.normal_(0, 0.05, generator=torch.Generator().manual_seed(i))
            if module.dora:
                module.magnitude.copy_(torch.linalg.vector_norm(module.weight, dim=1) * 1.2)
        adapted = model(TOKENS)
    state = {canonical_name(n): p.detach() for n, p in model.named_parameters()}
    merged, args = plan.transforms.export_state_dict(dict(state), plan.model_args)
    plain = Llama(args).eval()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(TOKENS), adapted, atol=1e-5, rtol=0)
    for name, _ in modules:
        base, out = state[f"{name}.weight"], merged[f"{name}.weight"]
        assert torch.equal(out == 0, base == 0), name
        assert ((out == 0).view(out.shape[0], -1, 4).sum(-1) == 2).all(), name
        assert not torch.equal(out, base), name


@pytest.mark.parametrize("overrides, message", [
    (["--model.converters", "prune,lora", "--lora.init", "pissa"], "cannot follow 'prune'"),
    (["--lora.keep_sparsity", "on", "--lora.init", "pissa", "--checkpoint.initial_load_path", "x"],
     "'lora.keep_sparsity' = 'on' cannot go with 'lora.init' = 'pissa'"),
    (["--lora.keep_sparsity", "on"], "'lora.keep_sparsity' = 'on' needs a pruned base"),
    (["--model.converters", "prune,lora", "--lora.base_dtype", "nf4"],
     "'lora.keep_sparsity' = 'auto' cannot go with 'lora.base_dtype' = 'nf4'"),
    (["--lora.keep_sparsity", "sometimes"], "'lora.keep_sparsity' = 'sometimes' is not one of: auto, on, off"),
])
def test_refusals_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        plan_job(parse_args([*TINY, *LORA, *overrides]), 1)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_dense_base_has_no_masks_to_keep():
    module = masked_module()
    with torch.no_grad():
        module.weight.normal_()
    with pytest.raises(ConfigError, match="hold no zeros: there are no masks to keep"):
        check_base_sparsity([("layers.0.attention.wq", module)], "on")


def test_auto_follows_the_prune_transform():
    def flags(*overrides):
        plan = plan_job(parse_args([*TINY, *overrides]), 1)
        return {t.name: getattr(t, "keep_sparsity", None) for t in plan.transforms}
    assert flags(*LORA) == {"lora": False}
    assert flags(*LORA, "--model.converters", "prune,lora")["lora"] is True
    assert flags(*LORA, "--model.converters", "prune,lora", "--lora.keep_sparsity", "off")["lora"] is False
