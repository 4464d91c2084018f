"""Qwen2/2.5, Qwen3 and Mistral as options of the one decoder, against transformers' own classes: folders saved by
transformers load with the same logits, exports load back into the same class, the offline conversion round trip is
bit-exact, the published shapes are the flavors', and what the decoder cannot represent is one line naming the key."""

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from tests.helpers import hf_family_model  # noqa: E402
from tests.test_hf import load_script  # noqa: E402
from titan_lite.checkpoint.hf import load_hf_weights, write_hf_folder  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.flavors import flavor_args  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config, args_to_hf_config, flavor_of_hf_config  # noqa: E402

FAMILIES = ["qwen2", "qwen3", "mistral"]
SEQ = 40  # longer than the Mistral window (8): the window changes the logits


def tokens(vocab: int = 2048) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(7))


def load_titan(folder: Path) -> Llama:
    args = args_from_hf_config(json.loads((folder / "config.json").read_text()))
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=123)  # overwritten by the load; rebuilds the RoPE cache
    load_hf_weights([model], str(folder), args)
    return model.eval()


def safetensors_of(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each family's random model saved by transformers, with its logits on the test tokens."""
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        model = hf_family_model(family)
        model.save_pretrained(folder)
        with torch.no_grad():
            out[family] = (folder, model(tokens()).logits)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_folder_loads_with_the_same_logits(saved, family):
    folder, reference = saved[family]
    model = load_titan(folder)
    assert model.args.family == family
    assert (model.args.qkv_bias, model.args.qk_norm) == (family == "qwen2", family == "qwen3")
    assert model.args.sliding_window == (8 if family == "mistral" else None)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_round_trip_is_bit_exact_and_exports_the_same_class(saved, family, tmp_path):
    """transformers' folder -> hf-to-dcp -> dcp-to-hf gives the same tensors under the same names, a config.json of
    the same model_type and architecture, and transformers' class loads it with the same logits."""
    folder, reference = saved[family]
    convert = load_script("convert_checkpoint")
    assert convert.main(["hf-to-dcp", str(folder), str(tmp_path / "dcp")]) == 0
    assert convert.main(["dcp-to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--hf_config",
                         str(folder / "config.json")]) == 0
    original, back = safetensors_of(folder), safetensors_of(tmp_path / "hf")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name
    source, written = (json.loads((f / "config.json").read_text()) for f in (folder, tmp_path / "hf"))
    assert (written["model_type"], written["architectures"]) == (source["model_type"], source["architectures"])
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(exported).__name__ == source["architectures"][0]
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens()).logits, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("flavor", ["tiny_qwen3", "tiny_qwen2", "tiny_mistral"])
def test_titan_model_exports_to_its_family_with_the_same_logits(flavor, tmp_path):
    args = flavor_args(flavor)
    args.max_seq_len = 64
    model = Llama(args)
    model.init_weights(seed=2)
    with torch.no_grad():
        for param in model.parameters():  # norms and biases away from their init too
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    write_hf_folder(dict(model.named_parameters()), args, str(tmp_path / "hf"), torch.float32)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert exported.config.model_type == args.family
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens()).logits, model.eval()(tokens()), atol=1e-5, rtol=0)


def test_the_window_and_the_norms_matter():
    """The checks above could not fail if the window or the q/k norms did nothing on these shapes."""
    windowed, full = hf_family_model("mistral"), hf_family_model("mistral", sliding_window=None)
    qwen3 = hf_family_model("qwen3")
    with torch.no_grad():
        assert (windowed(tokens()).logits - full(tokens()).logits).abs().max() > 1e-2
        before = qwen3(tokens()).logits
        qwen3.model.layers[0].self_attn.q_norm.weight.mul_(2.0)
        assert (qwen3(tokens()).logits - before).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------ flavors

# The published config.json values of each flavor's model (Hugging Face Hub, the base models), the keys that set
# shapes and options.
PUBLISHED = {
    "qwen3_0.6B": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen3_1.7B": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "qwen3_4B": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True),
    "qwen3_8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    "qwen3_14B": dict(model_type="qwen3", hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=False),
    "qwen3_32B": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=False),
    "qwen2.5_0.5B": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         use_sliding_window=False, sliding_window=32768, max_window_layers=24),
    "qwen2.5_7B": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       use_sliding_window=False, sliding_window=131072, max_window_layers=28),
    "qwen2.5_72B": dict(model_type="qwen2", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, rms_norm_eps=1e-5,
                        tie_word_embeddings=False, use_sliding_window=False, sliding_window=131072,
                        max_window_layers=80),
    "mistral_7B": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, rms_norm_eps=1e-5,
                       rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False),
    "mistral_7B_v0.1": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rms_norm_eps=1e-5,
                            rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False),
}
_QWEN_DEFAULTS = dict(hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768)


