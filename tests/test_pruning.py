"""One-shot pruning: mask selection (per row, per layer, N:M), SparseGPT against a direct optimal-brain-surgeon
reference, whole-model pruning through assemble_model (exact zero counts, untouched modules, skip patterns), the
memory plan against the measured peak on two model sizes, and masks identical on FSDP 2 and TP 2."""

import math
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist

from tests.helpers import free_port, spawn_on_free_port
from titan_lite.checkpoint.hf import read_hf_folder, write_hf_folder
from titan_lite.config import parse_args, validate
from titan_lite.dtensor import full_tensor
from titan_lite.errors import ConfigError
from titan_lite.job.assembly import assemble_model, calibration_source
from titan_lite.job.plan import plan_job
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms.pruning.masks import (
    Pattern,
    lowest_in_layer,
    lowest_per_group,
    lowest_per_row,
    masked_linears,
)
from titan_lite.transforms.pruning.owl import OutlierCount, owl_sparsities
from titan_lite.transforms.pruning.remask import remask_hf_folder
from titan_lite.transforms.pruning.sparsegpt import inverse_hessian_factor, sparsegpt_prune
from titan_lite.transforms.pruning.transform import check_layout

BASE = "tests/integration/base.toml"
CALIBRATION = ["--pruning.nsamples", "8", "--pruning.seq_len", "32"]


# ------------------------------------------------------------------------------------------ selection


def test_lowest_per_row_prunes_the_count_of_lowest_scores_in_every_row():
    scores = torch.rand(16, 40, generator=torch.Generator().manual_seed(0))
    pruned = lowest_per_row(scores, 12)
    assert pruned.sum(1).tolist() == [12] * 16
    assert (scores[pruned].view(16, 12).max(1).values < scores.masked_fill(pruned, 2).min(1).values).all()


def test_lowest_in_layer_counts_exactly_and_breaks_ties_by_position():
    scores = torch.tensor([[3.0, 1.0, 2.0, 1.0], [1.0, 5.0, 1.0, 0.5]])
    pruned = lowest_in_layer(scores, 3)  # 0.5, then the first two of the four 1.0s in row-major order
    assert pruned.tolist() == [[False, True, False, True], [False, False, False, True]]
    big = torch.randn(50, 30, generator=torch.Generator().manual_seed(1)).abs()
    chosen = lowest_in_layer(big, 600)
    assert int(chosen.sum()) == 600 and big[chosen].max() <= big[~chosen].min()


@pytest.mark.parametrize("text", ["2:4", "4:8"])
def test_nm_selection_prunes_n_in_every_group_of_m(text):
    pattern = Pattern.parse(text)
    scores = torch.rand(8, 32, generator=torch.Generator().manual_seed(2))
    pruned = lowest_per_group(scores, pattern)
    assert (pruned.view(8, -1, pattern.m).sum(-1) == pattern.n).all()


def dims(**degrees) -> ParallelDims:
    d = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1)
    d.update(degrees)
    return ParallelDims(**d, world_size=math.prod(d.values()))


@pytest.mark.parametrize("overrides, layout, message", [
    (["--model.converters", "prune", "--pruning.pattern", "2:4", "--pruning.sparsity", "0.6"], {},
     "'pruning.sparsity' = 0.6 contradicts 'pruning.pattern' = '2:4'"),
    (["--model.converters", "prune", "--pruning.pattern", "4:8", "--pruning.blocksize", "12"], {},
     "'pruning.blocksize' = 12 must be a multiple of 8"),
    ([], {"pp": 2}, "does not run under pipeline parallelism ('parallelism.pipeline_parallel_degree' = 2)"),
    ([], {"cp": 2}, "does not run under context parallelism"),
    (["--model.converters", "prune", "--pruning.nsamples", "9"], {"dp_shard": 2},
     "'pruning.nsamples' = 9 must be a multiple of the data-parallel"),
    (["--model.converters", "prune", "--pruning.seq_len", "33"], {"tp": 2},
     "'pruning.seq_len' = 33 must be divisible by"),
    (["--model.converters", "lora,prune"], {}, "list 'prune' before 'lora'"),
    (["--model.converters", "prune,lora", "--lora.init", "pissa"], {},
     "'lora.init' = 'pissa' cannot follow 'prune' in 'model.converters'"),
])
def test_impossible_settings_are_one_line_errors(overrides, layout, message):
    cfg = parse_args(["--job.config_file", BASE, *overrides])
    with pytest.raises(ConfigError) as error:
        validate(cfg)
        check_layout(cfg, flavor_args("tiny"), dims(**layout))
    assert message in str(error.value) and "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------ SparseGPT


