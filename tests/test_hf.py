"""Hugging Face interop against transformers' LlamaForCausalLM: import, export, errors, offline DCP <-> HF scripts."""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

transformers = pytest.importorskip("transformers")

from tests.helpers import spawn_gloo  # noqa: E402
from tests.warm_python import python_command  # noqa: E402
from titan_lite.checkpoint.hf import export_hf, load_hf_weights, read_hf_folder  # noqa: E402
from titan_lite.config import JobConfig  # noqa: E402
from titan_lite.errors import ConfigError, pip_install  # noqa: E402
from titan_lite.job.plan import build_model_args  # noqa: E402
from titan_lite.models.args import LlamaArgs  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.flavors import flavor_args  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config, args_to_hf_config, check_args_against_hf_config  # noqa: E402
from titan_lite.models.hf.state_dict import from_hf_state_dict, to_hf_state_dict  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 300, 40
ROPE_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
VARIANTS = {
    "gqa": {},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {"rope_scaling": ROPE_LLAMA3, "max_position_embeddings": 128},
}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_model(seed: int = 0, **overrides) -> "transformers.LlamaForCausalLM":
    """A small random GQA LlamaForCausalLM; every weight (norms too) perturbed so nothing is left at its init."""
    kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=64)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def titan_model(args: LlamaArgs, seed: int = 0) -> Llama:
    model = Llama(args)
    model.init_weights(seed=seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def hf_logits(model) -> torch.Tensor:
    return model(tokens()).logits


@torch.no_grad()
def titan_logits(model: Llama) -> torch.Tensor:
    return model(tokens())


def load_titan_from_hf(folder: Path) -> Llama:
    args = args_from_hf_config(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=123)  # overwritten below; also rebuilds the RoPE cache
    load_hf_weights([model], str(folder), args)
    return model.eval()


def small_args(**overrides) -> LlamaArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_dim=128, rope_theta=10000.0,
                max_seq_len=64)
    base.update(overrides)
    return LlamaArgs(**base)


# ------------------------------------------------------------------------------------------ import


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_hf_checkpoint_loads_with_matching_logits(tmp_path, variant, sharded):
    reference = hf_model(**VARIANTS[variant])
    reference.save_pretrained(tmp_path, max_shard_size="40KB" if sharded else "5GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    model = load_titan_from_hf(tmp_path)
    assert model.args.tie_word_embeddings == (variant == "tied")
    torch.testing.assert_close(titan_logits(model), hf_logits(reference), atol=1e-4, rtol=0)


def test_llama3_rope_scaling_is_read_and_matters(tmp_path):
    reference = hf_model(**VARIANTS["llama3_rope"])
    reference.save_pretrained(tmp_path)
    args = args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert (args.rope_scaling_factor, args.rope_original_max_seq_len, args.max_seq_len) == (8.0, 16, 128)
    unscaled = load_titan_from_hf(tmp_path)
    unscaled.args.rope_scaling_factor = None
    from titan_lite.models.parts.rope import rope_cache

    unscaled.rope_cache = rope_cache(unscaled.args)
    assert (titan_logits(unscaled) - hf_logits(reference)).abs().max() > 1e-3


def test_state_dict_conversion_round_trips_and_permutes_only_q_k():
    args = small_args()
    sd = titan_model(args).state_dict()
    hf = to_hf_state_dict(sd, args)
    assert "lm_head.weight" in hf and "model.layers.1.mlp.gate_proj.weight" in hf
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"])
    torch.testing.assert_close(hf["model.layers.0.self_attn.v_proj.weight"], sd["layers.0.attention.wv.weight"])
    back = from_hf_state_dict(hf, args)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


# ------------------------------------------------------------------------------------------ export


@pytest.mark.parametrize("variant", ["gqa", "tied", "llama3_rope"])
def test_export_loads_in_transformers_with_matching_logits(tmp_path, variant):
    overrides = {"gqa": {}, "tied": {"tie_word_embeddings": True},
                 "llama3_rope": {"rope_scaling_factor": 8.0, "rope_original_max_seq_len": 16, "max_seq_len": 128}}
    args = small_args(**overrides[variant])
    model = titan_model(args, seed=1)
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (assets / "config.json").write_text('{"bos_token_id": 5, "eos_token_id": 6}')
    out = tmp_path / "hf"
    export_hf([model], args, str(out), torch.float32, str(assets), max_shard_bytes=50_000)
    assert (out / "model.safetensors.index.json").exists() and (out / "tokenizer_config.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["num_key_value_heads"]) == (5, 6, 2)
    assert ("lm_head.weight" in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]) == (
        variant != "tied")
    reference = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert reference.config.tie_word_embeddings == (variant == "tied")
    torch.testing.assert_close(hf_logits(reference), titan_logits(model), atol=1e-4, rtol=0)


def test_export_in_bfloat16_single_file_replaces_old_export(tmp_path):
    args = small_args()
    model = titan_model(args, seed=2)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    export_hf([model], args, str(out), torch.bfloat16, None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = read_hf_folder(str(out), args)
    for name, param in model.named_parameters():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], param.detach().to(torch.bfloat16)), name
    assert not list(tmp_path.glob(".hf.*"))  # no temporary folder left behind


