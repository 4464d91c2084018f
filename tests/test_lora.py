"""LoRA in-process: scales, init equals the base, PiSSA's factorisation, merging, re-factoring, what trains and what
the optimizer holds after real steps, and the config refusals."""

import math

import pytest
import torch
import torch.distributed as dist

from titan_lite.config import parse_args
from titan_lite.errors import ConfigError
from titan_lite.job.assembly import assemble_model
from titan_lite.job.plan import plan_job
from titan_lite.models.decoder import Llama
from titan_lite.models.parameters import canonical_name
from titan_lite.train import Trainer
from titan_lite.transforms.lora import LoRALinear
from titan_lite.transforms.lora.adapters import merge_adapters
from titan_lite.transforms.lora.module import _LoRAProduct, adapter_scale, balanced_factors, principal_factors
from titan_lite.transforms.lora.options import AdapterSpec
from titan_lite.transforms.lora.transform import lora_modules
from titan_lite.transforms.lora.weights import restart_optimizer_state

TINY = ["--model.flavor", "tiny", "--training.seq_len", "32"]
LORA = ["--model.converters", "lora", "--lora.rank", "4", "--lora.alpha", "8"]
TOKENS = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_name(n): p for n, p in model.named_parameters()}


def build(*overrides: str) -> torch.nn.Module:
    """The tiny model through the trainer's assembly (no process group), seed 0, eval mode."""
    plan = plan_job(parse_args([*TINY, *overrides]), 1)
    return assemble_model(plan, torch.device("cpu")).parts[0].eval()


@pytest.fixture(scope="module")
def base_logits() -> torch.Tensor:
    with torch.no_grad():
        return build()(TOKENS)


def test_scales():
    assert adapter_scale(32, 64, rslora=True) == pytest.approx(11.3137085, abs=1e-7)
    assert adapter_scale(32, 64, rslora=False) == 2.0
    model = build(*LORA, "--lora.rank", "32", "--lora.alpha", "64", "--lora.use_rslora")
    assert {m.scale for _, m in lora_modules([model])} == {64 / math.sqrt(32)}


@pytest.mark.parametrize("options", [[], ["--lora.init", "gaussian"], ["--lora.use_dora"]],
                         ids=["default", "gaussian", "dora"])
def test_lora_at_init_is_the_base_model(options, base_logits):
    model = build(*LORA, *options)
    assert len(lora_modules([model])) == 4 * 7
    with torch.no_grad():
        assert torch.allclose(model(TOKENS), base_logits, rtol=0, atol=1e-6)


def test_pissa_factorises_the_weight_exactly(base_logits):
    plain = build()
    model = build(*LORA, "--lora.init", "pissa", "--lora.use_rslora")
    for name, module in lora_modules([model]):
        w = params(plain)[f"{name}.weight"].detach()
        rebuilt = module.weight + module.scale * module.lora_b @ module.lora_a
        assert ((rebuilt - w).abs().max() / w.abs().max()).item() < 1e-5, name
        u, s, vh = torch.linalg.svd(w)
        top = u[:, :4] * s[:4] @ vh[:4]
        assert torch.allclose(module.scale * module.lora_b @ module.lora_a, top, atol=1e-5)
        assert torch.allclose(module.lora_a.norm(dim=1) ** 2, s[:4] / module.scale, rtol=1e-4)
        assert torch.equal(module.pissa_a0, module.lora_a) and torch.equal(module.pissa_b0, module.lora_b)
    with torch.no_grad():
        assert torch.allclose(model(TOKENS), base_logits, atol=1e-5)


