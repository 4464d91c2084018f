"""Qwen3.5 dense on the decoder in parts, against transformers' Qwen3_5ForCausalLM on random small models with wide
weights: equal logits, the HF round trip, the chunked delta rule equal to its recurrent form, packed documents equal
to one document per row (loss and gradients), and bad input refused in one line."""

import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

from titan_lite.checkpoint.hf import load_hf_weights, write_hf_folder  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.generate.cache import KVCache  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config, args_to_hf_config  # noqa: E402
from titan_lite.models.parts.gated_deltanet import chunked_delta_rule, recurrent_delta_rule  # noqa: E402

VOCAB = 512
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
             max_position_embeddings=256, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def widened(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every norm weight, A_log and dt_bias drawn far from its default, so a wrong norm form or decay shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(-2.0, 1.5, generator=generator))
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 2.0)
    return model


def hf_model(**overrides) -> Qwen3_5ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**{**SMALL, **overrides})
    return widened(Qwen3_5ForCausalLM(config).eval().float())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5")
    hf_model().save_pretrained(folder)
    return folder


def load_titan(folder, **overrides) -> Llama:
    args = replace(args_from_hf_config(json.loads((folder / "config.json").read_text())), **overrides)
    model = Llama(args)
    load_hf_weights([model], str(folder), args)
    return model.eval()


def tokens(batch: int = 2, seq: int = 77, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_the_schedule_and_options_are_read_from_config_json(saved):
    args = args_from_hf_config(json.loads((saved / "config.json").read_text()))
    assert args.family == "qwen3_5" and args.schedule == ["linear_attention"] * 3 + ["full_attention"]
    assert (args.attn_output_gate, args.norm_unit_offset, args.qk_norm, args.rotary_dim) == (True, True, True, 8)
    assert (args.linear_n_key_heads, args.linear_n_value_heads, args.linear_key_head_dim,
            args.linear_value_head_dim, args.linear_conv_kernel) == (2, 4, 16, 24, 4)


def test_logits_equal_transformers(saved):
    ids = tokens()
    with torch.no_grad():
        expected = Qwen3_5ForCausalLM.from_pretrained(saved).eval()(ids).logits
        ours = load_titan(saved)(ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
