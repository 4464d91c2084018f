"""The 'quantize.linear.float8' transform on tiny models: which linears it converts and why it keeps the others, the
refusals before launch, the TP plan's float8 styles, a LoRA base in float8, and the byte all-gather's collective."""

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from titan_lite.config import parse_args, validate
from titan_lite.errors import ConfigError
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.tensor_parallel import block_plan
from titan_lite.transforms import build_transforms
from titan_lite.transforms.float8 import options as float8_options
from titan_lite.transforms.float8 import transform as float8_transform
from titan_lite.transforms.lora.module import LoRALinear

F8 = "quantize.linear.float8"


def config(*extra: str):
    cfg = parse_args(["--model.converters", F8, *extra])
    validate(cfg)
    return cfg


def converted(cfg, args=None):
    (transform,) = build_transforms(cfg)
    with torch.device("meta"):
        model = Llama(args or flavor_args("tiny"))
    transform.convert(model)
    return transform, model


def float8_names(model: nn.Module) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def summary(transform, caplog) -> list[str]:
    with caplog.at_level(logging.INFO, logger="titan_lite"):
        transform.after_load(None)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(F8)]


def test_converts_every_block_linear_and_leaves_the_head_by_default(caplog):
    transform, model = converted(config())
    assert len(float8_names(model)) == 4 * 7 and "output" not in float8_names(model)
    lines = summary(transform, caplog)
    assert lines[0] == f"{F8}: 28 linear(s) in float8 (tensorwise, emulated)"
    assert lines[1] == f"{F8}: 1 linear(s) left in high precision: output (filter_fqns)"
    assert "on CPU the float8 matmul is emulated" in lines[2] and len(lines) == 3


def test_shapes_float8_cannot_serve_stay_high_precision_and_are_listed_once(caplog):
    """ffn 200 is not a multiple of 16: w1/w2/w3 stay nn.Linear; filter_fqns matches substrings, as in torchtitan."""
    args = dataclasses.replace(flavor_args("tiny"), ffn_dim=200, n_layers=2)
    transform, model = converted(config(f"--{F8}.filter_fqns", "output,layers.1.attention.wo"), args)
    assert sorted(n.split(".", 2)[2] for n in float8_names(model) if n.startswith("layers.0")) == [
        "attention.wk", "attention.wo", "attention.wq", "attention.wv"]
    assert "layers.1.attention.wo" not in float8_names(model)
    assert type(model.layers["0"].feed_forward.w1) is nn.Linear
    lines = summary(transform, caplog)
    assert lines[1].startswith(f"{F8}: 8 linear(s) left in high precision: layers.0.feed_forward.w1 (200x64 is not "
                               "a multiple of 16); ")
    assert "layers.1.attention.wo (filter_fqns)" in lines[1] and "output (filter_fqns)" in lines[1]


def test_tensor_parallel_shards_count_toward_the_shapes():
    """tiny's wk has 32 outputs: 16 per rank under TP 2, 8 under TP 4 (not servable)."""
    _, model = converted(config("--parallelism.tensor_parallel_degree", "4"))
    assert "layers.0.attention.wk" not in float8_names(model) and "layers.0.attention.wq" in float8_names(model)


@pytest.mark.parametrize("extra, message", [
    ([f"--{F8}.recipe_name", "rowwise", f"--{F8}.enable_fsdp_float8_all_gather"],
     f"'{F8}.enable_fsdp_float8_all_gather' needs recipe_name 'tensorwise' (the weight is cast with one scale "
     "before the all-gather), but recipe_name is 'rowwise'"),
    ([f"--{F8}.precompute_float8_dynamic_scale_for_fsdp"],
     f"'{F8}.precompute_float8_dynamic_scale_for_fsdp' precomputes the scales of the float8 all-gather: set "
     f"'{F8}.enable_fsdp_float8_all_gather' too"),
])
def test_combinations_torchao_cannot_serve_are_one_line(extra, message):
    (transform,) = build_transforms(config(*extra))
    with pytest.raises(ConfigError) as exc:
        transform.check(flavor_args("tiny"), ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1))
    assert str(exc.value) == message


def test_qlora_base_is_refused():
    cfg = parse_args(["--model.converters", f"lora,{F8}", "--lora.base_dtype", "nf4"])
    validate(cfg)
    (_, transform) = build_transforms(cfg)
    with pytest.raises(ConfigError) as exc:
        transform.check(flavor_args("tiny"), ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, world_size=1))
    assert str(exc.value) == (f"'{F8}' cannot convert an NF4 base ('lora.base_dtype' = 'nf4', QLoRA): an NF4 weight "
                              "has no float8 path; use one of the two")