def test_export_keeps_the_assets_context_length(tmp_path):
    args = small_args()
    assets = tmp_path / "assets"
    assets.mkdir()
    (assets / "config.json").write_text(json.dumps({**args_to_hf_config(replace(args, max_seq_len=4096), torch.float32),
                                                    "eos_token_id": 9}))
    export_hf([titan_model(args)], args, str(tmp_path / "hf"), torch.float32, str(assets))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["max_position_embeddings"], config["eos_token_id"]) == (4096, 9)


def test_pruned_model_round_trips_through_hf_folder(tmp_path):
    """Per-layer widths (structured pruning) are not representable in transformers; titan_lite reads its own export."""
    args = small_args(layer_n_heads=[4, 2], layer_n_kv_heads=[2, 1], layer_ffn_dims=[128, 48])
    model = titan_model(args, seed=5)
    export_hf([model], args, str(tmp_path / "hf"), torch.float32, None)
    loaded = load_titan_from_hf(tmp_path / "hf")
    assert loaded.args == args
    torch.testing.assert_close(titan_logits(loaded), titan_logits(model), atol=0, rtol=0)


def test_config_round_trip():
    args = small_args(rope_scaling_factor=32.0, rope_original_max_seq_len=8192, tie_word_embeddings=True,
                      norm_eps=1e-6)
    assert args_from_hf_config(args_to_hf_config(args, torch.bfloat16)) == args


# ------------------------------------------------------------------------------------------ errors


@pytest.fixture
def saved(tmp_path):
    """A sharded HF folder and the titan_lite model args matching it."""
    hf_model().save_pretrained(tmp_path, max_shard_size="40KB")
    return tmp_path, args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))


def fresh_model(args: LlamaArgs) -> Llama:
    model = Llama(args)
    model.init_weights()
    return model


def test_truncated_safetensors_names_the_file(saved):
    folder, args = saved
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(ConfigError, match=f"{shard.name}: corrupt or truncated safetensors file") as info:
        load_hf_weights([fresh_model(args)], str(folder), args)
    assert "\n" not in str(info.value)


def test_missing_shard_names_it(saved):
    folder, args = saved
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ConfigError, match=f"lists shard '{shard.name}' but .* does not exist"):
        load_hf_weights([fresh_model(args)], str(folder), args)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    args = args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    with pytest.raises(ConfigError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' \(titan_lite "
                                          r"'layers.1.feed_forward.w3.weight'\) is missing"):
        load_hf_weights([fresh_model(args)], str(tmp_path), args)


def test_wrong_shape_names_tensor_and_both_shapes(saved):
    folder, args = saved
    args.ffn_dim = 96
    with pytest.raises(ConfigError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\], "
                                          r"expected \[96, 64\]"):
        load_hf_weights([fresh_model(args)], str(folder), args)


def test_extra_layer_in_checkpoint_is_named(saved):
    folder, args = saved
    args.n_layers = 1
    with pytest.raises(ConfigError, match=r"tensor 'model.layers.1.input_layernorm.weight' has no counterpart in "
                                          r"the model \(1 layers\)"):
        load_hf_weights([fresh_model(args)], str(folder), args)


def test_unknown_tensor_name_is_a_config_error():
    with pytest.raises(ConfigError, match="tensor 'model.layers.0.self_attn.o_proj.bias' is not a LlamaForCausalLM"):
        from_hf_state_dict({"model.layers.0.self_attn.o_proj.bias": torch.ones(4)}, small_args())


def test_folder_without_weights(tmp_path):
    with pytest.raises(ConfigError, match="no model.safetensors or model.safetensors.index.json"):
        load_hf_weights([fresh_model(small_args())], str(tmp_path), small_args())