def obs_reference(weight: torch.Tensor, hessian: torch.Tensor, sparsity: float, pattern: Pattern, blocksize: int,
                  percdamp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Column-by-column optimal brain surgeon with explicitly inverted Hessians of the columns not yet visited:
    zero (or keep) column i, then move the columns F = {i, ...} by -(w_i - q_i) / [H_F⁻¹]_00 x H_F⁻¹[0, :]."""
    w, h = weight.clone(), hessian.clone()
    h += percdamp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
    rows, cols = w.shape
    inverse = [torch.linalg.inv(h[i:, i:]) for i in range(cols)]
    pruned = torch.zeros(rows, cols, dtype=torch.bool)
    for start in range(0, cols, blocksize):
        end = min(start + blocksize, cols)
        d2 = torch.stack([inverse[j][0, 0] for j in range(cols)])
        if not pattern.structured:
            saliency = w[:, start:end] ** 2 / d2[start:end]
            order = torch.sort(saliency.flatten(), stable=True).indices[:int(saliency.numel() * sparsity)]
            block = torch.zeros(saliency.numel(), dtype=torch.bool)
            block[order] = True
            pruned[:, start:end] = block.view(saliency.shape)
        for i in range(start, end):
            if pattern.structured and (i - start) % pattern.m == 0:
                saliency = w[:, i:i + pattern.m] ** 2 / d2[i:i + pattern.m]
                lowest = torch.sort(saliency, dim=1, stable=True).indices[:, :pattern.n]
                pruned[:, i:i + pattern.m].scatter_(1, lowest, True)
            q = w[:, i].masked_fill(pruned[:, i], 0.0)
            w[:, i:] -= ((w[:, i] - q) / inverse[i][0, 0])[:, None] * inverse[i][0][None, :]
            w[:, i] = q
    return w, pruned


@pytest.mark.parametrize("text", ["unstructured", "2:4"])
def test_sparsegpt_equals_column_by_column_obs(text):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(6, 16, generator=g, dtype=torch.float64)
    x = torch.randn(64, 16, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3.0, 16, dtype=torch.float64)
    hessian = x.t() @ x
    pattern = Pattern.parse(text)
    expected_w, expected_mask = obs_reference(weight, hessian, 0.5, pattern, blocksize=8, percdamp=0.01)
    factor, dead = inverse_hessian_factor(hessian.clone(), 0.01)
    got_w = weight.clone()
    got_mask = sparsegpt_prune(got_w, factor, dead, 0.5, pattern, blocksize=8)
    assert torch.equal(got_mask, expected_mask)
    torch.testing.assert_close(got_w, expected_w, rtol=0, atol=1e-10)
    assert (got_w[got_mask] == 0).all() and int(got_mask.sum()) == weight.numel() // 2


def test_sparsegpt_update_lowers_the_output_error_of_its_mask():
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(32, 64, generator=g)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)  # correlated inputs
    factor, dead = inverse_hessian_factor(x.t() @ x, 0.01)
    updated = weight.clone()
    mask = sparsegpt_prune(updated, factor, dead, 0.5, Pattern(), blocksize=16)
    masked_only = weight.masked_fill(mask, 0.0)
    error = lambda w: ((x @ (w - weight).t()) ** 2).sum()  # noqa: E731
    assert error(updated) < 0.75 * error(masked_only)


# ------------------------------------------------------------------------------------------ whole model


@pytest.fixture(scope="module")
def process_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(key, None)


def build(overrides: list[str], world: int = 1, flavor: str = "tiny"):
    """This rank's model, built and pruned through assemble_model like every entry point does."""
    cfg = parse_args(["--job.config_file", BASE, "--model.flavor", flavor, *overrides])
    plan = plan_job(cfg, world)
    plan.parallel_dims.build_mesh("cpu")
    return assemble_model(plan, torch.device("cpu")), plan


def full_state(parts) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).clone() for m in parts for n, p in m.named_parameters()}


@pytest.fixture(scope="module")
def dense(process_group) -> dict[str, torch.Tensor]:
    built, _ = build([])
    return full_state(built.parts)