def test_gpus_without_float8_are_refused_unless_emulated(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    cfg = config()
    with pytest.raises(ConfigError) as exc:
        float8_options.check_options(cfg, float8_options.Float8Options.from_config(cfg), None, "cuda")
    assert str(exc.value) == (f"'{F8}' needs a GPU with float8 (compute capability 8.9 or above), this one has 8.0; "
                              f"set '{F8}.emulate' to emulate float8 (for correctness, not speed)")
    emulated = config(f"--{F8}.emulate")
    float8_options.check_options(emulated, float8_options.Float8Options.from_config(emulated), None, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    float8_options.check_options(cfg, float8_options.Float8Options.from_config(cfg), None, "cuda")
    assert float8_options.Float8Options.from_config(cfg).torchao_config("cuda").emulate is False
    assert float8_options.Float8Options.from_config(cfg).torchao_config("cpu").emulate is True


def test_tp_plan_uses_torchaos_float8_styles_on_float8_backends(monkeypatch):
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    monkeypatch.setattr(float8_transform, "device_type", lambda: "cuda")
    transform, _ = converted(config(f"--{F8}.emulate", f"--{F8}.filter_fqns", "output,feed_forward.w3"))
    plan = transform.tp_plan(block_plan(), "block")
    assert type(plan["attention.wq"]) is Float8ColwiseParallel and type(plan["attention.wo"]) is Float8RowwiseParallel
    assert type(plan["attention"]) is PrepareFloat8ModuleInput
    # w3 stays high precision, so the MLP's input is gathered in high precision for w1 and w3 alike
    assert type(plan["feed_forward.w3"]) is ColwiseParallel and type(plan["feed_forward"]) is PrepareModuleInput
    assert type(plan["feed_forward.w1"]) is Float8ColwiseParallel
    rowwise, _ = converted(config(f"--{F8}.recipe_name", "rowwise"))
    assert {type(s) for k, s in rowwise.tp_plan(block_plan(), "block").items() if "." in k} == {
        ColwiseParallel, RowwiseParallel}
    monkeypatch.undo()
    on_cpu, _ = converted(config())  # gloo has no float8 dtype: plain styles, the same global scales
    assert type(on_cpu.tp_plan(block_plan(), "block")["attention.wq"]) is ColwiseParallel


def test_a_lora_base_computes_in_float8():
    """LoRA listed first: its frozen base product runs through torchao's float8 linear (emulated), the adapters in
    high precision; the result is the float8 rounding of the exact product, not the exact product."""
    cfg = config(f"--{F8}.filter_fqns", "output")
    cfg.model.converters = ["lora", F8]
    transforms = build_transforms(cfg)
    with torch.device("meta"):
        model = Llama(flavor_args("tiny"))
    for t in transforms:
        t.convert(model)
    lora = model.layers["0"].attention.wq
    assert isinstance(lora, LoRALinear) and lora.base_linear is not None
    with torch.device("cpu"):
        real = LoRALinear(64, 64, rank=4, scale=2.0)
    gen = torch.Generator().manual_seed(0)
    for p in real.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    x = torch.randn(8, 64, generator=gen)
    exact = real(x)
    real.base_linear = lora.base_linear
    got = real(x)
    base = F.linear(x, real.weight)
    assert 1e-3 < (got - exact).abs().max() / base.abs().max() < 0.1  # e4m3 has a 3-bit mantissa
    got.sum().backward()
    assert real.lora_a.grad is not None and real.weight.grad is None


def test_byte_all_gather_moves_float8_as_uint8():
    from titan_lite.transforms.float8.comms import as_bytes

    x = torch.randn(16).to(torch.float8_e4m3fn)
    assert as_bytes(x).dtype == torch.uint8 and as_bytes(x).data_ptr() == x.data_ptr()
    assert as_bytes(torch.ones(3)).dtype == torch.float32


def test_plan_counts_float8_all_gather_and_casts():
    transform, model = converted(config(f"--{F8}.enable_fsdp_float8_all_gather"))
    weight = model.layers["0"].attention.wq.weight
    assert transform.gathered_bytes("layers.0.attention.wq.weight", weight) == 1.0
    assert transform.gathered_bytes("output.weight", model.output.weight) is None
    assert transform.plan_lines(flavor_args("tiny"))[0] == (
        f"{F8}: 28 linear(s) in float8 (tensorwise, float8 all-gather)")



@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_each_recipe_trains_close_to_fp32(recipe):
    """The converted tiny model (emulated on CPU) against the same weights in fp32: logits within float8's rounding,
    and every float8 weight gets a gradient."""
    (transform,) = build_transforms(config(f"--{F8}.recipe_name", recipe))
    reference, model = Llama(flavor_args("tiny")), Llama(flavor_args("tiny"))
    reference.init_weights(seed=3)
    transform.convert(model)
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    expected, got = reference(tokens), model(tokens)
    error = (got - expected).norm() / expected.norm()
    assert 1e-4 < error < 0.05, error  # float8 (e4m3: 3 mantissa bits) differs, but little
    got.float().logsumexp(-1).mean().backward()
    assert all(model.get_submodule(n).weight.grad is not None for n in float8_names(model))


FAMILY_OPTIONS = ("bias", "q_norm.weight", "k_norm.weight")


@pytest.mark.parametrize("flavor", ["tiny_qwen2", "tiny_qwen3", "tiny_gemma3"])
def test_family_blocks_convert_with_their_biases_and_train_close_to_fp32(flavor):
    """q/k/v biases (Qwen2.5) stay on their Float8Linear, in high precision; the q/k norms (Qwen3) are not linears
    and stay as they are. The float8 model is within float8's rounding of fp32; one with the biases dropped or the
    norms reset is not. Gemma 3 (tiny_gemma3): its (1 + w) q/k norms alike, in blocks with sandwich norms."""
    (transform,) = build_transforms(config())
    reference, model, wrong = (Llama(flavor_args(flavor)) for _ in range(3))
    reference.init_weights(seed=3)
    with torch.no_grad():
        for name, p in reference.named_parameters():  # biases and norm weights far from their init (0, 1)
            if name.endswith(FAMILY_OPTIONS):
                p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    transform.convert(model)
    model.load_state_dict(reference.state_dict())
    wrong.load_state_dict(reference.state_dict())
    with torch.no_grad():
        for name, p in wrong.named_parameters():
            if name.endswith(FAMILY_OPTIONS):
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    assert len(float8_names(model)) == 4 * 7
    wq = model.layers["0"].attention.wq
    assert (wq.bias is not None) == (flavor == "tiny_qwen2") and (wq.bias is None or wq.bias.dtype == torch.float32)
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    expected, got, off = reference(tokens), model(tokens), wrong(tokens)
    error, wrong_error = (((logits - expected).norm() / expected.norm()).item() for logits in (got, off))
    assert 1e-4 < error < 0.02 < 0.04 < wrong_error, (error, wrong_error)
    got.float().logsumexp(-1).mean().backward()
    assert all(model.get_submodule(n).weight.grad is not None for n in float8_names(model))


def test_qwen3_5_blocks_convert_their_servable_deltanet_projections_and_train_close_to_fp32(caplog):
    """tiny_qwen3_5: every DeltaNet projection float8 serves (in_proj_qkv, in_proj_z, out_proj) and the gated
    attention's, the per-head in_proj_b / in_proj_a (4 rows) listed in high precision; within float8's rounding of
    fp32, gradients reaching every Float8Linear; the TP plans of both mixers take float8 styles for their linears."""
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from titan_lite.parallel.tensor_parallel import deltanet_plan
    from titan_lite.transforms.float8.tp import float8_block_plan

    (transform,) = build_transforms(config())
    reference, model = Llama(flavor_args("tiny_qwen3_5")), Llama(flavor_args("tiny_qwen3_5"))
    reference.init_weights(seed=3)
    with torch.no_grad():
        for name, p in reference.named_parameters():  # norms far from their (1 + w) default
            if name.endswith("norm.weight"):
                p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    transform.convert(model)
    model.load_state_dict(reference.state_dict())
    converted_names = {n.split(".", 2)[2] for n in float8_names(model)}
    assert converted_names == {"attention.in_proj_qkv", "attention.in_proj_z", "attention.out_proj", "attention.wq",
                               "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                               "feed_forward.w3"}
    assert len(float8_names(model)) == 3 * 6 + 7
    lines = summary(transform, caplog)
    assert "layers.0.attention.in_proj_b (4x64 is not a multiple of 16)" in lines[1]
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    expected, got = reference(tokens), model(tokens)
    error = ((got - expected).norm() / expected.norm()).item()
    assert 1e-4 < error < 0.02, error
    got.float().logsumexp(-1).mean().backward()
    assert all(model.get_submodule(n).weight.grad is not None for n in float8_names(model))
    # the CUDA plan (on CPU tp_plan keeps the plain styles, see its docstring)
    deltanet = float8_block_plan(deltanet_plan(), model)
    assert type(deltanet["attention.in_proj_qkv"]) is Float8ColwiseParallel
    assert type(deltanet["attention.out_proj"]) is Float8RowwiseParallel
    assert type(deltanet["attention.in_proj_b"]) is not Float8ColwiseParallel  # left in high precision
    attention = float8_block_plan(block_plan(qk_norm=True), model)
    assert type(attention["attention.wq"]) is Float8ColwiseParallel