@pytest.mark.parametrize("flavor", PUBLISHED)
def test_published_configs_are_the_flavors(flavor, tmp_path):
    config = {**_QWEN_DEFAULTS, **PUBLISHED[flavor]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert flavor_of_hf_config(tmp_path / "config.json") == flavor
    assert args_to_hf_config(flavor_args(flavor), torch.bfloat16)["model_type"] == config["model_type"]


@pytest.mark.parametrize("flavor, billions", [("qwen3_0.6B", 0.596), ("qwen3_8B", 8.191), ("qwen2.5_7B", 7.616),
                                              ("mistral_7B", 7.248)])
def test_flavor_parameter_counts(flavor, billions):
    """The published totals (tied embeddings counted once): the q/k norms and the biases are in the model."""
    with torch.device("meta"):
        model = Llama(flavor_args(flavor))
    assert round(model.num_params() / 1e9, 3) == billions


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("family, overrides, message", [
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 1},
     "'use_sliding_window' is true (sliding windows in the layers from max_window_layers = 1 on); titan_lite's qwen2 "
     "supports only false"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]},
     "'layer_types' has ['full_attention', 'sliding_attention']; titan_lite's qwen3 supports only 'full_attention'"),
    ("qwen3", {"attention_bias": True}, "'attention_bias' is True; titan_lite's Qwen3ForCausalLM supports only False"),
    ("qwen2", {"rope_scaling": {"type": "longrope", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "'rope_scaling': rope type 'longrope' is not supported; expected 'default', 'llama3', 'yarn', 'linear'"),
    ("qwen3", {"rope_scaling": {"type": "yarn", "factor": 4.0}},
     "'rope_scaling': rope type 'yarn' needs 'original_max_position_embeddings' (the context length the model was "
     "pre-trained with, e.g. 32768 for Qwen2.5/Qwen3)"),
    ("mistral", {"layer_types": ["sliding_attention", "full_attention"]},
     "'layer_types' mixes ['full_attention', 'sliding_attention']; titan_lite's MistralForCausalLM attends the same "
     "way in every layer"),
    ("gemma", {}, "model_type is 'gemma'; expected one of llama, qwen2, qwen3, qwen3_moe, mistral, mixtral, qwen3_5, "
     "qwen3_5_moe, gpt_oss, gemma3_text, deepseek_v3"),
])
def test_what_the_decoder_cannot_represent_is_one_line_naming_the_key(family, overrides, message):
    config = {**args_to_hf_config(flavor_args("tiny_qwen2"), torch.float32), "model_type": family, **overrides}
    with pytest.raises(ConfigError) as exc:
        args_from_hf_config(config, source="config.json")
    assert str(exc.value) == f"config.json: {message}"


# ------------------------------------------------------------------------------------------ scripts

TEXT = Path(__file__).resolve().parents[1] / "titan_lite/data/corpus/shakespeare/validation/midsummer_nights_dream.txt"


