"""Taylor one-shot structured pruning: importances against autograd on a plain Llama, GQA-consistent selection in
both head modes, and scripts/prune.py under torchrun (FSDP 2, TP 2) selecting the keep-set of one process and
writing a smaller model that equals the masked source."""

import importlib.util
import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import free_port
from tests.test_structured_materialize import masked_forward, masks_of
from tests.warm_python import python_command
from titan_lite.checkpoint.hf import read_hf_folder, write_hf_folder
from titan_lite.checkpoint.resume import plan_initial, plan_weights
from titan_lite.config import parse_args
from titan_lite.dtensor import full_tensor
from titan_lite.errors import ConfigError
from titan_lite.job.assembly import assemble_model, calibration_source
from titan_lite.job.plan import plan_job
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.models.hf.config import args_from_hf_config, read_hf_config
from titan_lite.transforms.structured.materialize import StructureKeep, materialize_state_dict, write_materialized_hf
from titan_lite.transforms.structured.taylor import (
    LayerScores,
    local_calibration,
    select_heads,
    select_keep,
    taylor_scores,
)

ROOT = Path(__file__).resolve().parents[1]
BASE = "tests/integration/base.toml"
NSAMPLES, SEQ = 4, 32


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------ selection


def test_per_group_query_keeps_the_same_count_of_the_best_heads_in_every_group():
    # 2 KV groups of 4 query heads; importance is |score|
    scores = LayerScores(q_heads=torch.tensor([0.1, -5.0, 2.0, 0.3, 4.0, -0.2, -3.0, 1.0]),
                         kv_heads=torch.tensor([100.0, -100.0]), ffn=torch.zeros(1))
    assert select_heads(scores, n_rep=4, ratio=0.5, mode="per_group_query") == ([1, 2, 4, 6], [0, 1])
    assert select_heads(scores, n_rep=4, ratio=0.25, mode="per_group_query") == ([1, 2, 3, 4, 6, 7], [0, 1])


def test_kv_group_keeps_whole_groups_by_their_summed_score():
    # group 0: |1 + (1 + 1)| = 3; group 1: |-10 + (4 + 4)| = 2; group 2: |0 + (-2 - 2)| = 4
    scores = LayerScores(q_heads=torch.tensor([1.0, 1.0, 4.0, 4.0, -2.0, -2.0]),
                         kv_heads=torch.tensor([1.0, -10.0, 0.0]), ffn=torch.zeros(1))
    assert select_heads(scores, n_rep=2, ratio=0.34, mode="kv_group") == ([0, 1, 4, 5], [0, 2])


def test_without_gqa_both_modes_remove_whole_heads():
    scores = LayerScores(q_heads=torch.tensor([3.0, 1.0, 2.0, 0.5]), kv_heads=torch.tensor([0.0, 0.0, 0.0, 1.0]),
                         ffn=torch.zeros(1))
    for mode in ("per_group_query", "kv_group"):
        assert select_heads(scores, n_rep=1, ratio=0.5, mode=mode) == ([0, 2], [0, 2])


def test_keep_set_is_uniform_across_layers():
    args = flavor_args("tiny")  # 4 heads, 2 KV heads, ffn 192
    g = torch.Generator().manual_seed(0)
    scores = [LayerScores(torch.randn(4, generator=g), torch.randn(2, generator=g), torch.randn(192, generator=g))
              for _ in range(args.n_layers)]
    keep = select_keep(scores, args, head_ratio=0.5, ffn_ratio=0.25, head_mode="per_group_query")
    assert [len(q) for q in keep.q_heads] == [2] * 4 and keep.kv_heads == [[0, 1]] * 4
    assert all(len(f) == 144 for f in keep.ffn) and keep.hidden == list(range(64))
    for layer, channels in enumerate(keep.ffn):  # the 144 largest |score|s of each layer
        assert set(channels) == set(scores[layer].ffn.abs().topk(144).indices.tolist())


