"""Depth pruning (scripts/prune.py --method depth): blocks made identity maps (zero wo and w2) are exactly the ones
removed, on one process and under torchrun (FSDP 2, TP 2: the same scores); the written folder loads in transformers
and computes what titan_lite's pruned model computes, and what the original computes (its removed blocks did
nothing); explicit --layers_to_remove, the refusals and --estimate_only."""

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.warm_python import python_command
from titan_lite.checkpoint.hf import read_hf_folder, write_hf_folder
from titan_lite.errors import ConfigError
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.models.hf.config import args_from_hf_config, read_hf_config
from titan_lite.transforms.structured.depth import blocks_to_remove, check_removal, depth_keep
from titan_lite.transforms.structured.materialize import materialize_state_dict

REPO = Path(__file__).resolve().parents[1]
IDENTITY = (1, 3)
CALIBRATION = ["--nsamples", "4", "--seq_len", "64", "--batch_size", "2"]


def identity_blocks_model() -> Llama:
    """The tiny flavor, perturbed away from its initialisation, with blocks 1 and 3 made identity maps: their
    attention and MLP outputs are zero (wo = w2 = 0), so each returns its input."""
    model = Llama(flavor_args("tiny"))
    model.init_weights(seed=5)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        for i in IDENTITY:
            model.layers[str(i)].attention.wo.weight.zero_()
            model.layers[str(i)].feed_forward.w2.weight.zero_()
    return model.eval()


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, Llama]:
    model = identity_blocks_model()
    folder = tmp_path_factory.mktemp("depth") / "dense"
    write_hf_folder({n: p.detach() for n, p in model.named_parameters()}, model.args, str(folder), torch.float32,
                    str(REPO / "assets/tokenizer"))
    return folder, model


def prune(source_folder: Path, out: Path, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else []
    return subprocess.run([*python_command(), *launch, str(REPO / "scripts" / "prune.py"), "--hf_assets_path",
                           str(source_folder), "--output_dir", str(out), "--method", "depth", *args],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


@pytest.fixture(scope="module")
def one_process(source, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("depth") / "pruned"
    done = prune(source[0], out, "--remove_layers", "2", *CALIBRATION)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith(f"pruned model written to {out}: blocks [1, 3] removed, "
                                                           "4 -> 2 blocks; 459,328 -> 360,768 parameters")
    return out, json.loads((out / "depth_report.json").read_text())


def test_the_identity_blocks_are_exactly_the_ones_removed(one_process):
    _, report = one_process
    scores = {int(i): s for i, s in report["block_influence"].items()}
    assert report["removed"] == [1, 3] and report["kept"] == [0, 2]
    assert all(abs(scores[i]) < 1e-6 for i in IDENTITY)
    assert all(scores[i] > 1e-4 for i in (0, 2)), scores


def test_the_folder_loads_in_transformers_and_computes_the_pruned_model(source, one_process):
    """transformers' logits of the written folder = titan_lite's forward of the pruned model read from it = the
    original model's (the removed blocks were identities)."""
    from transformers import LlamaForCausalLM

    out, _ = one_process
    args = args_from_hf_config(read_hf_config(out / "config.json"))
    assert args.n_layers == 2 and (args.dim, args.n_heads, args.kv_heads, args.ffn_dim) == (64, 4, 2, 192)
    pruned = Llama(args)
    pruned.load_state_dict(read_hf_folder(str(out), args), strict=False)
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ours, theirs, original = pruned.eval()(tokens), reference(input_ids=tokens).logits, source[1](tokens)
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - original).abs().max() < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["--tp", "2"]], ids=["fsdp2", "tp2"])
def test_two_processes_score_the_blocks_as_one_does(source, one_process, tmp_path, layout):
    done = prune(source[0], tmp_path / "pruned", "--remove_layers", "2", *CALIBRATION, *layout, nproc=2)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report, expected = json.loads((tmp_path / "pruned" / "depth_report.json").read_text()), one_process[1]
    assert report["removed"] == [1, 3]
    for block, score in expected["block_influence"].items():
        assert report["block_influence"][block] == pytest.approx(score, abs=1e-6), block


def test_explicit_blocks_and_the_keep_set_of_the_rest(source, tmp_path):
    assert prune_script().main(["--hf_assets_path", str(source[0]), "--output_dir", str(tmp_path / "pruned"),
                                "--method", "depth", "--layers_to_remove", "0,3", *CALIBRATION]) == 0
    report = json.loads((tmp_path / "pruned" / "depth_report.json").read_text())
    assert report["removed"] == [0, 3] and report["chosen_by"] == "--layers_to_remove"
    assert len(report["block_influence"]) == 4  # every block is still scored and reported
    model = source[1]
    new_args, new_sd = materialize_state_dict({n: p.detach() for n, p in model.named_parameters()}, model.args,
                                              depth_keep(model.args, [0, 3]))
    written = read_hf_folder(str(tmp_path / "pruned"), new_args)
    assert new_args.n_layers == 2 and all(torch.equal(written[n], new_sd[n]) for n in new_sd)
    assert torch.equal(written["layers.0.attention.wq.weight"], model.layers["1"].attention.wq.weight.detach())


def test_lowest_scores_go_first_and_bad_removals_are_one_line():
    assert blocks_to_remove([0.3, 0.1, 0.2, 0.1], 2) == [1, 3]
    assert blocks_to_remove([0.3, 0.1, 0.2, 0.1], 3) == [1, 2, 3]
    for removed, message in (([1, 1], "names a block twice"), ([0, 4], "[4] are not among them"),
                             ([0, 1, 2, 3], "would remove all 4 blocks"), ([], "removes no block")):
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            check_removal(removed, 4, "--layers_to_remove")


@pytest.mark.parametrize("args, message", [
    (["--method", "depth"], "needs one of --remove_layers K"),
    (["--method", "depth", "--remove_layers", "2", "--layers_to_remove", "1"],
     "error: --remove_layers 2 and --layers_to_remove 1 both choose the blocks to remove: give one, not both"),
    (["--method", "depth", "--remove_layers", "4"], "would remove every one of the model's 4 blocks"),
    (["--method", "depth", "--layers_to_remove", "1,x"], "is not a comma list of block indices"),
    (["--method", "wanda", "--remove_layers", "2"], "apply to --method depth, not wanda"),
    (["--method", "depth", "--remove_layers", "1", "--layer_ratios", "owl"], "--layer_ratios applies to magnitude"),
    (["--method", "wanda", "--pattern", "2:4", "--layer_ratios", "owl"], "'pruning.layer_ratios' = 'owl' gives each"),
])
def test_refusals_are_one_line(source, tmp_path, capsys, args, message):
    code = prune_script().main(["--hf_assets_path", str(source[0]), "--output_dir", str(tmp_path / "out"), *args,
                                *CALIBRATION])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def prune_script():
    spec = importlib.util.spec_from_file_location("prune_script", REPO / "scripts" / "prune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_estimate_only_plans_the_scoring_of_8b(capsys):
    code = prune_script().main(["--flavor", "8B", "--hf_assets_path", str(REPO / "assets/tokenizer"), "--estimate_only",
                                "--method", "depth", "--remove_layers", "8", "--nsamples", "64", "--seq_len", "2048",
                                "--ngpu", "2", "--device_memory_gib", "24"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "8,030,261,248 parameters, 32 blocks" in out
    weights = float(out.split("weights")[1].split("GiB")[0])
    assert weights == pytest.approx(8_030_261_248 / 2 * 2 / 1024**3, abs=0.01)  # bf16, sharded over 2
    assert out.strip().splitlines()[-1].endswith("per device fits 24.00 GiB")