@pytest.mark.parametrize("sparsity", [0.5, 0.3])
def test_wanda_unstructured_zeroes_floor_of_in_times_sparsity_in_every_row(process_group, dense, sparsity):
    built, _ = build(["--model.converters", "prune", "--pruning.sparsity", str(sparsity), *CALIBRATION])
    pruned = full_state(built.parts)
    linears = dict(masked_linears(built.parts))
    assert len(linears) == 4 * 7
    for name in linears:
        w = pruned[f"{name}.weight"]
        assert (w == 0).sum(1).tolist() == [int(w.shape[1] * sparsity)] * w.shape[0], name
        kept = w != 0  # Wanda only zeroes: every kept weight is the dense one
        assert torch.equal(w[kept], dense[f"{name}.weight"][kept])
    untouched = [n for n in dense if not any(n == f"{m}.weight" for m in linears)]
    assert "tok_embeddings.weight" in untouched and "output.weight" in untouched and "norm.weight" in untouched
    assert all(torch.equal(pruned[n], dense[n]) for n in untouched)


@pytest.mark.parametrize("method, text", [("wanda", "2:4"), ("wanda", "4:8"), ("sparsegpt", "2:4"),
                                          ("magnitude", "2:4")])
def test_nm_patterns_zero_exactly_n_of_every_m_inputs(process_group, method, text):
    built, _ = build(["--model.converters", "prune", "--pruning.method", method, "--pruning.pattern", text,
                      *CALIBRATION])
    pattern = Pattern.parse(text)
    for name, module in masked_linears(built.parts):
        w = full_tensor(module.weight.detach())
        groups = (w == 0).view(w.shape[0], -1, pattern.m).sum(-1)
        assert (groups == pattern.n).all(), name
        assert torch.equal(full_tensor(module.weight_mask), w != 0)


def test_two_four_weights_survive_a_semi_structured_round_trip(process_group):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("torch.sparse.to_sparse_semi_structured needs a CUDA GPU of compute capability 8.0 or newer")
    from torch.sparse import to_sparse_semi_structured
    built, _ = build(["--model.converters", "prune", "--pruning.pattern", "2:4", *CALIBRATION])
    for name, module in masked_linears(built.parts):
        dense_half = full_tensor(module.weight.detach()).half().cuda()
        assert torch.equal(to_sparse_semi_structured(dense_half).to_dense(), dense_half), name


def test_magnitude_prunes_the_smallest_of_each_layer(process_group, dense):
    built, _ = build(["--model.converters", "prune", "--pruning.method", "magnitude"])
    for name, module in masked_linears(built.parts):
        w, original = full_tensor(module.weight.detach()), dense[f"{name}.weight"]
        zero = w == 0
        assert int(zero.sum()) == original.numel() // 2
        assert original[zero].abs().max() <= original[~zero].abs().min()


def test_skip_patterns_leave_those_linears_dense(process_group, dense):
    built, _ = build(["--model.converters", "prune", "--pruning.skip", "layers.0.*,*.feed_forward.w2", *CALIBRATION])
    names = {name for name, _ in masked_linears(built.parts)}
    assert len(names) == 3 * 6 and not any(n.startswith("layers.0.") or n.endswith("w2") for n in names)
    pruned = full_state(built.parts)
    for name in ("layers.0.attention.wq.weight", "layers.2.feed_forward.w2.weight"):
        assert torch.equal(pruned[name], dense[name])


SMALL_CACHE = ("--pruning.nsamples", "8", "--pruning.seq_len", "128", "--pruning.batch_size", "2")
# OWL at 70% with 64 x 256 calibration (docs/pruning.md's setting): the cache outweighs the tiny model's weights, so its
# dense outlier pass (the cache, each linear's outlier count) and the pruning pass after it must both be planned.
OWL = ("--pruning.layer_ratios", "owl", "--pruning.sparsity", "0.7", "--pruning.nsamples", "64", "--pruning.seq_len",
       "256")


@pytest.mark.parametrize("flavor, method, pattern, extra", [("tiny", "sparsegpt", "unstructured", SMALL_CACHE),
                                                            ("debugmodel", "wanda", "2:4", SMALL_CACHE),
                                                            ("tiny", "wanda", "unstructured", OWL),
                                                            ("tiny", "magnitude", "unstructured", OWL)])
def test_memory_plan_matches_the_measured_peak(process_group, flavor, method, pattern, extra):
    built, plan = build(["--model.converters", "prune", "--pruning.method", method, "--pruning.pattern", pattern,
                         *extra], flavor=flavor)
    transform = next(iter(plan.transforms))
    estimate, measured = transform.plan, transform.measured.bytes
    above_weights = measured - estimate.weights  # what calibration and pruning add
    assert abs(estimate.peak - measured) <= 0.1 * measured, (estimate, measured)
    assert abs(estimate.peak - estimate.weights - above_weights) <= 0.2 * above_weights, (estimate, measured)