def test_randomized_pissa_is_seeded_and_exact_in_sum():
    gen = torch.Generator().manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(48, 48, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(64, 48, generator=gen))
    w = u * 0.7 ** torch.arange(48.0) @ v.T  # a decaying spectrum, like trained weights
    a1, b1 = principal_factors(w, 8, 1.5, niter=4, generator=torch.Generator().manual_seed(5))
    a2, b2 = principal_factors(w, 8, 1.5, niter=4, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    exact_a, exact_b = principal_factors(w, 8, 1.5)
    assert torch.allclose(b1 @ a1, exact_b @ exact_a, atol=1e-3)


def test_merged_logits_equal_the_adapted_model():
    plan = plan_job(parse_args([*TINY, *LORA, "--lora.use_dora", "--lora.use_rslora", "--lora.rank_pattern", "w2=2",
                                "--lora.alpha_pattern", "wq=3"]), 1)
    model = assemble_model(plan, torch.device("cpu")).parts[0].eval()
    with torch.no_grad():
        for _, module in lora_modules([model]):  # a trained-looking adapter
            module.lora_b.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
            module.magnitude.mul_(1.2)
        adapted = model(TOKENS)
    merged_sd, args = plan.transforms.export_state_dict({n: p.detach() for n, p in params(model).items()},
                                                        plan.model_args)
    plain = Llama(args).eval()
    plain.load_state_dict(merged_sd)
    with torch.no_grad():
        assert not torch.allclose(plain(TOKENS), build()(TOKENS), atol=1e-3)
        assert torch.allclose(plain(TOKENS), adapted, atol=1e-5)


def test_merge_adapters_drops_every_adapter_tensor():
    model = build(*LORA, "--lora.init", "pissa")
    specs = {name: AdapterSpec(m.rank, 8.0, m.scale) for name, m in lora_modules([model])}
    merged = merge_adapters({n: p.detach() for n, p in params(model).items()}, specs)
    assert set(merged) == set(params(build()))


def test_balanced_factors_keep_the_product_and_balance_it():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 40, generator=gen) * 3, torch.randn(24, 4, generator=gen) * 0.1
    a2, b2 = balanced_factors(a, b)
    assert torch.allclose(b2 @ a2, b @ a, atol=1e-5)
    assert torch.allclose(a2 @ a2.T, b2.T @ b2, atol=1e-5)  # both factors carry sqrt of the singular values
    top = torch.linalg.svdvals(b @ a)[0].item()
    a3, b3 = balanced_factors(a, b, max_singular_value=top / 2)
    assert torch.linalg.svdvals(b3 @ a3)[0].item() == pytest.approx(top / 2, rel=1e-4)


