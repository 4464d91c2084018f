"""Qwen3.5-MoE against transformers' Qwen3_5MoeForCausalLM on random small models with wide weights: equal logits
(from transformers' per-expert save and from a release's fused experts), greedy generation, the HF round trip,
packed documents equal to one document per row, the load-balancing loss equal to load_balancing_loss_func, and bad
input refused in one line."""

import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func  # noqa: E402

from tests.hf_oracle import check_packed_equals_alone, load_titan  # noqa: E402
from tests.test_qwen3_5 import SMALL, tokens, widened  # noqa: E402
from titan_lite.checkpoint.hf import write_hf_folder  # noqa: E402
from titan_lite.errors import ConfigError  # noqa: E402
from titan_lite.generate.decode import GenerationConfig, generate  # noqa: E402
from titan_lite.models.decoder import Llama  # noqa: E402
from titan_lite.models.flavors import flavor_args  # noqa: E402
from titan_lite.models.hf.config import args_from_hf_config  # noqa: E402
from titan_lite.models.parts.moe import MoE  # noqa: E402

MOE = {**{k: v for k, v in SMALL.items() if k != "intermediate_size"}, "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "router_aux_loss_coef": 0.01}


def hf_moe(**overrides) -> Qwen3_5MoeForCausalLM:
    """A small model whose router and shared-expert gate are drawn wide too (a sharp routing, gates far from 0.5)."""
    torch.manual_seed(0)
    model = widened(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**MOE, **overrides})).eval().float())
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_moe")
    hf_moe().save_pretrained(folder)
    return folder


def test_logits_equal_transformers(saved):
    ids = tokens()
    args = load_titan(saved).args
    assert (args.family, args.n_experts, args.moe_top_k, args.moe_ffn_dim, args.moe_shared_ffn_dim,
            args.moe_layers) == ("qwen3_5_moe", 8, 2, 32, 48, [0, 1, 2, 3])
    with torch.no_grad():
        expected = Qwen3_5MoeForCausalLM.from_pretrained(saved).eval()(ids).logits
        ours = load_titan(saved)(ids)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)