# ------------------------------------------------------------------------------------------ importances


@pytest.fixture(scope="module")
def process_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        os.environ.pop(key, None)


def score_assembled(overrides: list[str] | None = None, load_from: Path | None = None):
    """(scores, loss, full weights, calibration batches) of the tiny model on one process, built like every entry
    point builds it (random weights, or those of an HF folder)."""
    folder = ["--model.hf_assets_path", str(load_from)] if load_from else []
    cfg = parse_args(["--job.config_file", BASE, "--training.seq_len", str(SEQ), *folder, *(overrides or [])])
    plan = plan_job(cfg, 1)
    plan.parallel_dims.build_mesh("cpu")
    device = torch.device("cpu")
    built = assemble_model(plan, device, load=plan_weights("hf", load_from) if load_from else None)
    windows = calibration_source(plan, device)("shakespeare", None, NSAMPLES, SEQ, 2)
    batches = local_calibration(windows, NSAMPLES, plan.parallel_dims, device, "shakespeare")
    weights = {n: full_tensor(p.detach()).clone() for n, p in built.parts[0].named_parameters()}
    scores, loss = taylor_scores(built.runner, batches, plan.parallel_dims, plan.model_args, device)
    return scores, loss, weights, batches, plan.model_args


def reference_scores(weights: dict, args, batches) -> tuple[list[LayerScores], float]:
    """Autograd on a plain Llama: mean token loss over the windows, then the group sums by explicit indexing."""
    model = Llama(args)
    model.init_weights()
    model.load_state_dict(weights, strict=False)
    inputs = torch.cat([x for x, _ in batches])
    labels = torch.cat([y for _, y in batches])
    loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    loss.backward()
    hd, out = args.head_dim, []
    for i in range(args.n_layers):
        block = model.layers[str(i)]

        def wg(linear):
            return linear.weight.detach() * linear.weight.grad

        def bg(linear, heads):  # a bias's entries, per head (Qwen2's q/k/v)
            return 0.0 if linear.bias is None else (linear.bias.detach() * linear.bias.grad).view(heads, hd).sum(1)
        q = wg(block.attention.wq).view(args.n_heads, hd, -1).sum((1, 2)) + bg(block.attention.wq, args.n_heads)
        q = q + wg(block.attention.wo).view(args.dim, args.n_heads, hd).sum((0, 2))
        kv = (wg(block.attention.wk) + wg(block.attention.wv)).view(args.kv_heads, hd, -1).sum((1, 2))
        kv = kv + bg(block.attention.wk, args.kv_heads) + bg(block.attention.wv, args.kv_heads)
        ffn = wg(block.feed_forward.w1).sum(1) + wg(block.feed_forward.w3).sum(1) + wg(block.feed_forward.w2).sum(0)
        out.append(LayerScores(q, kv, ffn))
    return out, float(loss.detach())


@pytest.mark.parametrize("family", [None, "qwen2", "qwen3"], ids=["llama", "qwen2", "qwen3"])
def test_scores_equal_autograd_on_a_plain_llama(process_group, family, tmp_path):
    """Also on transformers' Qwen2 (the q/k/v biases, non-zero, count for their heads) and Qwen3 folders."""
    from tests.helpers import hf_family_folder

    if family is None:
        scores, loss, weights, batches, args = score_assembled()
    else:
        folder = Path(hf_family_folder(tmp_path / family, family, num_hidden_layers=4))
        scores, loss, weights, batches, args = score_assembled(["--model.flavor", "hf"], load_from=folder)
        assert args.family == family
    expected, expected_loss = reference_scores(weights, args, batches)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    for got, want in zip(scores, expected, strict=True):
        for field in ("q_heads", "kv_heads", "ffn"):
            torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------------------------------ the script


