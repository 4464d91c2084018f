"""Sheared pruning: hard-concrete gates, the Lagrangian's ascent, the masked forward against the spec, convergence to
the targets in a short run, compile without graph breaks, and masks/gradients under TP and FSDP."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import spawn_gloo
from tests.sheared_parallel import all_targets, batch, parallel_worker, tiny_args
from titan_lite.checkpoint.hf import write_hf_folder
from titan_lite.config import parse_args, validate
from titan_lite.config.schema import Sheared
from titan_lite.errors import ConfigError
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.models.parameters import canonical_name
from titan_lite.models.parts.rope import apply_rope
from titan_lite.models.parts.sdpa import grouped_attention
from titan_lite.train import Trainer
from titan_lite.transforms.sheared import gates
from titan_lite.transforms.sheared.keep import final_masks, materialize_pruned
from titan_lite.transforms.sheared.modules import ShearedBlock, convert_model, hand_out_masks
from titan_lite.transforms.sheared.targets import Targets, targets_from_config
from titan_lite.transforms.sheared.transform import expected_param_count, expected_sparsity, lagrangian
from titan_lite.transforms.structured.materialize import param_count


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ gates


@pytest.mark.parametrize("log_alpha", [gates.LOG_ALPHA_MIN, -2.0, 0.0, 1.5, gates.LOG_ALPHA_MAX])
def test_prob_nonzero_closed_form_matches_monte_carlo(log_alpha):
    generator = torch.Generator().manual_seed(0)
    noise = gates.uniform_noise((1_000_000,), generator, torch.device("cpu"))
    z = gates.sample(torch.full((1,), log_alpha), noise)
    closed = gates.prob_nonzero(torch.tensor(log_alpha)).item()
    assert abs((z > 0).double().mean().item() - closed) < 0.002
    assert z.min() >= 0 and z.max() <= 1
    assert gates.NONZERO_OFFSET == pytest.approx(1.5986, abs=1e-4)


def test_init_is_clamped_and_keeps_almost_every_gate():
    model = converted(all_targets())
    for log_alpha in model.sheared_gates.log_alphas().values():
        assert torch.all(log_alpha == gates.LOG_ALPHA_MAX)
    assert gates.prob_nonzero(torch.tensor(gates.LOG_ALPHA_MAX)).item() == pytest.approx(0.998, abs=5e-4)
    assert torch.all(model.sheared_gates.lambdas == 0)


def test_lambda_ascends_while_the_constraint_is_violated_and_rests_at_the_target():
    targets = all_targets()
    log_alpha = torch.nn.Parameter(torch.full(targets.gate_shape("head"), 3.0))
    lambdas = torch.nn.Parameter(torch.zeros(4, 2))
    opt = torch.optim.AdamW([{"params": [lambdas], "lr": -0.1, "weight_decay": 0.0}], lr=0.1)
    penalties = []
    for _ in range(3):  # expected sparsity ~0.01 < target 0.5
        opt.zero_grad()
        penalty = lagrangian({"head": log_alpha}, lambdas, targets, 1.0)
        penalty.backward()
        assert lambdas.grad[1, 0] < 0  # d/d lambda1 = s - t < 0: descent would raise lambda1
        opt.step()
        penalties.append(penalty.item())
    assert lambdas[1, 0] < 0 and lambdas[1, 1] > 0  # ascent moved both up their gradients
    assert penalties[0] == 0 and penalties[0] < penalties[1] < penalties[2]
    # At the target (expected sparsity == ramped target) lambda1's gradient is zero.
    lambdas.grad = None
    at_target = expected_sparsity(log_alpha).mean().item() / targets.target_sparsity("head")
    lagrangian({"head": log_alpha}, lambdas, targets, at_target).backward()
    assert abs(lambdas.grad[1, 0].item()) < 1e-7 and abs(lambdas.grad[1, 1].item()) < 1e-12


# ----------------------------------------------------------------------------------- targets


def test_targets_from_sparsities_and_gqa_modes():
    t = all_targets()
    assert (t.layers, t.heads, t.kv_heads, t.dim, t.intermediate) == (3, 2, 2, 48, 96)
    assert t.gate_shape("head") == (4, 2) and t.target_sparsity("head") == 0.5  # one of 2 query slots per group
    k = all_targets("kv_group")
    assert (k.heads, k.kv_heads, k.gate_shape("head")) == (2, 1, (4, 2))
    llama8b = flavor_args("8B")
    w = targets_from_config(Sheared(layer_sparsity=0.2, head_sparsity=0.3, hidden_sparsity=0.1,
                                    intermediate_sparsity=0.4, target_tp_degree=2), llama8b)
    assert (w.layers, w.heads, w.kv_heads, w.dim, w.intermediate) == (26, 24, 8, 3686, 8602)


@pytest.mark.parametrize("overrides, message", [
    (dict(target_heads=3), "'sheared.target_heads' = 3 must be a multiple of the model's 2 KV heads"),
    (dict(target_heads=4, target_kv_heads=1, head_mode="kv_group"), "'sheared.target_heads' = 4 must be 2"),
    (dict(target_intermediate=95, target_tp_degree=2), "'sheared.target_tp_degree' = 2 must divide"),
    (dict(target_dim=65), "'sheared.target_dim' = 65 exceeds the model's 64"),
])
def test_bad_targets_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        targets_from_config(Sheared(**overrides), tiny_args())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args, message", [
    (["--sheared.head_sparsity", "1.2"], "'sheared.head_sparsity' must be in [0, 1)"),
    (["--sheared.head_mode", "rows"], "sheared.head_mode"),
    (["--sheared.target_kv_heads", "1"], "'sheared.target_kv_heads' = 1 needs 'sheared.head_mode' = 'kv_group'"),
    (["--sheared.lambda_lr", "0"], "'sheared.lambda_lr' must be positive"),
    (["--sheared.target_layers", "2", "--sheared.layer_sparsity", "0.5"], "contradicts 'sheared.target_layers'"),
])
def test_bad_config_values_are_refused_at_config_time(args, message):
    with pytest.raises(ConfigError) as err:
        validate(parse_args(["--model.converters", "sheared", *args]), files=False)
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------ masked forward


def converted(targets: Targets, seed: int = 0) -> Llama:
    model = Llama(targets.args)
    convert_model(model, targets, seed)
    model.init_weights(seed=0)
    with torch.no_grad():  # a family's q/k/v biases and q/k norms away from their init (zeros, ones)
        for name, param in model.named_parameters():
            if name.endswith((".bias", "q_norm.weight", "k_norm.weight")):
                param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    return model


def random_masks(targets: Targets, seed: int = 1) -> dict[str, torch.Tensor]:
    """Soft values in (0.3, 1] with about a third of every type at exactly zero (never a whole row)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for kind in targets.pruned:
        shape = targets.gate_shape(kind)
        z = torch.rand(shape, generator=generator) * 0.7 + 0.3
        z[torch.rand(shape, generator=generator) < 0.35] = 0.0
        z.reshape(-1, shape[-1])[:, 0] = 0.9  # keep one unit per row
        out[kind] = z
    return out