# ------------------------------------------------------------------------------------------ training in-process


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Trainer, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Three real steps of a PiSSA + DoRA + rsLoRA run with one re-factoring (step 2); the state before and after."""
    folder = tmp_path_factory.mktemp("lora_train")
    cfg = parse_args(["--job.config_file", "tests/integration/base.toml", "--job.dump_folder", str(folder),
                      "--training.local_batch_size", "2", "--training.seq_len", "32", *LORA, "--lora.init", "pissa",
                      "--lora.use_dora", "--lora.use_rslora", "--lora.refactor_freq", "2",
                      "--metrics.enable_tensorboard=false"])
    trainer = Trainer(cfg)
    model = trainer.model_parts[0]
    before = {n: p.detach().clone() for n, p in params(model).items()}
    data = iter(trainer.dataloader)
    grads = {}
    for step in (1, 2, 3):
        original_step = trainer.optimizer.step

        def capture(*args, _step=original_step, **kwargs):
            grads.update({n: p.grad for n, p in params(model).items()})
            return _step(*args, **kwargs)
        trainer.optimizer.step = capture
        trainer.train_step(trainer.next_microbatches(data), step=step)
        trainer.optimizer.step = original_step
    return trainer, before, grads


def test_only_adapters_train_and_hold_optimizer_state(trained):
    trainer, before, grads = trained
    named = params(trainer.model_parts[0])
    adapters = {n for n in named if n.rsplit(".", 1)[1] in ("lora_a", "lora_b", "magnitude")}
    assert {n for n, p in named.items() if p.requires_grad} == adapters
    assert {n for n, g in grads.items() if g is not None} == adapters  # no gradient is computed for frozen weights
    held = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert held == {id(named[n]) for n in adapters}
    assert {id(p) for p in trainer.optimizer.state} == held
    for name, value in named.items():
        if name in adapters:
            assert not torch.equal(value, before[name]), name
        else:
            assert torch.equal(value, before[name]), name  # frozen weights bitwise unchanged


def test_refactoring_kept_the_product_and_restarted_the_state(trained):
    trainer, _, _ = trained
    module = lora_modules(trainer.model_parts)[0][1]
    state = trainer.optimizer.state[module.lora_a]
    assert int(state["step"]) == 1  # restarted after step 2, stepped once since
    a, b = module.lora_a.detach(), module.lora_b.detach()
    restart_optimizer_state(trainer.optimizer, [module.lora_a])
    assert int(state["step"]) == 0 and state["exp_avg"].abs().sum() == 0
    assert torch.linalg.matrix_rank(b @ a) <= 4


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("overrides, message", [
    (["--lora.init", "pissa_niter_x"], "'lora.init' = 'pissa_niter_x' is not one of"),
    (["--lora.rank", "0"], "'lora.rank' must be at least 1"),
    (["--lora.target_modules", "q_proj,lm_head"], "'lora.target_modules' has unknown module 'lm_head'"),
    (["--lora.train_modules", "wq"], "'lora.train_modules' has 'wq', which 'lora.target_modules' already adapts"),
    (["--lora.rank_pattern", "nothing_here=4"], "'lora.rank_pattern' entry 'nothing_here=4' matches no adapted module"),
    (["--lora.rank_pattern", "q_proj"], "is not 'regex=value'"),
    (["--lora.max_spectral_norm", "1.0"], "'lora.max_spectral_norm' = 1.0 needs"),
    (["--lora.init", "pissa", "--lora.rank", "65"], "needs rank <= min(in, out)"),
    (["--lora.dropout", "0.1", "--activation_checkpoint.mode", "full"], "'activation_checkpoint.preserve_rng_state'"),
    (["--lora.base_dtype", "bfloat16"], "'lora.base_dtype' = 'bfloat16' with float32 compute"),
    (["--model.flavor", "smollm2_135M", "--lora.train_modules", "lm_head"], "ties its embeddings"),
])
def test_refusals_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        plan_job(parse_args([*TINY, *LORA, *overrides]), 1)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_lora_linear_repr_and_shapes():
    module = LoRALinear(16, 8, rank=2, scale=1.0, dora=True)
    assert module.lora_a.shape == (2, 16) and module.lora_b.shape == (8, 2) and module.magnitude.shape == (8,)
    assert "rank=2" in repr(module) and not module.weight.requires_grad


def test_lora_product_gradients_pass_gradcheck_with_and_without_a_separate_dropout_input():
    """The one-node forward/backward of the eager path, in float64 against finite differences: every input's
    gradient (the base weight's too, for a caller that trains it), with the adapter reading x itself or a dropped
    copy of it, and with x needing no gradient (the first layer of a frozen model)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    dropped = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    lora_a = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    lora_b = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: _LoRAProduct.apply(*t, 1.5), (x, None, weight, lora_a, lora_b))
    assert torch.autograd.gradcheck(lambda *t: _LoRAProduct.apply(*t, 1.5), (x, dropped, weight, lora_a, lora_b))
    out = _LoRAProduct.apply(x.detach(), None, weight.detach(), lora_a, lora_b, 1.5)
    grad_a, grad_b = torch.autograd.grad(out.sum(), (lora_a, lora_b))
    expected = x.detach() @ weight.detach().T + 1.5 * (x.detach() @ lora_a.T) @ lora_b.T
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close((grad_a, grad_b), torch.autograd.grad(expected.sum(), (lora_a, lora_b)))


def test_lora_linear_equals_w_x_plus_scaled_b_a_x_with_gradients():
    """The fused forward (the update accumulated into W x by one addmm_) against the formula written out, in fp32 and
    under CPU bf16 autocast (the products in bf16, the parameters fp32)."""
    torch.manual_seed(0)
    module = LoRALinear(32, 24, rank=4, scale=2.5)
    for p in (module.weight, module.lora_a, module.lora_b):
        torch.nn.init.normal_(p)
    x = torch.randn(3, 5, 32, requires_grad=True)
    grad = torch.randn(3, 5, 24)
    out = module(x)
    got = torch.autograd.grad(out, (x, module.lora_a, module.lora_b), grad)
    expected_out = x @ module.weight.T + 2.5 * (x @ module.lora_a.T) @ module.lora_b.T
    expected = torch.autograd.grad(expected_out, (x, module.lora_a, module.lora_b), grad)
    assert out.shape == (3, 5, 24)
    torch.testing.assert_close(out, expected_out)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = module(x)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), expected_out, atol=0.5, rtol=0.05)
    low.float().sum().backward()
    assert module.lora_b.grad.dtype == torch.float32 and module.lora_b.grad.abs().sum() > 0