def test_script_refuses_what_a_hugging_face_config_cannot_hold():
    prune = load_script("prune")
    opts = prune.parse_args(["--hf_assets_path", "x", "--output_dir", "y", "--method", "taylor_structured",
                             "--keep_first_last"])
    with pytest.raises(ConfigError, match="--keep_first_last would give the first and last layers other widths"):
        prune.check_structured(opts)
    opts = prune.parse_args(["--hf_assets_path", "x", "--output_dir", "y", "--method", "taylor_structured",
                             "--head_ratio", "1.0"])
    with pytest.raises(ConfigError, match=r"--head_ratio 1.0 must be a fraction in \[0, 1\)"):
        prune.check_structured(opts)
    opts = prune.parse_args(["--hf_assets_path", "x", "--output_dir", "y", "--ffn_ratio", "0.5"])
    assert "apply to --method taylor_structured, not wanda" in prune.refuse_flags(opts)


def source_folder(folder: Path) -> dict:
    """A random tiny model as an HF folder with the bundled tokenizer; its titan_lite state dict."""
    args = flavor_args("tiny")
    model = Llama(args)
    model.init_weights(seed=5)
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    write_hf_folder(sd, args, str(folder), torch.float32, str(ROOT / "assets" / "tokenizer"))
    return sd


def continued_pretraining_start(folder: Path, initial: list[str] | None = None) -> Llama:
    """The model a training run starts from with model.flavor 'hf' and the pruned folder (default) as its initial
    weights."""
    initial = initial or ["--checkpoint.initial_load_in_hf", "true"]
    cfg = parse_args(["--job.config_file", BASE, "--model.flavor", "hf", "--model.hf_assets_path", str(folder),
                      *initial])
    plan = plan_job(cfg, 1)
    plan.parallel_dims.build_mesh("cpu")
    built = assemble_model(plan, torch.device("cpu"), load=plan_initial(plan.cfg))
    return built.parts[0].eval()


def test_continued_pretraining_starts_from_the_pruned_folder_or_its_dcp_conversion(process_group, tmp_path):
    """The materialised model (explicit head_dim) as a run's initial weights: the HF folder itself, or a DCP
    checkpoint made from it by scripts/convert_checkpoint.py, with model.flavor 'hf'."""
    args = flavor_args("tiny")
    model = Llama(args)
    model.init_weights(seed=2)
    keep = StructureKeep(layers=[0, 2, 3], q_heads=[[1, 2]] * 3, kv_heads=[[0, 1]] * 3,
                         ffn=[list(range(0, 192, 2))] * 3, hidden=[i for i in range(64) if i % 8 < 5])
    new_args, new_sd = materialize_state_dict({n: p.detach() for n, p in model.named_parameters()}, args, keep)
    write_materialized_hf(new_sd, new_args, tmp_path / "pruned", torch.float32, str(ROOT / "assets" / "tokenizer"))
    assert load_script("convert_checkpoint").main(["hf-to-dcp", str(tmp_path / "pruned"), str(tmp_path / "dcp")]) == 0
    for initial in (["--checkpoint.initial_load_in_hf", "true"],
                    ["--checkpoint.initial_load_path", str(tmp_path / "dcp")]):
        started = continued_pretraining_start(tmp_path / "pruned", initial)
        assert (started.args.head_dim, started.args.dim, started.args.n_layers) == (16, 40, 3)
        assert all(torch.equal(p.detach(), new_sd[n]) for n, p in started.named_parameters()), initial


