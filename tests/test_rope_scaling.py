"""Long-context RoPE (yarn, linear, llama3) against transformers: frequencies and attention factor as
transformers.modeling_rope_utils computes them, logits past the original context for each family and both config.json
forms (rope_scaling, rope_parameters), the export written back in the form it was read, [model.rope]'s TOML keys and
their one-line refusals, and the 128K Qwen3 example planned by DRY_RUN."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from tests.helpers import hf_family_model  # noqa: E402
from tests.test_families import load_titan  # noqa: E402
from titan_lite.checkpoint.hf import export_hf  # noqa: E402
from titan_lite.config import parse_args  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.job.plan import build_model_args  # noqa: E402
from titan_lite.models.args import LlamaArgs  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config  # noqa: E402
from titan_lite.models.parts.rope import rope_attention_factor, rope_cache, rope_frequencies  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ORIGINAL, SEQ = 32, 96  # the tests' original context, and a sequence three times as long

# ------------------------------------------------------------------------------ frequencies


def qwen3_8b_config(rope: dict) -> "transformers.Qwen3Config":
    return transformers.Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                    max_position_embeddings=131072, rope_parameters={"rope_theta": 1e6, **rope})


QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
ROPES = {
    "yarn": QWEN_YARN,
    "yarn_untruncated": {**QWEN_YARN, "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0},
    "yarn_attention_factor": {**QWEN_YARN, "attention_factor": 1.25},
    "yarn_mscale": {**QWEN_YARN, "mscale": 1.0, "mscale_all_dim": 0.5},
    "linear": {"rope_type": "linear", "factor": 8.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
}


@pytest.mark.parametrize("name", ROPES)
def test_frequencies_and_attention_factor_are_transformers(name):
    config = qwen3_8b_config(dict(ROPES[name]))
    inv_freq, attention = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")
    args = args_from_hf_config(config.to_dict())
    assert args.rope_scaling_type == ROPES[name]["rope_type"]
    torch.testing.assert_close(rope_frequencies(args).float(), inv_freq, rtol=1e-6, atol=0)
    assert rope_attention_factor(args) == pytest.approx(attention, rel=1e-12)


def test_qwen3_yarn_ramp_and_attention_factor():
    """Qwen3 (head_dim 128, base 1e6) at 4 x 32K: pairs below 23 keep their frequency, from 40 on they are divided by
    4, and cos and sin carry 0.1 ln 4 + 1."""
    args = args_from_hf_config(qwen3_8b_config(dict(QWEN_YARN)).to_dict())
    ratio = rope_frequencies(replace(args, rope_scaling_factor=None)) / rope_frequencies(args)
    assert torch.allclose(ratio[:24], torch.ones(24, dtype=torch.float64))
    assert torch.allclose(ratio[40:], torch.full((24,), 4.0, dtype=torch.float64))
    assert ((ratio[24:40] > 1) & (ratio[24:40] < 4)).all()
    assert rope_attention_factor(args) == pytest.approx(1.1386, abs=1e-4)
    cache = rope_cache(replace(args, max_seq_len=4))
    assert cache[3].norm(dim=-1) == pytest.approx(torch.full((64,), 0.1 * math.log(4) + 1), rel=1e-6)


# ------------------------------------------------------------------------------ logits past the original context

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}


def transformers_model(family: str, rope: dict):
    """A small random model of `family` whose config carries `rope` (rope_theta included) in rope_parameters."""
    if family != "llama":
        theta = {"qwen2": 1e6, "qwen3": 1e6, "mistral": 1e4}[family]
        return hf_family_model(family, rope_parameters={"rope_theta": theta, **rope})
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
                                      max_position_embeddings=128, rope_parameters={"rope_theta": 5e5, **rope})
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model


def as_published(folder: Path) -> dict:
    """Rewrite a transformers 5 config.json in the form the Hub's Qwen/Llama configs use: top-level rope_theta and
    rope_scaling with the old "type" key."""
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    rope.pop("type", None)
    config["rope_scaling"] = {"type": rope_type, **rope}
    (folder / "config.json").write_text(json.dumps(config))
    return config


def tokens() -> torch.Tensor:
    return torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(7))


def rope_entries(config: dict) -> dict:
    return {k: config.get(k) for k in ("rope_theta", "rope_scaling", "rope_parameters")}


CASES = [(family, form, "yarn") for family in FAMILIES for form in ("rope_scaling", "rope_parameters")]
CASES += [("llama", "rope_scaling", "linear"), ("qwen3", "rope_parameters", "yarn_options")]
ROPE_OF = {"yarn": YARN, "linear": {"rope_type": "linear", "factor": 4.0},
           "yarn_options": {**YARN, "beta_fast": 8.0, "beta_slow": 0.5, "truncate": False}}


@pytest.mark.parametrize("family, form, rope", CASES)
def test_logits_equal_transformers_past_the_original_context_and_export_keeps_the_form(tmp_path, family, form,
                                                                                         rope):
    source = tmp_path / "source"
    transformers_model(family, dict(ROPE_OF[rope])).save_pretrained(source)
    if form == "rope_scaling":
        as_published(source)
    reference = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        expected = reference(tokens()).logits
    model = load_titan(source)
    assert model.args.rope_scaling_type == ROPE_OF[rope]["rope_type"] and model.args.family == family
    with torch.no_grad():
        logits = model(tokens())
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    # past the original context the scaling matters: plain RoPE there is far off
    plain = replace(model.args, rope_scaling_factor=None)
    model.rope_cache = rope_cache(plain)
    with torch.no_grad():
        assert (model(tokens())[:, ORIGINAL:] - expected[:, ORIGINAL:]).abs().max() > 1e-3
    model.rope_cache = rope_cache(model.args)

    out = tmp_path / "export"
    export_hf([model], model.args, str(out), torch.float32, str(source))
    written, read = json.loads((out / "config.json").read_text()), json.loads((source / "config.json").read_text())
    if form == "rope_scaling":
        scaling = written["rope_scaling"]
        assert "rope_parameters" not in written and written["rope_theta"] == read["rope_theta"]
        assert scaling == {"rope_type": scaling["rope_type"], **{k: v for k, v in read["rope_scaling"].items()
                                                                 if k != "type"}}
    else:
        assert "rope_scaling" not in written and "rope_theta" not in written
        assert {k: v for k, v in written["rope_parameters"].items() if k != "type"} == \
            {k: v for k, v in read["rope_parameters"].items() if k != "type"}
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens()).logits, expected, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ [model.rope] in the TOML


def model_args(*overrides: str) -> LlamaArgs:
    return build_model_args(parse_args(["--model.name", "qwen3", "--model.flavor", "qwen3_8B", *overrides]), None)


def test_toml_adds_yarn_to_a_flavor_without_it():
    args = model_args("--model.rope.scaling", "yarn", "--model.rope.rope_factor", "4",
                      "--model.rope.original_seq_len", "32768", "--training.seq_len", "131072")
    reference = args_from_hf_config(qwen3_8b_config(dict(QWEN_YARN)).to_dict())
    for field in ("rope_scaling_type", "rope_scaling_factor", "rope_original_max_seq_len", "rope_beta_fast",
                  "rope_beta_slow", "rope_truncate", "rope_attention_factor", "rope_theta"):
        assert getattr(args, field) == getattr(reference, field), field
    assert args.max_seq_len == 131072
    # torchtitan's names: llama for Llama 3.1's scaling; a flavor's own scaling tuned by one key; none removes it
    llama = model_args("--model.rope.scaling", "llama", "--model.rope.rope_factor", "8")
    assert (llama.rope_scaling_type, llama.rope_original_max_seq_len) == ("llama3", 8192)
    tuned = build_model_args(parse_args(["--model.flavor", "8B", "--model.rope.high_freq_factor", "2"]), None)
    assert (tuned.rope_scaling_type, tuned.rope_scaling_factor, tuned.rope_high_freq_factor) == ("llama3", 8.0, 2.0)
    plain = build_model_args(parse_args(["--model.flavor", "8B", "--model.rope.scaling", "none"]), None)
    assert plain.rope_scaling_factor is None


@pytest.mark.parametrize("overrides, message", [
    (["--model.rope.scaling", "longrope"],
     "'model.rope.scaling' = 'longrope' is not one of: none, llama, llama3, yarn, linear"),
    (["--model.rope.scaling", "yarn", "--model.rope.rope_factor", "4"],
     "'model.rope.scaling' = 'yarn' needs 'model.rope.original_seq_len' (the context length the model was "
     "pre-trained with, e.g. 32768 for Qwen2.5/Qwen3)"),
    (["--model.rope.scaling", "yarn", "--model.rope.original_seq_len", "32768"],
     "'model.rope.scaling' = 'yarn' needs 'model.rope.rope_factor' (the factor the context grows by, e.g. 4.0)"),
    (["--model.rope.scaling", "dynamic", "--model.rope.rope_factor", "4"],
     "'model.rope.scaling' = 'dynamic' is not supported: dynamic NTK frequencies follow the longest sequence seen so "
     "far"),
    (["--model.rope.rope_factor", "4"],
     "'model.rope.rope_factor' = 4.0 has no effect: the model has no RoPE scaling (set 'model.rope.scaling' to yarn, "
     "llama or linear)"),
    (["--model.rope.scaling", "linear", "--model.rope.rope_factor", "4", "--model.rope.beta_fast", "16"],
     "'model.rope.beta_fast' is read only by yarn scaling, not 'model.rope.scaling' = 'linear'"),
    (["--model.rope.scaling", "linear", "--model.rope.rope_factor", "0.5"],
     "'model.rope.rope_factor' must be at least 1 (the factor the context grows by), got 0.5"),
])
def test_bad_rope_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as exc:
        model_args(*overrides)
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_config_json_rope_types_refused_in_one_line():
    config = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "vocab_size": 10, "intermediate_size": 8}
    for rope, message in [
        ({"rope_type": "longrope", "factor": 4.0},
         "config.json: 'rope_parameters': rope type 'longrope' is not supported; expected 'default', 'llama3', "
         "'yarn', 'linear'"),
        ({"rope_type": "yarn", "factor": 4.0},
         "config.json: 'rope_parameters': rope type 'yarn' needs 'original_max_position_embeddings'"),
        ({"rope_type": "dynamic", "factor": 2.0},
         "config.json: 'rope_parameters': rope type 'dynamic' is not supported: its frequencies follow the longest "
         "sequence seen so far"),
    ]:
        with pytest.raises(ConfigError) as exc:
            args_from_hf_config({**config, "rope_parameters": {"rope_theta": 1e6, **rope}})
        assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_the_scalings_listed_are_the_ones_accepted():
    """dynamic is refused with its reason, so the list of values a typo gets does not offer it."""
    with pytest.raises(ConfigError) as exc:
        parse_args(["--model.rope.scaling", "longrope"])
    assert str(exc.value) == "'model.rope.scaling' = 'longrope' is not one of: none, llama, llama3, yarn, linear"


@pytest.mark.parametrize("rope, message", [
    ('"yarn"', "'rope_scaling' is \"yarn\"; expected an object such as {\"rope_type\": \"yarn\", \"factor\": 4.0, "
     "\"original_max_position_embeddings\": 32768}, or null for plain RoPE"),
    ("[1, 2]", "'rope_scaling' is [1, 2]; expected an object such as"),
    ('{"factor": 4.0}', "'rope_scaling' has 'factor' 4.0 but no 'rope_type' (or 'type'), so it would evaluate as "
     "plain RoPE: name the scaling ('linear', 'llama3' or 'yarn'), or drop 'factor'"),
    ('{"type": "linear", "factor": 0.5}', "'rope_scaling': 'factor' is 0.5; expected a number of at least 1 (the "
     "factor the context grows by)"),
    ('{"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 32768}',
     "'rope_scaling': 'factor' is \"4\"; expected a number of at least 1"),
])
def test_config_json_rope_scaling_is_checked_as_strictly_as_the_toml(tmp_path, rope, message):
    """A run on an HF folder whose config.json's rope_scaling is not an object, has a factor without a type, or a
    bad factor: one line naming the file and its key (never model.rope's keys, which the user did not write)."""
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, '
        f'"vocab_size": 2048, "intermediate_size": 8, "rope_scaling": {rope}}}')
    with pytest.raises(ConfigError) as exc:
        build_model_args(parse_args(["--model.flavor", "hf", "--model.hf_assets_path", str(tmp_path)]), None)
    assert str(exc.value).startswith(f"{tmp_path / 'config.json'}: {message}"), str(exc.value)