def transformers_mean_nll(folder: Path, seq_len: int, windows: int) -> float:
    """The mean token NLL transformers' own class gives on the same windows (the tokenizer is titan_lite's, checked
    against the tokenizers library in test_tokenizer.py)."""
    from titan_lite.data.tokenizer import build_tokenizer
    from titan_lite.eval.perplexity import read_text, text_windows

    ids = build_tokenizer(str(folder)).encode(read_text(str(TEXT)), bos=True, eos=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        losses = [model(input_ids=w[None], labels=w[None]).loss.item() for w in text_windows(ids, seq_len, windows)]
    return sum(losses) / len(losses)


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_ppl_script_gives_the_perplexity_transformers_gives(family, tmp_path, capsys):
    from tests.helpers import hf_family_folder

    folder = Path(hf_family_folder(tmp_path / family, family))
    argv = ["--hf_assets_path", str(folder), "--data", str(TEXT), "--seq_len", "32", "--max_windows", "6"]
    assert load_script("eval_ppl").main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    nll = float(lines[-2].rsplit("mean NLL: ", 1)[1])
    assert nll == pytest.approx(transformers_mean_nll(folder, 32, 6), rel=1e-5)
    assert float(lines[-1].removeprefix("perplexity: ")) == pytest.approx(math.exp(nll), rel=1e-4)


def test_prune_script_keeps_qwen2_biases_and_writes_what_transformers_loads(tmp_path, capsys):
    """Wanda 50% on Qwen2.5's shape: every block linear's rows half zeros, the q/k/v biases and the norms as they
    were, a Qwen2ForCausalLM folder whose logits are the pruned titan_lite model's."""
    from tests.helpers import hf_family_folder

    source = Path(hf_family_folder(tmp_path / "qwen2", "qwen2"))
    argv = ["--hf_assets_path", str(source), "--output_dir", str(tmp_path / "pruned"), "--method", "wanda",
            "--calib_path", str(TEXT), "--nsamples", "4", "--seq_len", "32"]
    assert load_script("prune").main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("pruned model written to")
    before, after = safetensors_of(source), safetensors_of(tmp_path / "pruned")
    assert sorted(after) == sorted(before)
    for name, tensor in after.items():
        if name.endswith("_proj.weight"):
            assert ((tensor == 0).sum(1) == tensor.shape[1] // 2).all(), name
        else:
            assert torch.equal(tensor, before[name]), name  # biases, norms, embeddings
    pruned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    assert type(pruned).__name__ == "Qwen2ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(load_titan(tmp_path / "pruned")(tokens()), pruned(tokens()).logits, atol=1e-5,
                                   rtol=0)


# ------------------------------------------------------------------------------------------ configs

SHIPPED = [("qwen3_8b_lora.toml", "1", 24, "lora"), ("qwen3_8b_qlora.toml", "1", 24, "lora"),
           ("mistral_7b_lora.toml", "1", 24, "lora"), ("qwen2.5_7b_wanda.toml", "8", 80, "prune")]


@pytest.mark.parametrize("config, ngpu, gib, transform", SHIPPED, ids=[c[0] for c in SHIPPED])
def test_shipped_family_configs_plan_with_dry_run(config, ngpu, gib, transform, capsys, monkeypatch):
    """Before any download (the bundled tokenizer stands in): the plan fits its devices; only data and weights are
    missing (exit 5)."""
    from titan_lite.config import parse_args
    from titan_lite.dry_run import dry_run

    monkeypatch.setenv("NGPU", ngpu)
    cfg = parse_args(["--job.config_file", f"train_configs/{config}", "--model.hf_assets_path", "./assets/tokenizer",
                      "--dry_run.device_memory_gib", str(gib)])
    assert dry_run(cfg) == 5
    out = capsys.readouterr().out
    family = flavor_args(cfg.model.flavor).family
    assert f"model: {family} {cfg.model.flavor}," in out and f"transforms: {transform}" in out
    assert "dry run OK" in out and float(re.search(r"largest peak ([\d.]+) GiB", out)[1]) < gib


def test_torchtitan_qwen3_flavor_names_are_refused_with_ours_named():
    """torchtitan's [model] name = "qwen3", flavor = "8B" is Qwen3 8B there; here '8B' is Llama 3.1 8B."""
    from titan_lite.config import parse_args
    from titan_lite.job.plan import build_model_args

    cfg = parse_args(["--model.name", "qwen3", "--model.flavor", "8B"])
    with pytest.raises(ConfigError) as exc:
        build_model_args(cfg, vocab_size=None)
    assert str(exc.value) == ("'model.name' = 'qwen3' but 'model.flavor' = '8B' is a llama model; the qwen3 flavors "
                              "are qwen3_0.6B, qwen3_1.7B, qwen3_4B, qwen3_8B, qwen3_14B, qwen3_32B (or 'hf' with a "
                              "qwen3 config.json)")


def _reference_attention(q, k, v, documents, window):
    """Attention written out in float64: a query sees the keys of its own document at most window - 1 positions
    before it (GQA by repeating the K/V heads)."""
    repeats = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(repeats, dim=1) for t in (k, v))
    index = torch.arange(q.shape[2])
    allowed = (documents[:, None, :, None] == documents[:, None, None, :]) & \
        (index[:, None] >= index[None, :]) & (index[:, None] - index[None, :] < window)
    scores = (q.double() @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


def test_the_sliding_window_holds_inside_packed_documents():
    """Mistral's window with block-causal packing (chat's packed documents): the per-document spans (eager CPU), the
    dense additive mask (compiled blocks, CUDA) and plain windowed attention of each document alone all equal the
    written-out attention; a packed tiny_mistral forward equals its documents run one at a time."""
    from titan_lite.models.parts.causal import CausalAttention

    torch.manual_seed(0)
    documents = torch.tensor([[0] * 12 + [1] * 5 + [2] * 15, [0] * 20 + [1] * 12])
    q, k, v = torch.randn(2, 4, 32, 16), torch.randn(2, 2, 32, 16), torch.randn(2, 2, 32, 16)
    attention = CausalAttention(window=8)
    expected = _reference_attention(q, k, v, documents, 8)
    for compiled in (False, True):
        mask = attention.document_mask(documents, torch.float32, compiled=compiled)
        torch.testing.assert_close(attention(q, k, v, mask).double(), expected, atol=1e-5, rtol=0)
    assert not torch.allclose(CausalAttention()(q, k, v, attention.document_mask(documents, torch.float32)).double(),
                              expected, atol=1e-3)  # the window matters in these documents

    args = flavor_args("tiny_mistral")
    model = Llama(args)
    model.init_weights(seed=3)
    tokens = torch.randint(0, args.vocab_size, (1, 32))
    row = documents[:1]
    starts = [0, 12, 17, 32]
    positions = torch.cat([torch.arange(e - s) for s, e in itertools.pairwise(starts)])[None]
    with torch.no_grad():
        packed = model(tokens, positions=positions, documents=row)
        alone = torch.cat([model(tokens[:, s:e]) for s, e in itertools.pairwise(starts)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)