def unit_masks(targets: Targets, z: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    a = targets.args
    head = z["head"]
    head = head.repeat(1, a.kv_heads) if targets.head_mode == "per_group_query" else head.repeat_interleave(
        a.n_heads // a.kv_heads, dim=1)
    return {**z, "head": head}


def spec_forward(sd: dict[str, torch.Tensor], args, z: dict[str, torch.Tensor], tokens: torch.Tensor,
                 rope: torch.Tensor) -> torch.Tensor:
    """The masked forward of STRUCTURED_SPEC.md, written from the spec on the plain state dict."""
    hz = z["hidden"]

    def norm(x, weight):
        m = (hz != 0).float()
        var = (x * x * m).sum(-1, keepdim=True) / m.sum()
        return weight * x * torch.rsqrt(var + args.norm_eps) * hz

    hd, bsz, seq = args.head_dim, tokens.shape[0], tokens.shape[1]
    h = F.embedding(tokens, sd["tok_embeddings.weight"]) * hz
    for i in range(args.n_layers):
        p = f"layers.{i}."
        x = norm(h, sd[p + "attention_norm.weight"])
        q, k, v = (F.linear(x, sd[p + f"attention.{n}.weight"]).view(bsz, seq, -1, hd) for n in ("wq", "wk", "wv"))
        q, k = apply_rope(q, rope[:seq]), apply_rope(k, rope[:seq])
        a = grouped_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        a = (a.transpose(1, 2) * z["head"][i][:, None]).reshape(bsz, seq, -1)
        h = h + z["layer"][i] * (F.linear(a, sd[p + "attention.wo.weight"]) * hz)
        x = norm(h, sd[p + "ffn_norm.weight"])
        up = F.linear(x, sd[p + "feed_forward.w3.weight"]) * z["intermediate"][i]
        f = F.linear(F.silu(F.linear(x, sd[p + "feed_forward.w1.weight"])) * up, sd[p + "feed_forward.w2.weight"])
        h = h + z["layer"][i] * (f * hz)
    return F.linear(norm(h, sd["norm.weight"]), sd["output.weight"])


@pytest.mark.parametrize("head_mode", ["per_group_query", "kv_group"])
def test_masked_forward_is_the_spec(head_mode):
    targets = all_targets(head_mode)
    model = converted(targets)
    z = random_masks(targets)
    model.sheared_gates.fixed = z
    inputs, _ = batch()
    with torch.no_grad():
        logits = model(inputs)
        sd = {canonical_name(n): p for n, p in model.named_parameters()}
        expected = spec_forward(sd, targets.args, unit_masks(targets, z), inputs, model.rope_cache)
    assert (logits - expected).abs().max().item() < 1e-5


def test_ones_masks_give_the_plain_model():
    targets = all_targets()
    model, plain = converted(targets), Llama(tiny_args())
    plain.init_weights(seed=0)
    model.sheared_gates.fixed = {k: torch.ones(targets.gate_shape(k)) for k in targets.pruned}
    inputs, _ = batch()
    with torch.no_grad():
        assert (model(inputs) - plain(inputs)).abs().max().item() < 1e-5


def test_compiled_blocks_take_new_masks_without_graph_breaks_or_recompiles():
    from torch._dynamo.utils import counters  # test-only: dynamo's own counters

    torch._dynamo.reset()
    counters.clear()
    targets = all_targets()
    model = converted(targets)
    for key, block in list(model.layers.named_children()):
        model.layers.register_module(key, torch.compile(block, backend="aot_eager", fullgraph=True))
    model.train()
    with torch.no_grad():  # away from the clamp, where most samples are exactly 1 and carry no gradient
        model.sheared_gates.head_log_alpha.fill_(0.0)
    inputs, labels = batch()
    grads, graphs = [], []
    for step in (1, 2, 3):
        model.sheared_gates.draw_noise(step)
        model.zero_grad()
        F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
        grads.append(model.sheared_gates.head_log_alpha.grad.clone())
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [2, 2, 2]  # the first block (it masks the embeddings) and the others; none for new masks
    assert not counters["graph_break"]
    assert all(g.abs().sum() > 0 for g in grads) and not torch.equal(grads[0], grads[1])


# ----------------------------------------------------------------------------- convergence


def test_expected_sparsities_reach_the_targets_in_a_short_run(tmp_path):
    cfg = parse_args(["--job.config_file", "tests/integration/base.toml", "--job.dump_folder", str(tmp_path),
                      "--training.local_batch_size", "1", "--training.seq_len", "16", "--training.steps", "260",
                      "--training.max_norm", "0", "--metrics.enable_tensorboard=false", "--optimizer.lr", "1e-3",
                      "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0",
                      "--model.converters", "sheared", "--sheared.layer_sparsity", "0.25",
                      "--sheared.head_sparsity", "0.5", "--sheared.hidden_sparsity", "0.25",
                      "--sheared.intermediate_sparsity", "0.5", "--sheared.warmup_steps", "40",
                      "--sheared.mask_lr", "0.1", "--sheared.lambda_lr", "0.1"])
    trainer = Trainer(cfg)
    data = iter(trainer.dataloader)
    for step in range(1, 261):
        trainer.train_step(trainer.next_microbatches(data), step)
    m = trainer.transforms.metrics(trainer.model_parts)
    for kind, target in (("layer", 0.25), ("head", 0.5), ("hidden", 0.25), ("intermediate", 0.5)):
        assert m[f"sheared/target_{kind}"] == target
        assert abs(m[f"sheared/sparsity_{kind}"] - target) < 0.02, (kind, m[f"sheared/sparsity_{kind}"])
    assert m["sheared/expected_params"] == pytest.approx(m["sheared/target_params"], rel=0.1)


# -------------------------------------------------------------------------------- TP and FSDP


@pytest.fixture(scope="module")
def parallel_reports(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sheared_parallel")
    spawn_gloo(parallel_worker, 2, str(out))
    return {(name, rank): json.loads(Path(out, f"{name}.rank{rank}.json").read_text())
            for name in ("tp2", "fsdp2") for rank in range(2)}


def single_process_reference() -> dict:
    model = converted(all_targets())
    model.train()
    model.sheared_gates.draw_noise(3)
    inputs, labels = batch()
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    loss.backward()
    z = model.sheared_gates.unit_masks()
    return {"loss": loss.item(), "z": z,
            "grads": {k: v.grad.flatten() for k, v in model.sheared_gates.log_alphas().items()}}


def test_tp_ranks_share_the_masks_and_match_one_process(parallel_reports):
    ref = single_process_reference()
    r0, r1 = parallel_reports[("tp2", 0)], parallel_reports[("tp2", 1)]
    assert r0["hidden_z"] == r1["hidden_z"]
    assert torch.allclose(torch.tensor(r0["hidden_z"]), ref["z"]["hidden"], atol=1e-7)
    # Each rank holds its half of the heads and channels: together, the one-process masks of layer 1.
    assert torch.allclose(torch.tensor(r0["head_z"] + r1["head_z"]), ref["z"]["head"][1], atol=1e-7)
    assert torch.allclose(torch.tensor(r0["ffn_z"] + r1["ffn_z"]), ref["z"]["intermediate"][1], atol=1e-7)
    for report in (r0, r1):
        assert abs(report["loss"] - ref["loss"]) < 1e-5
        for kind, grad in ref["grads"].items():  # summed over the TP group: the one-process gradient
            assert torch.allclose(torch.tensor(report["grads"][kind]), grad, atol=1e-6, rtol=1e-4), kind


def test_fsdp_gathers_the_gates_before_handing_out_masks(parallel_reports):
    ref = single_process_reference()
    for rank in (0, 1):
        report = parallel_reports[("fsdp2", rank)]
        assert abs(report["loss"] - ref["loss"]) < 1e-5
        for kind, grad in ref["grads"].items():  # both ranks ran the same batch: the average is that gradient
            assert torch.allclose(torch.tensor(report["grads"][kind]), grad, atol=1e-6, rtol=1e-4), kind


def test_hook_hands_every_block_its_layer_mask():
    targets = all_targets()
    model = converted(targets)
    z = random_masks(targets)
    model.sheared_gates.fixed = z
    hand_out_masks(model, ())
    blocks = [m for m in model.modules() if isinstance(m, ShearedBlock)]
    assert [b.layer_z.item() for b in blocks] == z["layer"].tolist()
    assert blocks[0].input_z is blocks[0].hidden_z and blocks[1].input_z is None
    assert math.isclose(blocks[2].feed_forward.ffn_z.sum().item(), z["intermediate"][2].sum().item(), rel_tol=1e-6)


# --------------------------------------------------------------------------- materialisation

MATERIALISE_CASES = {
    "heads": dict(head_sparsity=0.5),
    "kv_groups": dict(head_sparsity=0.5, head_mode="kv_group"),
    "intermediate": dict(intermediate_sparsity=0.5),
    "hidden": dict(hidden_sparsity=0.25),
    "layers": dict(layer_sparsity=0.5),
    "all": dict(layer_sparsity=0.25, head_sparsity=0.5, hidden_sparsity=0.25, intermediate_sparsity=0.5),
}


def masked_and_materialised(case: str, flavor: str | None = None):
    """The masked model with trained-looking deterministic gates, and its materialised state dict and args."""
    # untied, like "tiny" (a tied model with soft hidden gates comes out untied: test_structured_materialize)
    args = tiny_args() if flavor is None else replace(flavor_args(flavor), max_seq_len=tiny_args().max_seq_len,
                                                      tie_word_embeddings=False)
    targets = targets_from_config(Sheared(**MATERIALISE_CASES[case]), args)
    model = converted(targets)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # trained-looking gates: distinct scores, soft values well below 1
        for log_alpha in model.sheared_gates.log_alphas().values():
            log_alpha.copy_(torch.randn(log_alpha.shape, generator=generator) * 2)
    log_alphas = {k: v.detach() for k, v in model.sheared_gates.log_alphas().items()}
    model.sheared_gates.fixed = final_masks(log_alphas, targets)
    sd = {canonical_name(n): p.detach() for n, p in model.named_parameters()}
    new_sd, new_args = materialize_pruned(sd, targets.args, targets)
    return targets, model, new_sd, new_args


# The families: heads removed with their q/k/v biases (Qwen2.5), q/k norms over head_dim 32 kept (Qwen3).
FAMILY_MATERIALISE = [("all", "tiny_qwen2"), ("all", "tiny_qwen3"), ("kv_groups", "tiny_qwen2")]


@pytest.mark.parametrize("case, flavor", [(c, None) for c in MATERIALISE_CASES] + FAMILY_MATERIALISE,
                         ids=list(MATERIALISE_CASES) + ["-".join(c) for c in FAMILY_MATERIALISE])
def test_materialised_model_equals_the_masked_model(case, flavor):
    targets, model, new_sd, new_args = masked_and_materialised(case, flavor)
    inputs, _ = batch()
    small = Llama(new_args)
    small.load_state_dict(new_sd, strict=True)
    with torch.no_grad():
        diff = (model(inputs) - small(inputs)).abs().max().item()
    assert diff < 1e-5, diff
    assert (new_args.n_layers, new_args.n_heads, new_args.kv_heads, new_args.dim, new_args.ffn_dim) == (
        targets.layers, targets.heads, targets.kv_heads, targets.dim, targets.intermediate)
    assert param_count(new_args) == targets.param_count() == sum(p.numel() for p in small.parameters())
    binary = {k: (v != 0).float() * 20 - 10 for k, v in model.sheared_gates.fixed.items()}  # P(z>0) ~ 1 or ~ 0
    assert expected_param_count(binary, targets) == pytest.approx(targets.param_count(), rel=1e-3)


@pytest.mark.parametrize("case, flavor", [("kv_groups", None), ("all", None), ("all", "tiny_qwen2"),
                                          ("all", "tiny_qwen3")])
def test_the_exported_pruned_folder_gives_the_masked_models_logits_in_transformers(case, flavor, tmp_path):
    transformers = pytest.importorskip("transformers")
    _, model, new_sd, new_args = masked_and_materialised(case, flavor)
    write_hf_folder(new_sd, new_args, str(tmp_path / "pruned"), torch.float32)
    config = json.loads((tmp_path / "pruned" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["hidden_size"], config["intermediate_size"]) == (
        new_args.n_layers, new_args.n_heads, new_args.kv_heads, new_args.dim, new_args.ffn_dim)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", dtype=torch.float32).eval()
    assert hf.config.model_type == new_args.family
    inputs, _ = batch()
    with torch.no_grad():
        diff = (hf(inputs).logits - model(inputs)).abs().max().item()
    assert diff < 1e-4, diff


def test_the_8b_sheared_flavor_is_what_the_8b_sheared_config_materialises(tmp_path):
    """train_configs/llama3_8b_sheared_continue.toml names flavor 8B_sheared: it must be the shape the pruning
    config's export writes (uniform keep-set of the target counts), and match that export's config.json."""
    from titan_lite.models.hf.config import args_to_hf_config, check_args_against_hf_config, flavor_of_hf_config
    from titan_lite.transforms.structured.materialize import StructureKeep, materialized_args

    cfg = parse_args(["--job.config_file", "train_configs/llama3_8b_sheared.toml"])
    base = flavor_args("8B")
    t = targets_from_config(cfg.sheared, base)
    per_group = t.heads // t.kv_heads
    keep = StructureKeep(layers=list(range(t.layers)),
                         q_heads=[[g * base.n_heads // base.kv_heads + j for g in range(t.kv_heads)
                                   for j in range(per_group)]] * t.layers,
                         kv_heads=[list(range(t.kv_heads))] * t.layers,
                         ffn=[list(range(t.intermediate))] * t.layers, hidden=list(range(t.dim)))
    args = materialized_args(base, keep)
    flavor = flavor_args("8B_sheared")
    for field in ("dim", "n_layers", "n_heads", "kv_heads", "ffn_dim", "head_dim", "vocab_size", "rope_theta",
                  "rope_scaling_factor", "tie_word_embeddings"):
        assert getattr(flavor, field) == getattr(args, field), field
    assert param_count(flavor) == t.param_count() == 4_203_930_918
    config = tmp_path / "config.json"
    config.write_text(json.dumps(args_to_hf_config(args, torch.bfloat16)))
    check_args_against_hf_config(flavor, str(config))
    assert flavor_of_hf_config(config) == "8B_sheared"