# ------------------------------------------------------------------------------ DRY_RUN of the 128K example


def test_qwen3_128k_example_is_planned_by_dry_run_and_yarn_changes_no_memory(tmp_path, monkeypatch, capsys):
    """train_configs/qwen3_8b_lora_128k.toml on 8 ranks (CP 8): YaRN in the plan, and the same memory as plain RoPE
    (the cache keeps its shape; only its values change)."""
    from titan_lite.dry_run import dry_run

    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}: " + "the quick brown fox " * 50}) + "\n"
                            for i in range(4)))
    monkeypatch.setenv("NGPU", "8")
    monkeypatch.setenv("NNODES", "1")
    monkeypatch.chdir(REPO)
    outputs = []
    for extra in ([], ["--model.rope.scaling", "none", "--model.rope.rope_factor", "none",
                       "--model.rope.original_seq_len", "none"]):
        cfg = parse_args(["--job.config_file", str(REPO / "train_configs" / "qwen3_8b_lora_128k.toml"),
                          "--model.hf_assets_path", "./assets/tokenizer", "--training.dataset_path", str(data),
                          *extra])
        assert dry_run(cfg) == 5  # planned; the real run still needs the base weights
        outputs.append(capsys.readouterr().out)
    yarn, plain = outputs
    assert "mesh: world 8 = dp_replicate 1 x dp_shard 1 x cp 8 x tp 1 x pp 1" in yarn
    assert "rope: yarn x4 over the original 32,768 positions, attention factor 1.1386; theta 1e+06" in yarn
    assert "rope:" not in plain
    assert "global 1 sequences x 131072 tokens = 131,072 tokens per step" in yarn
    assert "activations" in yarn and "AC full; microbatch 1 x seq 131072 / cp 8" in yarn
    assert "dry run OK: 8 ranks" in yarn
    memory = [out[out.index("memory per device"):] for out in outputs]
    assert memory[0] == memory[1]
