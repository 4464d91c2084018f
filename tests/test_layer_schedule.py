"""The per-layer schedule (`layer_types`): derived from the options when absent, each layer built with the mixer its
entry names (full or sliding attention), packed documents and the KV cache following each layer's window, and an
unknown, mis-sized or windowless schedule refused in one line."""

from dataclasses import replace

import pytest
import torch

from titan_lite.errors import ConfigError
from titan_lite.generate.cache import KVCache
from titan_lite.models.args import LlamaArgs
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import FLAVORS, flavor_args
from titan_lite.models.hf.config import args_from_hf_config, args_to_hf_config
from titan_lite.models.parts.mixers import MIXERS

MIXED = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SEQ = 20  # longer than tiny_mistral's window (8)


def model_of(args: LlamaArgs, seed: int = 0) -> Llama:
    model = Llama(replace(args, max_seq_len=64))
    model.init_weights(seed=seed)
    return model.eval()


def windows(model: Llama) -> list[int | None]:
    return [block.attention.window for block in model.layers.values()]


def tokens() -> torch.Tensor:
    return torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(5))


def test_every_flavor_derives_a_uniform_schedule_from_its_options():
    for name, args in FLAVORS.items():
        if args.family in ("qwen3_5", "qwen3_5_moe"):  # the hybrid: three Gated DeltaNet layers, then one attention
            assert args.schedule == (["linear_attention"] * 3 + ["full_attention"]) * (args.n_layers // 4), name
            continue
        if args.family == "gpt_oss":  # sliding and full attention in turn
            assert args.schedule == ["sliding_attention", "full_attention"] * (args.n_layers // 2), name
            continue
        if args.family == "deepseek_v3":  # latent attention in every layer
            assert args.schedule == ["latent_attention"] * args.n_layers, name
            continue
        if args.family == "gemma3_text":  # five sliding layers, then one full (tiny_gemma3: its own short pattern)
            pattern = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(args.n_layers)]
            assert name == "tiny_gemma3" or args.schedule == pattern, name
            continue
        expected = "full_attention" if args.sliding_window is None else "sliding_attention"
        assert args.layer_types is None and args.schedule == [expected] * args.n_layers, name
    assert windows(model_of(flavor_args("tiny_mistral"))) == [8, 8, 8, 8]
    assert windows(model_of(flavor_args("tiny_qwen3"))) == [None, None, None, None]


def test_a_mixed_schedule_builds_each_layers_mixer():
    mixed = model_of(replace(flavor_args("tiny_mistral"), layer_types=MIXED))
    assert windows(mixed) == [8, None, 8, None]
    assert [block.attention.inner_attention.window for block in mixed.layers.values()] == [8, None, 8, None]
    # the same weights under the uniform schedules: a mixed stack is neither of them past the window, all of them
    # before it (no layer's window cuts anything off there)
    state = mixed.state_dict()
    outputs = {}
    for name, layer_types in {"mixed": MIXED, "full": ["full_attention"] * 4,
                              "sliding": ["sliding_attention"] * 4}.items():
        model = model_of(replace(flavor_args("tiny_mistral"), layer_types=layer_types))
        model.load_state_dict(state)
        with torch.no_grad():
            outputs[name] = model(tokens())
    for other in ("full", "sliding"):
        torch.testing.assert_close(outputs["mixed"][:, :8], outputs[other][:, :8], rtol=0, atol=1e-6)
        assert (outputs["mixed"][:, 8:] - outputs[other][:, 8:]).abs().max() > 1e-3


def test_packed_documents_follow_each_layers_window():
    """Two documents packed in a row give the logits of each document alone, in a mixed stack."""
    model = model_of(replace(flavor_args("tiny_mistral"), layer_types=MIXED))
    ids = tokens()[:1]
    documents = torch.tensor([[0] * 12 + [1] * 8])
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with torch.no_grad():
        packed = model(ids, positions=positions, documents=documents)
        alone = torch.cat([model(ids[:, :12]), model(ids[:, 12:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def test_the_kv_cache_keeps_a_mask_per_window():
    """Decoding token by token through the cache gives the full forward's logits in a mixed stack."""
    args = replace(flavor_args("tiny_mistral"), layer_types=MIXED)
    model = model_of(args)
    ids = tokens()[:1]
    cache = KVCache(args, batch=1, capacity=SEQ, device=torch.device("cpu"))
    real = torch.ones(1, 1, dtype=torch.bool)
    with torch.no_grad():
        full = model(ids)
        prefill = model(ids[:, :6], cache=cache.step(torch.ones(1, 6, dtype=torch.bool), torch.arange(6)[None]))
        steps = [prefill[:, -1]] + [model(ids[:, i:i + 1], cache=cache.step(real, torch.tensor([[i]])))[:, -1]
                                    for i in range(6, SEQ)]
    assert sorted(cache.masks, key=str) == [8, None]
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 5:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["full_attention", "mamba", "full_attention", "full_attention"]},
     "model args: layer_types[1] is 'mamba'; known layer types: full_attention, sliding_attention, linear_attention, "
         "latent_attention"),
    ({"layer_types": ["full_attention"] * 3},
     "model args: 'layer_types' has 3 entries; expected one per layer (n_layers = 4)"),
    ({"layer_types": MIXED, "sliding_window": None},
     "model args: layer_types[0] is 'sliding_attention' but 'sliding_window' is not set; give the window's length"),
])
def test_a_bad_schedule_is_one_line(change, message):
    with pytest.raises(ConfigError) as raised:
        Llama(replace(flavor_args("tiny_mistral"), **change))
    assert str(raised.value) == message


def test_config_json_layer_types():
    cfg = args_to_hf_config(flavor_args("tiny_mistral"), torch.float32)
    sliding = args_from_hf_config({**cfg, "layer_types": ["sliding_attention"] * 4})
    assert sliding.schedule == ["sliding_attention"] * 4 and windows(model_of(sliding)) == [8, 8, 8, 8]
    llama = args_to_hf_config(flavor_args("tiny"), torch.float32)
    with pytest.raises(ConfigError) as raised:
        args_from_hf_config({**llama, "layer_types": ["full_attention", "chunked_attention"] * 2})
    assert str(raised.value) == ("config.json: layer_types[1] is 'chunked_attention'; known layer types: "
                                 f"{', '.join(MIXERS)}")
    with pytest.raises(ConfigError) as raised:
        args_to_hf_config(replace(flavor_args("tiny_mistral"), layer_types=MIXED), torch.float32)
    assert str(raised.value) == ("model args: layer_types mixes ['full_attention', 'sliding_attention'], which a "
                                 "MistralForCausalLM cannot write: it attends the same way in every layer")
