"""Unit tests of parallelize_llama: TP divisibility errors, TP/FSDP placements, tied embeddings, SAC recomputation."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from tests.helpers import spawn_gloo
from titan_lite.config import JobConfig
from titan_lite.errors import ConfigError
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.models.parts.block import TransformerBlock
from titan_lite.models.parts.rope import rope_cache
from titan_lite.parallel.activation_checkpoint import apply_ac, forced_mm_shapes, save_policy
from titan_lite.parallel.tensor_parallel import check_tp_divisibility

SEQ, BATCH = 16, 4


# ------------------------------------------------------------------------------- TP divisibility


@pytest.mark.parametrize("tp, message", [
    (3, "'parallelism.tensor_parallel_degree' = 3 must divide the model's dim (64)"),
    (4, "'parallelism.tensor_parallel_degree' = 4 must divide the model's n_kv_heads (2)"),
    (8, "'parallelism.tensor_parallel_degree' = 8 must divide the model's n_heads (4)"),
])
def test_tp_degree_must_divide_model_widths(tp, message):
    with pytest.raises(ConfigError) as exc:
        check_tp_divisibility(flavor_args("tiny"), tp)
    assert str(exc.value) == message


def test_tp_degree_that_divides_everything_passes():
    check_tp_divisibility(flavor_args("tiny"), 2)


def test_pruned_layer_widths_are_checked():
    args = flavor_args("tiny")
    args.layer_ffn_dims = [192, 191, 192, 192]
    with pytest.raises(ConfigError, match=r"must divide the model's ffn_dim \(191\)"):
        check_tp_divisibility(args, 2)


def test_entry_point_refuses_bad_tp_degree_before_starting(capsys):
    from titan_lite.train import main

    code = main(["--job.config_file", "tests/integration/base.toml", "--parallelism.tensor_parallel_degree", "4"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: 'parallelism.tensor_parallel_degree' = 4 must divide the model's n_kv_heads (2)"]
    assert not dist.is_initialized()


# ------------------------------------------------------------------- placements and parity (2 ranks)


def _tiny_args(tied: bool | None, flavor: str = "tiny"):
    """A tiny flavor's args; tied None keeps the flavor's own setting (the family flavors)."""
    args = flavor_args(flavor)
    args.max_seq_len = SEQ
    if tied is not None:
        args.tie_word_embeddings = tied
    return args


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="mean")


def _config(tp: int, disable_loss_parallel: bool = False) -> JobConfig:
    cfg = JobConfig()
    cfg.parallelism.tensor_parallel_degree = tp
    cfg.parallelism.disable_loss_parallel = disable_loss_parallel
    cfg.activation_checkpoint.mode = "none"
    return cfg


# Parameters whose placement and local shape are recorded, with the gradient compared against one process.
WATCHED = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
           "layers.0.attention.wo.weight", "layers.1.feed_forward.w1.weight", "layers.1.feed_forward.w2.weight",
           "layers.0.attention_norm.weight", "norm.weight", "output.weight",
           # the families' options (absent from the Llama flavors)
           "layers.0.attention.wq.bias", "layers.1.attention.wk.bias", "layers.0.attention.wv.bias",
           "layers.0.attention.q_norm.weight", "layers.1.attention.k_norm.weight"]


def _run_scenario(name: str, tp: int, tied: bool | None, loss_parallel: bool, compile_backend: str | None = None,
                  flavor: str = "tiny", replicate: int = 1, ac: str = "none", watched: list[str] = WATCHED) -> dict:
    """Parallelize a tiny Llama, run one forward/backward on the fixed batch, report placements, loss and the grads
    of the watched parameters."""
    from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx

    from titan_lite.models.parameters import canonical_name
    from titan_lite.parallel.parallel_dims import ParallelDims
    from titan_lite.parallel.parallelize import parallelize_llama

    cfg = _config(tp, disable_loss_parallel=not loss_parallel)
    if compile_backend is not None:
        cfg.compile.enable, cfg.compile.backend = True, compile_backend
    cfg.parallelism.data_parallel_replicate_degree, cfg.activation_checkpoint.mode = replicate, ac
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Llama(_tiny_args(tied, flavor))
    parallelize_llama(model, dims, cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0, buffer_device=torch.device("cpu"))
    inputs, labels = _batch()
    use_ctx = tp > 1 and loss_parallel
    with loss_parallel_ctx() if use_ctx else torch.enable_grad():
        loss = _loss(model(inputs), labels)
        loss.backward()
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    report = {"loss": loss.item(), "tied_shared": model.output.weight is model.tok_embeddings.weight, "params": {}}
    for pname in watched:
        if pname not in params:
            continue
        p = params[pname]
        report["params"][pname] = {
            "placements": [repr(pl) for pl in p.placements],
            "local_shape": list(p.to_local().shape),
            "grad": p.grad.full_tensor().flatten().tolist(),
        }
    return report


SCENARIOS = {
    "tp2": dict(tp=2, tied=False, loss_parallel=True),
    "tp2_tied": dict(tp=2, tied=True, loss_parallel=True),
    "tp2_tied_no_loss_parallel": dict(tp=2, tied=True, loss_parallel=False),
    "fsdp2_tied": dict(tp=1, tied=True, loss_parallel=False),
    # aot_eager: the AOTAutograd path that broke TP + compile, without inductor's slow code generation
    "tp2_compile": dict(tp=2, tied=False, loss_parallel=True, compile_backend="aot_eager"),
    # The families: q/k norms with head_dim 32 and tied embeddings (Qwen3), q/k/v biases (Qwen2.5), a sliding window
    # shorter than the sequence (Mistral v0.1).
    "tp2_qwen3": dict(tp=2, tied=None, loss_parallel=True, flavor="tiny_qwen3"),
    "tp2_qwen2_compile": dict(tp=2, tied=None, loss_parallel=True, compile_backend="aot_eager", flavor="tiny_qwen2"),
    "tp2_mistral_no_loss_parallel": dict(tp=2, tied=None, loss_parallel=False, flavor="tiny_mistral"),
    "fsdp2_qwen3": dict(tp=1, tied=None, loss_parallel=False, flavor="tiny_qwen3"),
    "fsdp2_qwen2": dict(tp=1, tied=None, loss_parallel=False, flavor="tiny_qwen2"),
    "replicate2_qwen3_full_ac": dict(tp=1, tied=None, loss_parallel=False, flavor="tiny_qwen3", replicate=2,
                                     ac="full"),
}


def _worker(rank: int, out_dir: str) -> None:
    for name, spec in SCENARIOS.items():
        report = _run_scenario(name, **spec)
        Path(out_dir, f"{name}.rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("parallelize")
    spawn_gloo(_worker, 2, str(out))
    return {(name, rank): json.loads(Path(out, f"{name}.rank{rank}.json").read_text())
            for name in SCENARIOS for rank in range(2)}


def _reference(tied: bool | None, flavor: str = "tiny") -> tuple[float, dict[str, torch.Tensor]]:
    model = Llama(_tiny_args(tied, flavor))
    model.init_weights(seed=0)
    inputs, labels = _batch()
    loss = _loss(model(inputs), labels)
    loss.backward()
    return loss.item(), {n: p.grad.flatten() for n, p in model.named_parameters()}


TP_PLACEMENTS = {  # name: (placement, local shape on each of 2 TP ranks) for the tiny flavor (dim 64, head_dim 16)
    "tok_embeddings.weight": ("Shard(dim=0)", [1024, 64]),
    "layers.0.attention.wq.weight": ("Shard(dim=0)", [32, 64]),
    "layers.0.attention.wk.weight": ("Shard(dim=0)", [16, 64]),
    "layers.0.attention.wo.weight": ("Shard(dim=1)", [64, 32]),
    "layers.1.feed_forward.w1.weight": ("Shard(dim=0)", [96, 64]),
    "layers.1.feed_forward.w2.weight": ("Shard(dim=1)", [64, 96]),
    "layers.0.attention_norm.weight": ("Replicate()", [64]),
    "norm.weight": ("Replicate()", [64]),
    "output.weight": ("Shard(dim=0)", [1024, 64]),
}


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_plan_placements_and_local_shapes(reports, rank):
    got = reports[("tp2", rank)]["params"]
    for name, (placement, shape) in TP_PLACEMENTS.items():
        assert got[name]["placements"] == [placement], name
        assert got[name]["local_shape"] == shape, name


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_loss_and_grads_match_one_process(reports, scenario):
    ref_loss, ref_grads = _reference(SCENARIOS[scenario]["tied"], SCENARIOS[scenario].get("flavor", "tiny"))
    for rank in range(2):
        report = reports[(scenario, rank)]
        assert abs(report["loss"] - ref_loss) < 1e-5, (scenario, rank, report["loss"], ref_loss)
        for name, info in report["params"].items():
            grad = torch.tensor(info["grad"])
            assert torch.allclose(grad, ref_grads[name], atol=1e-5, rtol=1e-4), (scenario, name)


FAMILY_TP_PLACEMENTS = {  # q/k/v biases split with their colwise linears; q/k norms (over head_dim 32) replicated
    ("tp2_qwen2_compile", "layers.0.attention.wq.bias"): ("Shard(dim=0)", [32]),
    ("tp2_qwen2_compile", "layers.1.attention.wk.bias"): ("Shard(dim=0)", [16]),
    ("tp2_qwen3", "layers.0.attention.wq.weight"): ("Shard(dim=0)", [64, 64]),
    ("tp2_qwen3", "layers.0.attention.q_norm.weight"): ("Replicate()", [32]),
    ("tp2_qwen3", "layers.1.attention.k_norm.weight"): ("Replicate()", [32]),
}


@pytest.mark.parametrize("rank", [0, 1])
def test_family_tp_placements_and_local_shapes(reports, rank):
    for (scenario, name), (placement, shape) in FAMILY_TP_PLACEMENTS.items():
        got = reports[(scenario, rank)]["params"][name]
        assert (got["placements"], got["local_shape"]) == ([placement], shape), (scenario, name)


@pytest.mark.parametrize("scenario", ["tp2_tied", "tp2_tied_no_loss_parallel", "fsdp2_tied", "tp2_qwen3"])
def test_tied_embeddings_stay_one_parameter(reports, scenario):
    for rank in range(2):
        assert reports[(scenario, rank)]["tied_shared"] is True
        assert "output.weight" not in reports[(scenario, rank)]["params"]  # named_parameters lists it once


def test_fsdp_shards_every_parameter_on_dim0(reports):
    got = reports[("fsdp2_tied", 0)]["params"]
    assert got["tok_embeddings.weight"]["local_shape"] == [1024, 64]
    assert got["layers.1.feed_forward.w1.weight"]["local_shape"] == [96, 64]
    assert got["norm.weight"]["local_shape"] == [32]
    assert all(info["placements"] == ["Shard(dim=0)"] for info in got.values())


# ------------------------------------------------------------------------- selective AC recompute


class CountOps(TorchDispatchMode):
    """Counts executions of the ops of interest (ops served from the SAC cache never reach this mode)."""

    def __init__(self):
        super().__init__()
        self.counts = {"mm": 0, "sdpa": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.counts["mm"] += 1
        if "scaled_dot_product" in func.__name__ and "backward" not in func.__name__:
            self.counts["sdpa"] += 1
        return func(*args, **(kwargs or {}))


def _backward_op_counts(mode: str, option: str = "op", force: tuple[str, ...] = ()) -> dict[str, int]:
    args = _tiny_args(tied=False)
    args.n_layers = 1
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": TransformerBlock(args, 0)})
    cfg = JobConfig().activation_checkpoint
    cfg.mode, cfg.selective_ac_option = mode, option
    if force:
        cfg.per_op_sac_force_recompute_mm_shapes_by_fqns = list(force)
    apply_ac(model, cfg)
    x = torch.randn(2, SEQ, args.dim, requires_grad=True)
    out = model.layers["0"](x, rope_cache(args))
    with CountOps() as counter:
        out.sum().backward()
    return counter.counts


def test_selective_op_ac_recomputes_every_second_mm_and_no_attention():
    # A block has 7 linears: backward runs 14 mm (input and weight grads) plus whatever forward work is recomputed.
    assert _backward_op_counts("none") == {"mm": 14, "sdpa": 0}
    assert _backward_op_counts("full") == {"mm": 21, "sdpa": 1}
    assert _backward_op_counts("selective", "op") == {"mm": 17, "sdpa": 0}


def test_op_sac_forced_mm_is_recomputed_without_shifting_the_alternation():
    # Forward mm order: wq wk wv wo w1 w3 w2; every second one (wk, wo, w3) is recomputed, w2 is saved.
    # Forcing w2 recomputes it as well (one mm more), and the alternation over the others is unchanged.
    assert _backward_op_counts("selective", "op", force=("feed_forward.w2",)) == {"mm": 18, "sdpa": 0}
    assert _backward_op_counts("selective", "op", force=("moe.router.gate",)) == {"mm": 17, "sdpa": 0}


def test_op_sac_policy_forces_the_transposed_weight_shape():
    args = _tiny_args(tied=False)
    block = TransformerBlock(args, 0)
    forced = forced_mm_shapes(block, ["feed_forward.w2", "w9"])
    w2 = block.feed_forward.w2.weight
    assert forced == {(w2.shape[1], w2.shape[0])}
    ctx, mm, counts = SimpleNamespace(is_recompute=False), torch.ops.aten.mm.default, {False: 0}
    x = torch.empty(4, w2.shape[1])
    assert save_policy(counts, forced, ctx, mm, x, w2.t()) == CheckpointPolicy.PREFER_RECOMPUTE
    assert counts[False] == 0  # not counted in the every-other-mm alternation
    assert save_policy(counts, forced, ctx, mm, x, block.feed_forward.w1.weight.t()) == CheckpointPolicy.MUST_SAVE


def test_checkpointed_names_stay_canonical():
    from titan_lite.models.parameters import canonical_name

    with torch.device("meta"):
        model = Llama(_tiny_args(tied=False))
    plain = [n for n, _ in model.named_parameters()]
    cfg = JobConfig().activation_checkpoint
    cfg.mode, cfg.selective_ac_option = "selective", "2"
    apply_ac(model, cfg)
    names = [n for n, _ in model.named_parameters()]
    assert sum("_checkpoint_wrapped_module" in n for n in names) == 2 * 9  # layers 1 and 3 of 4, 9 params each
    assert [canonical_name(n) for n in names] == plain


# ------------------------------------------------------------------------------ config refusals


def test_cpu_offload_without_data_parallel_is_refused():
    from titan_lite.parallel.fsdp import check_cpu_offload
    from titan_lite.parallel.parallel_dims import ParallelDims

    cfg = _config(tp=2)
    cfg.training.enable_cpu_offload = True
    with pytest.raises(ConfigError) as exc:
        check_cpu_offload(cfg, ParallelDims.from_config(cfg.parallelism, 2))
    assert str(exc.value) == ("'training.enable_cpu_offload' = true needs FSDP: a data-parallel shard or replicate "
                              "degree above 1, but the layout is "
                              "world 2 = dp_replicate 1 x dp_shard 1 x cp 1 x tp 2 x pp 1")
    cfg.parallelism.tensor_parallel_degree = 1
    check_cpu_offload(cfg, ParallelDims.from_config(cfg.parallelism, 2))  # FSDP over 2 ranks: accepted


def test_unknown_compile_component_is_refused():
    from titan_lite.config import validate

    cfg = JobConfig()
    cfg.compile.components = ["model", "los"]
    with pytest.raises(ConfigError, match=r"^'compile.components' has 'los'; expected some of: model, loss$"):
        validate(cfg)


def test_mixed_precision_policy_resolves_auto_to_float32_on_cpu():
    from titan_lite.parallel.fsdp import mixed_precision_policy

    cfg = JobConfig()
    auto = mixed_precision_policy(cfg, "cpu")
    assert (auto.param_dtype, auto.reduce_dtype) == (torch.float32, torch.float32)
    cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce = "bfloat16", "bfloat16"
    explicit = mixed_precision_policy(cfg, "cpu")
    assert (explicit.param_dtype, explicit.reduce_dtype) == (torch.bfloat16, torch.bfloat16)


@pytest.mark.parametrize("tp, disable_loss_parallel, compiled", [(1, False, True), (2, False, False), (2, True, True)])
def test_loss_is_compiled_except_under_loss_parallel(tp, disable_loss_parallel, compiled):
    # Compiled cross-entropy ignores loss_parallel() and normalises each vocab shard alone: a silently wrong loss.
    from titan_lite.loss import build_loss_fn, cross_entropy_sum
    from titan_lite.parallel.parallel_dims import ParallelDims
    from titan_lite.parallel.parallelize import loss_parallel_enabled

    cfg = _config(tp, disable_loss_parallel)
    cfg.compile.enable = True
    loss_fn = build_loss_fn(cfg.compile, loss_parallel_enabled(ParallelDims.from_config(cfg.parallelism, tp), cfg))
    assert (loss_fn is not cross_entropy_sum) == compiled