def test_unsupported_config_is_rejected():
    config = args_to_hf_config(small_args(), torch.float32)
    with pytest.raises(ConfigError, match="rope type 'longrope' is not supported"):
        args_from_hf_config({**config, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ConfigError, match="head_dim 7 is odd"):
        args_from_hf_config({**config, "head_dim": 7})


def test_explicit_head_dim_round_trips():
    """A structurally pruned model keeps its head_dim while hidden_size / num_attention_heads changes."""
    args = small_args(dim=48, explicit_head_dim=16)
    config = args_to_hf_config(args, torch.float32)
    assert config["head_dim"] == 16 and config["hidden_size"] == 48
    assert args_from_hf_config(config).head_dim == 16
    assert args_from_hf_config(args_to_hf_config(small_args(), torch.float32)).explicit_head_dim is None


def test_config_mismatch_names_field_and_both_values(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(args_to_hf_config(small_args(), torch.float32)))
    check_args_against_hf_config(small_args(max_seq_len=2048), str(path))  # sequence length may differ
    with pytest.raises(ConfigError, match=r"n_kv_heads is 4 in the model but 2 in config.json"):
        check_args_against_hf_config(small_args(n_kv_heads=4), str(path))
    with pytest.raises(ConfigError, match=r"rope_theta is 500000.0 in the model but 10000.0 in config.json"):
        check_args_against_hf_config(small_args(rope_theta=500000.0), str(path))


def test_build_model_args_checks_assets_config(tmp_path):
    cfg = JobConfig()
    cfg.model.flavor, cfg.model.hf_assets_path = "tiny", str(tmp_path)
    build_model_args(cfg, vocab_size=2048)  # no config.json: nothing to check
    other_vocab = replace(flavor_args("tiny"), vocab_size=300)
    (tmp_path / "config.json").write_text(json.dumps(args_to_hf_config(other_vocab, torch.float32)))
    with pytest.raises(ConfigError, match=r"config.json: vocab_size is 2048 in the model but 300 in config.json"):
        build_model_args(cfg, vocab_size=2048)


def test_float32_rounded_settings_agree_within_a_relative_tolerance(tmp_path):
    """Converted checkpoints store rms_norm_eps 1e-5 as float32 (9.999999747378752e-06): that is the same model."""
    path = tmp_path / "config.json"
    config = args_to_hf_config(flavor_args("tiny"), torch.float32)
    path.write_text(json.dumps({**config, "rms_norm_eps": 9.999999747378752e-06,
                                "rope_theta": float(torch.tensor(10000.0, dtype=torch.float32))}))
    check_args_against_hf_config(flavor_args("tiny"), str(path))
    path.write_text(json.dumps({**config, "rms_norm_eps": 1.1e-05}))
    with pytest.raises(ConfigError, match=r"norm_eps is 1e-05 in the model but 1.1e-05 in config.json"):
        check_args_against_hf_config(flavor_args("tiny"), str(path))


def test_flavor_hf_takes_the_shape_from_config_json(tmp_path):
    pruned = replace(flavor_args("tiny"), n_layers=3, ffn_dim=128, rope_theta=20000.0, norm_eps=1e-6)
    (tmp_path / "config.json").write_text(json.dumps(args_to_hf_config(pruned, torch.float32)))
    cfg = JobConfig()
    cfg.model.flavor, cfg.model.hf_assets_path, cfg.training.seq_len = "hf", str(tmp_path), 64
    assert build_model_args(cfg, vocab_size=2048) == replace(pruned, max_seq_len=64)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"'model.flavor' = 'hf' takes the model shape from a Hugging Face "
                                          r"config.json, but '.*config.json' does not exist"):
        build_model_args(cfg, vocab_size=2048)


# ------------------------------------------------------------------------------- offline conversion