# ------------------------------------------------------------------------------------------ layouts


LAYOUT_CASES = [("wanda", "unstructured", ()), ("sparsegpt", "2:4", ()),
                ("sparsegpt", "unstructured", ("--pruning.layer_ratios", "owl", "--pruning.owl_m", "3"))]


def masks_of(overrides: list[str], world: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    built, _ = build(["--model.converters", "prune", *CALIBRATION, *overrides], world=world)
    return {n: (full_tensor(m.weight_mask).clone(), full_tensor(m.weight.detach()).clone())
            for n, m in masked_linears(built.parts)}


def _layout_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        results = {}
        for method, pattern, extra in LAYOUT_CASES:
            case = ["--pruning.method", method, "--pruning.pattern", pattern, *extra]
            results[("fsdp2", method, pattern, extra)] = masks_of(case, 2)
            results[("tp2", method, pattern, extra)] = masks_of([*case, "--parallelism.tensor_parallel_degree", "2"],
                                                                2)
        if rank == 0:
            torch.save(results, out + ".part")
            os.replace(out + ".part", out)  # whole or absent: results_complete reads its existence
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_masks_on_fsdp2_and_tp2_equal_one_process(process_group, tmp_path):
    out = tmp_path / "layouts.pt"
    spawn_on_free_port(_layout_worker, 2, str(out), results_complete=out.exists)
    results = torch.load(out)
    for method, pattern, extra in LAYOUT_CASES:
        single = masks_of(["--pruning.method", method, "--pruning.pattern", pattern, *extra], 1)
        for layout in ("fsdp2", "tp2"):
            got = results[(layout, method, pattern, extra)]
            assert got.keys() == single.keys()
            for name, (mask, weight) in single.items():
                assert torch.equal(got[name][0], mask), (layout, method, name)
                # SparseGPT's updates differ only by the summation order of the all-reduced Hessian.
                torch.testing.assert_close(got[name][1], weight, rtol=0, atol=1e-5)


def test_remask_puts_a_pruned_folders_zeros_back_into_a_dense_one(tmp_path):
    args = flavor_args("tiny")
    model = Llama(args)
    model.init_weights(seed=0)
    merged = {n: p.detach().clone() for n, p in model.named_parameters()}
    linear = lambda name: name.split(".")[-2] in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")  # noqa: E731
    pruned = {n: t.masked_fill(t.abs() < t.abs().median(), 0.0) if linear(n) else t for n, t in merged.items()}
    write_hf_folder(merged, args, str(tmp_path / "merged"), torch.float32)
    write_hf_folder(pruned, args, str(tmp_path / "pruned"), torch.float32)
    linears, rezeroed = remask_hf_folder(tmp_path / "merged", tmp_path / "pruned", tmp_path / "out")
    assert linears == 28 and rezeroed == sum(int((t == 0).sum()) for n, t in pruned.items() if linear(n))
    out = read_hf_folder(str(tmp_path / "out"), args)
    assert all(torch.equal(out[n], pruned[n]) for n in out)


# ------------------------------------------------------------------------------------------ OWL's layer ratios


def reference_owl(outlier_ratios: list[float], sparsity: float, lamda: float) -> list[float]:
    """luuyin/OWL lib/prune_all.py (prune_wanda_outlier) as written there, in numpy: the layer sparsities."""
    import numpy as np  # the reference's own library, for its transcription only

    all_layer_ratio = np.array(outlier_ratios)
    all_layer_ratio = ((all_layer_ratio - all_layer_ratio.min()) * (1 / (all_layer_ratio.max() - all_layer_ratio.min())
                                                                    * lamda * 2))
    all_layer_ratio = all_layer_ratio - np.mean(all_layer_ratio) + (1 - sparsity)
    return [1 - r for r in all_layer_ratio]


def reference_outlier_ratio(scores: list[torch.Tensor], m: float) -> float:
    """OWL's check_outlier_mean on a layer's scores concatenated (torch.mean, strictly above M x mean, in %)."""
    flat = torch.cat([s.flatten() for s in scores])
    return float((flat > torch.mean(flat) * m).sum()) / flat.numel() * 100


def test_owl_sparsities_reproduce_the_reference_and_average_the_target():
    ratios = [6.96, 7.12, 7.10, 7.18, 5.02, 9.4]
    for sparsity, lam in ((0.5, 0.08), (0.7, 0.08), (0.6, 0.2)):
        ours = owl_sparsities(ratios, sparsity, lam)
        assert ours == pytest.approx(reference_owl(ratios, sparsity, lam), abs=1e-12)
        assert sum(ours) / len(ours) == pytest.approx(sparsity, abs=1e-12)
        assert max(ours) - min(ours) == pytest.approx(2 * lam, abs=1e-12)
        assert ours.index(min(ours)) == ratios.index(max(ratios))  # most outliers: pruned least
    assert owl_sparsities([3.0, 3.0, 3.0], 0.5, 0.08) == [0.5, 0.5, 0.5]


def test_owl_counts_a_layers_outliers_like_the_reference():
    g = torch.Generator().manual_seed(0)
    scores = [torch.randn(48, 64, generator=g).abs() ** 3, torch.randn(64, 32, generator=g).abs()]
    count = OutlierCount(5.0)
    for add in (count.add, count.count):
        for s in scores:
            add(s)
    assert count.ratio == pytest.approx(reference_outlier_ratio(scores, 5.0), abs=1e-9)


def dense_outlier_ratios(plan, dense_state: dict[str, torch.Tensor], m: float) -> list[float]:
    """Each layer's OWL outlier ratio computed independently: the dense model run whole (each block sees the dense
    blocks' outputs) on the calibration windows, Wanda's ||x_j|| from hooks on every linear, OWL's count."""
    model = Llama(plan.model_args)
    model.load_state_dict(dense_state, strict=False)
    squares: dict[str, torch.Tensor] = {}

    def hook(name, module, args, output):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        squares[name] = squares.get(name, 0) + (x * x).sum(0)
    linears = {n: mod for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and "layers." in n}
    handles = [mod.register_forward_hook(partial(hook, n)) for n, mod in linears.items()]
    p = plan.cfg.pruning
    with torch.no_grad():
        for inputs, _ in calibration_source(plan, torch.device("cpu"))(p.dataset, p.dataset_path, p.nsamples,
                                                                        p.seq_len, p.batch_size):
            model(inputs)
    for handle in handles:
        handle.remove()
    ratios = []
    for layer in range(plan.model_args.n_layers):
        names = [n for n in linears if n.startswith(f"layers.{layer}.")]
        scores = [linears[n].weight.abs() * squares[n].sqrt().float()[None, :] for n in names]
        ratios.append(reference_outlier_ratio(scores, m))
    return ratios


def reference_windows(plan) -> list[torch.Tensor]:
    p = plan.cfg.pruning
    return [inputs for inputs, _ in calibration_source(plan, torch.device("cpu"))(p.dataset, p.dataset_path,
                                                                                  p.nsamples, p.seq_len, 1)]


def own_input_squares(block: torch.nn.Module, hidden: list[torch.Tensor], rope: torch.Tensor) -> dict:
    """Wanda's statistic from a hook on every linear of the block (each its own input, no sharing): the sum over
    the calibration tokens of x_j^2, the block run on `hidden`."""
    squares: dict[str, torch.Tensor] = {}

    def hook(name, module, args, output):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        squares[name] = squares.get(name, 0) + (x * x).sum(0)
    linears = {n: m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    handles = [m.register_forward_hook(partial(hook, n)) for n, m in linears.items()]
    for h in hidden:
        block(h, rope)
    for handle in handles:
        handle.remove()
    return squares


@torch.no_grad()
def reference_wanda(plan, dense_state: dict[str, torch.Tensor], sparsity: float, owl: tuple[float, float] | None,
                    sequential: bool = True) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Wanda (Sun et al. 2023) with OWL's layer ratios (Yin et al. 2024), written from the papers: OWL's outlier
    ratio D_l on the dense model, S_l from reference_owl; then block by block, each block calibrated on the outputs
    of the blocks already pruned (`sequential`; else on the dense blocks' outputs), every linear's score
    |W_ij| x ||x_j|| from its own input, the floor(in x S_l) lowest of each output row pruned (a stable sort).
    Returns (pruned positions by linear, the layer sparsities)."""
    model = Llama(plan.model_args)
    model.load_state_dict(dense_state, strict=False)
    rope, blocks = model.rope_cache, list(model.layers.values())
    hidden = [model.tok_embeddings(w) for w in reference_windows(plan)]
    dense_inputs, outlier_ratios = [], []
    for block in blocks:
        dense_inputs.append(hidden)
        squares = own_input_squares(block, hidden, rope)
        scores = [m.weight.abs() * squares[n].sqrt().float()[None, :] for n, m in block.named_modules()
                  if isinstance(m, torch.nn.Linear)]
        outlier_ratios.append(reference_outlier_ratio(scores, owl[0]) if owl else 0.0)
        hidden = [block(h, rope) for h in hidden]
    sparsities = reference_owl(outlier_ratios, sparsity, owl[1]) if owl else [sparsity] * len(blocks)
    hidden, pruned = dense_inputs[0], {}
    for i, block in enumerate(blocks):
        squares = own_input_squares(block, hidden if sequential else dense_inputs[i], rope)
        for name, linear in block.named_modules():
            if isinstance(linear, torch.nn.Linear):
                score = linear.weight.abs() * squares[name].sqrt().float()[None, :]
                lowest = torch.sort(score, dim=-1, stable=True).indices[:, :int(score.shape[1] * sparsities[i])]
                mask = torch.zeros_like(score, dtype=torch.bool).scatter_(1, lowest, True)
                linear.weight[mask] = 0
                pruned[f"layers.{i}.{name}"] = mask
        hidden = [block(h, rope) for h in hidden]
    return pruned, sparsities


@pytest.mark.parametrize("layer_ratios", ["owl", "uniform"])
def test_wanda_masks_equal_a_sequential_reference_from_the_papers(process_group, dense, layer_ratios):
    owl = ("--pruning.layer_ratios", "owl", "--pruning.owl_m", "3", "--pruning.owl_lambda", "0.1")
    built, plan = build(["--model.converters", "prune", "--pruning.sparsity", "0.7", *CALIBRATION,
                         *(owl if layer_ratios == "owl" else ())])
    settings = (3.0, 0.1) if layer_ratios == "owl" else None
    expected, sparsities = reference_wanda(plan, dense, 0.7, settings)
    dense_calibrated, _ = reference_wanda(plan, dense, 0.7, settings, sequential=False)
    pruned = full_state(built.parts)
    assert sorted(expected) == sorted(n for n, _ in masked_linears(built.parts))
    for name, mask in expected.items():
        assert torch.equal(pruned[f"{name}.weight"] == 0, mask), name
    # Sequential: block 0 sees the same inputs either way; every later block's masks follow the pruned inputs.
    differ = {i: sum(int((expected[n] != dense_calibrated[n]).sum()) for n in expected if n.startswith(f"layers.{i}."))
              for i in range(plan.model_args.n_layers)}
    assert differ[0] == 0 and all(differ[i] > 0 for i in range(1, plan.model_args.n_layers)), differ
    if layer_ratios == "owl":
        assert max(sparsities) - min(sparsities) == pytest.approx(0.2, abs=1e-12)


@pytest.mark.parametrize("method", ["wanda", "magnitude"])
def test_owl_prunes_every_layer_at_its_outlier_weighted_ratio(process_group, dense, method):
    built, plan = build(["--model.converters", "prune", "--pruning.method", method, "--pruning.sparsity", "0.6",
                         "--pruning.layer_ratios", "owl", "--pruning.owl_m", "3", "--pruning.owl_lambda", "0.1",
                         *CALIBRATION])
    expected = reference_owl(dense_outlier_ratios(plan, dense, 3.0), 0.6, 0.1)
    result = next(iter(plan.transforms)).result
    for layer in result.layers:
        assert layer.target_sparsity == pytest.approx(expected[int(layer.name.split(".")[1])], abs=1e-9), layer.name
    pruned = full_state(built.parts)
    for name, _ in masked_linears(built.parts):
        w, s = pruned[f"{name}.weight"], expected[int(name.split(".")[1])]
        if method == "wanda":
            assert (w == 0).sum(1).tolist() == [int(w.shape[1] * s)] * w.shape[0], name
        else:
            assert int((w == 0).sum()) == int(w.numel() * s), name
    assert sum(expected) / len(expected) == pytest.approx(0.6, abs=1e-12) and max(expected) - min(expected) > 0.19


def test_owl_with_an_n_m_pattern_is_one_line():
    cfg = parse_args(["--job.config_file", BASE, "--model.converters", "prune", "--pruning.pattern", "2:4",
                      "--pruning.layer_ratios", "owl"])
    with pytest.raises(ConfigError, match="'pruning.layer_ratios' = 'owl' gives each layer its own sparsity, but "
                                          "'pruning.pattern' = '2:4'"):
        validate(cfg)
