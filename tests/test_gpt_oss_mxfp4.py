"""gpt-oss's MXFP4 experts in: a folder made by quantizing a random small model's experts as the release stores them
(*_blocks / *_scales, a quantization_config) loads with transformers' own dequantized weights and logits, and
exports unquantized."""

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import GptOssForCausalLM  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from tests.hf_oracle import load_titan  # noqa: E402
from tests.test_gpt_oss import hf_model, tokens  # noqa: E402
from titan_lite.checkpoint.hf import read_hf_folder, write_hf_folder  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.models.hf import mxfp4  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config  # noqa: E402
from titan_lite.models.hf.state_dict import to_hf_state_dict  # noqa: E402

# the release's config (modules kept in bf16 named as openai/gpt-oss-20b's config.json names them)
QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
EXPERTS = ("gate_up_proj", "down_proj")


def mxfp4_folder(source, folder):
    """`source`'s HF folder with every expert matrix replaced by its MXFP4 pair, as the release stores them."""
    folder.mkdir()
    tensors = load_file(source / "model.safetensors")
    for name in [n for n in tensors if n.endswith(EXPERTS)]:
        tensors.update(zip(mxfp4.quantized_names(name), mxfp4.quantize(tensors.pop(name)), strict=True))
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf_model(intermediate_size=64).save_pretrained(root / "bf16")  # MXFP4 blocks need widths divisible by 32
    return root / "bf16", mxfp4_folder(root / "bf16", root / "mxfp4")


def transformers_dequantized(folder) -> GptOssForCausalLM:
    """transformers' own MXFP4 load: without the triton kernels (the CPU) it dequantizes into the float32 model."""
    return GptOssForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()


def test_the_folder_is_in_the_release_format(folders):
    _, folder = folders
    tensors = load_file(folder / "model.safetensors")
    blocks, scales = (tensors[f"model.layers.0.mlp.experts.gate_up_proj{s}"] for s in ("_blocks", "_scales"))
    assert (blocks.dtype, list(blocks.shape), scales.dtype, list(scales.shape)) == \
        (torch.uint8, [4, 128, 2, 16], torch.uint8, [4, 128, 2])  # [E, 2 hidden, dim / 32, 16], [E, 2 hidden, dim / 32]
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in tensors  # biases stay unquantized
    torch.testing.assert_close(mxfp4.dequantize(blocks, scales), convert_moe_packed_tensors(blocks, scales),
                               rtol=0, atol=0)


def test_logits_equal_transformers_dequantized_mxfp4(folders, caplog):
    bf16, folder = folders
    ids = tokens()
    with caplog.at_level(logging.INFO, logger="titan_lite"):
        ours = load_titan(folder)
    assert "8 expert tensors are MXFP4 (*_blocks / *_scales): dequantized on load" in caplog.text
    theirs = transformers_dequantized(folder)
    ours_hf = to_hf_state_dict(ours.state_dict(), ours.args)
    for name, tensor in theirs.state_dict().items():
        if name.endswith(EXPERTS):
            assert tensor.dtype == torch.float32
            torch.testing.assert_close(ours_hf[name], tensor, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        expected = theirs(ids).logits
        torch.testing.assert_close(ours(ids), expected, rtol=0, atol=1e-5)
        assert (load_titan(bf16)(ids) - expected).abs().max() > 1e-3  # the 4-bit rounding shows: it was dequantized


def test_export_is_unquantized_and_loads_in_transformers(folders, tmp_path):
    _, folder = folders
    model = load_titan(folder)
    write_hf_folder(model.state_dict(), model.args, str(tmp_path / "out"), torch.bfloat16)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert "quantization_config" not in config and not any(n.endswith(("_blocks", "_scales")) for n in exported)
    assert exported["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    dequantized = mxfp4.dequantize(*(load_file(folder / "model.safetensors")[f"model.layers.0.mlp.experts.down_proj{s}"]
                                     for s in ("_blocks", "_scales")))
    torch.testing.assert_close(exported["model.layers.0.mlp.experts.down_proj"], dequantized, rtol=0, atol=0)
    ids = tokens(1, 40)
    with torch.no_grad():
        reloaded = GptOssForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager",
                                                     dtype=torch.float32).eval()
        torch.testing.assert_close(reloaded(ids).logits, load_titan(tmp_path / "out")(ids), rtol=0, atol=1e-5)


def test_bad_mxfp4_input_is_one_line(folders, tmp_path):
    bf16, folder = folders
    config = json.loads((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match="^config.json: 'quantization_config' is 'fp8'; titan_lite's GptOss"):
        args_from_hf_config({**config, "quantization_config": {"quant_method": "fp8"}})
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    scales = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[scales] = tensors[scales][:, :3].clone()
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ConfigError, match=r"MXFP4 tensors '.*down_proj_blocks' .* do not pair"):
        read_hf_folder(str(broken), load_titan(bf16).args)