def test_dcp_hf_round_trip_is_exact(tmp_path):
    convert = load_script("convert_checkpoint")
    args = small_args(tie_word_embeddings=True)
    model = titan_model(args, seed=4)
    dcp.save({"model": model.state_dict(), "train_state": {"step": 3}}, checkpoint_id=str(tmp_path / "step-3"),
             no_dist=True)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(args_to_hf_config(args, torch.float32)))
    assert convert.main(["dcp-to-hf", str(tmp_path / "step-3"), str(tmp_path / "hf"), "--hf-config", str(config),
                         "--dtype", "float32"]) == 0
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(hf_logits(reference), titan_logits(model), atol=1e-4, rtol=0)

    assert convert.main(["hf-to-dcp", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = {name: torch.empty_like(t) for name, t in model.state_dict().items()}
    dcp.load({"model": back}, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back[name], tensor), name


def test_dcp_to_hf_reports_shape_mismatch_and_wrong_prefix(tmp_path, capsys):
    convert = load_script("convert_checkpoint")
    dcp.save({"model": titan_model(small_args()).state_dict()}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert convert.main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--flavor", "tiny"]) == 2
    assert "tensor 'tok_embeddings.weight' has shape [300, 64], expected [2048, 64]" in capsys.readouterr().err
    assert convert.main(["dcp-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--flavor", "tiny",
                         "--key-prefix", "weights."]) == 2
    assert "no tensors under key prefix 'weights.'" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------- download script


def test_download_plan_patterns():
    download = load_script("download_hf_assets")
    plan = download.build_plan(download.parse_args(["meta-llama/Llama-3.2-1B"]))
    assert plan.local_dir == Path("assets/hf/Llama-3.2-1B") and plan.ignore_patterns is None
    assert "config.json" in plan.allow_patterns and "tokenizer.model" in plan.allow_patterns
    assert not any(p.endswith(".safetensors") for p in plan.allow_patterns)
    plan = download.build_plan(download.parse_args(["org/m", "--include", "weights", "--include", "*.txt",
                                                    "--exclude", "original/*", "--local-dir", "x"]))
    assert {"*.safetensors", "model.safetensors.index.json", "*.txt"} <= set(plan.allow_patterns)
    assert plan.ignore_patterns == ["original/*"] and plan.local_dir == Path("x")
    assert download.build_plan(download.parse_args(["org/m", "--all"])).allow_patterns is None
    with pytest.raises(download.DownloadError, match="'a/b/c' is not a repo id"):
        download.build_plan(download.parse_args(["a/b/c"]))


def test_download_without_huggingface_hub(monkeypatch, capsys, tmp_path):
    download = load_script("download_hf_assets")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    assert download.main(["org/m", "--local-dir", str(tmp_path / "m")]) == 1
    assert capsys.readouterr().err.strip() == ("error: huggingface_hub is not installed: "
                                               f"{pip_install('huggingface_hub')}")


def test_download_offline_is_one_clear_line(tmp_path):
    pytest.importorskip("huggingface_hub")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*python_command(), str(ROOT / "scripts" / "download_hf_assets.py"), "org/model",
                             "--local-dir", str(tmp_path / "model")], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: cannot reach the Hugging Face Hub (offline: HF_HUB_OFFLINE set or no network) and org/model "
        "is not in the local cache"]


def test_download_explains_gated_and_unauthorised():
    download = load_script("download_hf_assets")
    from huggingface_hub.errors import GatedRepoError

    gated = GatedRepoError.__new__(GatedRepoError)  # its constructor wants a live HTTP response
    Exception.__init__(gated, "403 gated")
    assert "hf auth login" in download.explain(gated, "meta-llama/Llama-3.2-1B")

    class Response:
        status_code = 401

    class Unauthorised(Exception):
        response = Response()

    message = download.explain(Unauthorised(), "org/private")
    assert message.startswith("not authorised to download org/private (HTTP 401)") and "HF_TOKEN" in message


# ------------------------------------------------------------------------- sharded and pipelined parts

LAYOUTS = {"fsdp": dict(dp_shard=2), "tp": dict(tp=2), "pp": dict(pp=2)}


def _parallel_parts(layout: str, args: LlamaArgs):
    """This rank's model parts and ParallelDims for one 2-rank layout (parameters still uninitialised)."""
    from titan_lite.parallel.parallel_dims import ParallelDims
    from titan_lite.parallel.parallelize import parallelize_llama
    from titan_lite.parallel.pipeline import prune_to_stage

    dims = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1)
    dims.update(LAYOUTS[layout])
    parallel_dims = ParallelDims(**dims, world_size=2)
    parallel_dims.build_mesh("cpu")
    with torch.device("meta"):
        model = Llama(args)
    if layout == "pp":
        stage = parallel_dims.submesh("pp").get_local_rank()
        parts = [prune_to_stage(model, [stage], is_first=stage == 0, is_last=stage == 1)]
    else:
        parts = [parallelize_llama(model, parallel_dims, JobConfig())]
    for part in parts:
        part.to_empty(device="cpu")
        part.init_weights(seed=99)
    return parts, parallel_dims


def _parallel_worker(rank: int, folder: str) -> None:
    from torch.distributed.tensor import DTensor

    args = args_from_hf_config(json.loads((Path(folder) / "hf" / "config.json").read_text()))
    for layout in LAYOUTS:
        parts, parallel_dims = _parallel_parts(layout, args)
        sharded = any(isinstance(p, DTensor) for part in parts for p in part.parameters())
        assert sharded == (layout != "pp"), layout
        load_hf_weights(parts, str(Path(folder) / "hf"), args)
        export_hf(parts, args, str(Path(folder) / f"out-{layout}"), torch.float32, None, parallel_dims,
                  max_shard_bytes=60_000)


def test_sharded_and_pipelined_parts_load_and_export_exactly(tmp_path):
    """FSDP and TP (DTensor shards) and pipeline stages (a tied head on the last stage) on 2 gloo processes:
    HF -> parts -> HF gives back the original tensors bit for bit."""
    from safetensors import safe_open

    hf_model(tie_word_embeddings=True).save_pretrained(tmp_path / "hf")
    spawn_gloo(_parallel_worker, 2, str(tmp_path))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        original = {name: f.get_tensor(name) for name in f.keys()}
    for layout in LAYOUTS:
        out = tmp_path / f"out-{layout}"
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(weight_map) == set(original), layout
        for name, shard in weight_map.items():
            with safe_open(str(out / shard), "pt") as f:
                assert torch.equal(f.get_tensor(name), original[name]), (layout, name)
