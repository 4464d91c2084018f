"""LoRA on an MXFP4 base (lora.base_dtype = "mxfp4"): gpt-oss's experts kept as the release stores them (uint8
blocks and E8M0 scales, bit for bit from an MXFP4 folder, quantized alike from a bfloat16 one), the model's logits and
adapter gradients equal the dequantized model's with the same adapters (float32), one expert's decoding equals the
release's, an export without expert adapters writes the experts back as loaded, and the refusals, one line each."""

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.test_gpt_oss import hf_model, tokens  # noqa: E402
from tests.test_gpt_oss_mxfp4 import mxfp4_folder  # noqa: E402
from tests.test_pruning import BASE, process_group  # noqa: E402, F401
from titan_lite.checkpoint.resume import plan_resume  # noqa: E402
from titan_lite.config import parse_args  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.job.assembly import assemble_model  # noqa: E402
from titan_lite.job.plan import plan_job  # noqa: E402
from titan_lite.models.hf import mxfp4  # noqa: E402
from titan_lite.transforms.mxfp4 import packed_hf_tensors  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LORA = ["--model.converters", "lora", "--lora.base_dtype", "mxfp4", "--lora.target_modules", "wq,wv,experts",
        "--lora.rank", "4", "--lora.init", "gaussian", "--training.dtype", "float32",
        "--training.mixed_precision_param", "float32"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4_base")
    # MXFP4 blocks need widths divisible by 32; the bundled tokenizer's vocabulary
    hf_model(intermediate_size=64, vocab_size=2048).save_pretrained(root / "bf16")
    folder = mxfp4_folder(root / "bf16", root / "mxfp4")
    for target in (root / "bf16", folder):
        shutil.copy2(REPO / "assets/tokenizer/tokenizer.model", target)
    return root / "bf16", folder


def build(folder, *overrides: str):
    cfg = parse_args(["--job.config_file", BASE, "--model.flavor", "hf", "--model.hf_assets_path", str(folder),
                      "--checkpoint.initial_load_in_hf", *LORA, *overrides])
    plan = plan_job(cfg, 1)
    plan.parallel_dims.build_mesh("cpu")
    return assemble_model(plan, torch.device("cpu"), load=plan_resume(cfg)), plan


def randomised_adapters(model: torch.nn.Module) -> None:
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("lora_a", "lora_b")):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))


@pytest.mark.usefixtures("process_group")
def test_the_release_blocks_are_kept_bit_for_bit_and_a_bf16_folder_quantizes_alike(folders):
    bf16, folder = folders
    released = load_file(folder / "model.safetensors")
    for source in (folder, bf16):
        built, _ = build(source)
        state = {n: p.detach() for n, p in built.parts[0].named_parameters()}
        blocks = state["layers.1.moe.experts.w1_blocks"]
        assert blocks.dtype == torch.uint8 and list(blocks.shape) == [4, 64, 2, 16]
        rest, hf = packed_hf_tensors(state)
        assert not any(n.endswith(("_blocks", "_scales")) for n in rest)
        for name, tensor in hf.items():
            assert torch.equal(tensor, released[name]), (source.name, name)


@pytest.mark.usefixtures("process_group")
def test_logits_and_adapter_gradients_equal_the_dequantized_model_with_the_same_adapters(folders):
    """float32: the MXFP4 base against the same folder dequantized on load into a float32 base, same adapters."""
    _, folder = folders
    built, _ = build(folder)
    twin, _ = build(folder, "--lora.base_dtype", "float32")
    model, dense = built.parts[0], twin.parts[0]
    randomised_adapters(model)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    dense_params = dict(dense.named_parameters())
    with torch.no_grad():
        for name, param in adapters.items():
            dense_params[name].copy_(param)
    assert sorted(adapters) == sorted(n for n, p in dense_params.items() if p.requires_grad)
    assert len(adapters) == 4 * 2 * 2 + 4 * 2 * 2  # wq, wv and the two expert groups of 4 layers, A and B each
    ids = tokens(2, 40)
    ours, theirs = model(ids), dense(ids)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    for name, param in adapters.items():
        torch.testing.assert_close(param.grad, dense_params[name].grad, rtol=1e-5, atol=1e-7, msg=name)


MXFP4 = ["--model.converters", "lora", "--lora.base_dtype", "mxfp4", "--lora.target_modules", "wq,experts",
         "--training.seq_len", "32"]


@pytest.mark.parametrize("overrides, message", [
    (["--model.flavor", "tiny", "--lora.target_modules", "wq"],
     "lora.base_dtype='mxfp4' needs a model whose experts are released in MXFP4 (gpt-oss: model_type gpt_oss); this "
     "model is 'llama' without MoE layers: use base_dtype 'nf4' (QLoRA) or 'bfloat16'"),
    (["--model.flavor", "tiny_gpt_oss", "--model.converters", "lora,prune"],
     "lora.base_dtype='mxfp4' cannot be combined with converter 'prune' in 'model.converters'"),
    (["--model.flavor", "tiny_gpt_oss"],
     "lora.base_dtype='mxfp4' keeps the experts of the base's Hugging Face folder: set "
     "'checkpoint.initial_load_in_hf' = true"),
])
def test_refusals_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        plan_job(parse_args(["--job.config_file", BASE, *MXFP4, *overrides]), 1)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_one_experts_dequantization_equals_the_release_decoding():
    """Every byte and every scale the format has (2^-127 .. 2^127), in bfloat16 and float32, exactly."""
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 255, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.arange(0, 255, dtype=torch.uint8).view(1, 255, 1).expand(3, 255, 2).contiguous()
    # by hand, in float64: each byte's low nibble then high nibble as e2m1 values, each 32-value block times 2^(s-127)
    values = torch.tensor(mxfp4.FP4_VALUES, dtype=torch.float64)
    pairs = torch.stack([values[(blocks & 0x0F).long()], values[(blocks >> 4).long()]], dim=-1).flatten(-2)
    by_hand = (pairs * torch.exp2(scales.double() - 127).unsqueeze(-1)).flatten(-2)
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.stack([mxfp4.dequantize_rows(b, s, dtype) for b, s in zip(blocks, scales, strict=True)])
        assert torch.equal(got, by_hand.to(dtype)), dtype


@pytest.mark.usefixtures("process_group")
def test_an_export_without_expert_adapters_writes_the_experts_as_loaded(folders, tmp_path):
    """LoRA on attention only: the merged export holds the release's blocks and scales bit for bit with its
    quantization_config, and transformers' dequantizing load of it gives the run's logits."""
    from transformers import GptOssForCausalLM

    from titan_lite.checkpoint.hf import gather_full_state_dict, write_hf_folder

    _, folder = folders
    built, plan = build(folder, "--lora.target_modules", "wq,wv")
    model = built.parts[0]
    randomised_adapters(model)
    state, args = plan.transforms.export_state_dict(gather_full_state_dict(built.parts, torch.float32),
                                                    plan.model_args)
    write_hf_folder(state, args, str(tmp_path / "out"), torch.float32, str(folder))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    written, released = load_file(tmp_path / "out" / "model.safetensors"), load_file(folder / "model.safetensors")
    quantized = sorted(n for n in released if n.endswith(("_blocks", "_scales")))
    assert len(quantized) == 16 and all(torch.equal(written[n], released[n]) for n in quantized)
    ids = tokens(2, 40)
    with torch.no_grad():
        theirs = GptOssForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager",
                                                   dtype=torch.float32).eval()
        torch.testing.assert_close(theirs(ids).logits, model(ids), rtol=0, atol=1e-5)