@pytest.mark.parametrize("layout", [[], ["--tp", "2"]], ids=["fsdp2", "tp2"])
def test_prune_script_on_two_processes_writes_the_model_one_process_selects(process_group, tmp_path, layout):
    """torchrun, 2 processes (FSDP 2 or TP 2): the report's keep-set equals the one selected on one process, and the
    written model (as a training run loads it) computes what the dense model computes with those heads and channels
    masked."""
    sd = source_folder(tmp_path / "dense")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [*python_command(), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
         str(ROOT / "scripts" / "prune.py"), "--hf_assets_path", str(tmp_path / "dense"),
         "--output_dir", str(tmp_path / "pruned"), "--method", "taylor_structured", "--head_ratio", "0.5",
         "--ffn_ratio", "0.25", "--head_mode", "kv_group", "--nsamples", str(NSAMPLES), "--seq_len", str(SEQ),
         "--batch_size", "2", *layout], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"pruned model written to {tmp_path / 'pruned'}: 4 -> 2 heads, 2 -> 1 KV heads "
                           "(kv_group), ffn 192 -> 144 in each of 4 layers"), last
    report = json.loads((tmp_path / "pruned" / "structure_report.json").read_text())
    args = flavor_args("tiny")
    layers = report["layers"]
    keep = StructureKeep(layers=list(range(4)), q_heads=[e["q_heads"] for e in layers],
                         kv_heads=[e["kv_heads"] for e in layers], ffn=[e["ffn"] for e in layers],
                         hidden=list(range(args.dim)))
    scores, loss, *_ = score_assembled(load_from=tmp_path / "dense")
    assert keep == select_keep(scores, args, 0.5, 0.25, "kv_group")
    assert report["calibration"]["loss"] == pytest.approx(loss, rel=1e-6)

    new_args = args_from_hf_config(read_hf_config(tmp_path / "pruned" / "config.json"))
    assert (new_args.n_heads, new_args.kv_heads, new_args.ffn_dim, new_args.head_dim) == (2, 1, 144, 16)
    pruned_sd = read_hf_folder(str(tmp_path / "pruned"), new_args)
    assert report["parameters"]["after"] == sum(t.numel() for t in pruned_sd.values())
    pruned_model = continued_pretraining_start(tmp_path / "pruned")
    assert replace(pruned_model.args, max_seq_len=new_args.max_seq_len) == new_args  # the run picks its length
    assert all(torch.equal(p.detach(), pruned_sd[n]) for n, p in pruned_model.named_parameters())
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = pruned_model(tokens)
    assert (got - masked_forward(sd, args, tokens, masks_of(keep, args))).abs().max() < 1e-5


def test_prune_script_removes_qwen2_heads_with_their_biases(tmp_path):
    """transformers' Qwen2 folder through scripts/prune.py --method taylor_structured (one process): a smaller
    Qwen2ForCausalLM whose logits are the source's with the removed heads and channels masked (their q/k/v bias
    entries removed with them)."""
    from tests.helpers import hf_family_folder

    source = Path(hf_family_folder(tmp_path / "qwen2", "qwen2", num_hidden_layers=4))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # not the process_group fixture's group
    proc = subprocess.run(
        [*python_command(), str(ROOT / "scripts" / "prune.py"), "--hf_assets_path", str(source), "--output_dir",
         str(tmp_path / "pruned"), "--method", "taylor_structured", "--head_ratio", "0.5", "--ffn_ratio", "0.25",
         "--nsamples", str(NSAMPLES), "--seq_len", str(SEQ), "--batch_size", "2"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "pruned" / "structure_report.json").read_text())
    args = args_from_hf_config(read_hf_config(source / "config.json"))
    keep = StructureKeep(layers=list(range(4)), q_heads=[e["q_heads"] for e in report["layers"]],
                         kv_heads=[e["kv_heads"] for e in report["layers"]], ffn=[e["ffn"] for e in report["layers"]],
                         hidden=list(range(args.dim)))
    transformers = pytest.importorskip("transformers")
    pruned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", dtype=torch.float32).eval()
    assert type(pruned).__name__ == "Qwen2ForCausalLM" and pruned.config.num_attention_heads == 2
    assert pruned.model.layers[0].self_attn.q_proj.bias.shape == (2 * args.head_dim,)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    source_sd = read_hf_folder(str(source), args)
    with torch.no_grad():
        got = pruned(tokens).logits
    assert (got - masked_forward(source_sd, args, tokens, masks_of(keep, args))).abs().max() < 1e-4
