"""The rollout's decode engine (generate/engine.py) against one completion decoded alone by the batch decoder
(generate/decode.py): continuous batching over fewer slots than completions, a group's prompt prefilled once or once
per completion, the host reading every k steps, greedy and sampled, on Llama, a sliding window (Mistral), Qwen3.5's
Gated DeltaNet state, DeepSeek-V3's cached latent and Gemma 3's window and rope per layer type; its log-probabilities
against the training forward's; the compiled step against the eager one."""

from dataclasses import replace

import pytest
import torch

from titan_lite.generate import GenerationConfig, sample
from titan_lite.generate.engine import EngineStats, decode_slots
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args

CPU = torch.device("cpu")
NEW = 14
STOPS = tuple(range(3, 40))  # frequent enough on these models that completions end at varied lengths


def widened_model(flavor: str) -> Llama:
    """A tiny model with its matrices scaled up and every norm weight drawn wide, so tokens vary and a missing piece
    shows; Qwen3.5 from the test config of tests/test_qwen3_5.py (A_log and dt_bias drawn wide too)."""
    if flavor == "qwen3_5":
        pytest.importorskip("transformers")
        from transformers import Qwen3_5TextConfig

        from tests.test_qwen3_5 import SMALL, widened
        from titan_lite.models.hf.config import args_from_hf_config

        args = args_from_hf_config(Qwen3_5TextConfig(**SMALL).to_dict())
    else:
        args = flavor_args(flavor)
        args.max_seq_len, args.vocab_size = 64, 256
    model = Llama(args)
    model.init_weights(seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=generator))
    if flavor == "qwen3_5":
        widened(model)
    return model.eval()


def group_prompts(vocab: int, lengths=(3, 9, 17, 6), group: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [p for n in lengths for p in [torch.randint(40, vocab, (n,), generator=g).tolist()] * group]


@pytest.mark.parametrize("flavor", ["tiny", "tiny_mistral", "qwen3_5", "debugmodel_deepseek_v3",
                                    "tiny_gemma3"])
def test_slots_and_a_shared_prefill_give_each_completion_what_it_gives_alone(flavor):
    """4 prompts x 3 completions in 5 slots (a slot takes the next completion when its own ends, a group split over
    admissions) or 12 (the prompts prefilled together, left-padded), the host reading every 3 steps: each
    completion's tokens equal, and its log-probabilities are within 1e-5 of, what the batch decoder gives it decoded
    alone with the same uniform numbers, greedy and sampled (top k and top p); a prompt is prefilled once for its group
    (4 prefills), or once per completion (12), alike."""
    model = widened_model(flavor)
    prompts = group_prompts(model.args.vocab_size)
    uniforms = torch.rand(len(prompts), NEW, generator=torch.Generator().manual_seed(3))
    for temperature in (0.0, 1.0):
        cfg = GenerationConfig(max_new_tokens=NEW, temperature=temperature, top_k=60, top_p=0.95, stop_ids=STOPS,
                               keep_stop=temperature > 0, slots=5, stop_check_interval=3)
        alone = [sample(model, [p], cfg, CPU, uniforms[i:i + 1])[0] for i, p in enumerate(prompts)]
        for slots, share in ((5, True), (5, False), (12, True)):  # 12: the 4 prompts prefilled in one batch
            stats = EngineStats()
            got = decode_slots(model, prompts, replace(cfg, slots=slots), CPU, uniforms, share_prefill=share,
                               stats=stats)
            assert [d.tokens for d in got] == [d.tokens for d in alone]
            assert [d.stopped for d in got] == [d.stopped for d in alone]
            for d, a in zip(got, alone, strict=True):
                torch.testing.assert_close(torch.tensor(d.logps), torch.tensor(a.logps), atol=1e-5, rtol=0)
            assert stats.prefills == (4 if share else 12)
            assert 0 < stats.working_share < 1  # the slots that ended idled until the next read
        lengths = {len(d.tokens) for d in alone}
        assert len(lengths) >= 3 and any(d.stopped for d in alone), lengths  # the test has teeth


def test_the_engines_logprobs_are_the_training_forwards():
    """Each completion's recorded log-probabilities equal log_softmax(logits / temperature) of the training forward
    (no cache) over prompt + completion, within 1e-5 (fp32)."""
    model = widened_model("tiny")
    prompts = group_prompts(model.args.vocab_size, lengths=(5, 11), group=4)
    cfg = GenerationConfig(max_new_tokens=NEW, temperature=0.8, stop_ids=STOPS, keep_stop=True, slots=3)
    got = decode_slots(model, prompts, cfg, CPU)
    with torch.no_grad():
        for prompt, d in zip(prompts, got, strict=True):
            logits = model(torch.tensor([prompt + d.tokens]))[0, len(prompt) - 1:-1].float() / 0.8
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(d.tokens)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(d.logps), want, atol=1e-5, rtol=0)


def test_the_slot_count_and_the_check_interval_change_no_sample():
    """Every slot count (1 to all) and read interval (every step to every 16) samples the same completions."""
    model = widened_model("tiny")
    prompts = group_prompts(model.args.vocab_size, lengths=(4, 8), group=4)
    cfg = GenerationConfig(max_new_tokens=NEW, temperature=1.0, stop_ids=STOPS, keep_stop=True, seed=5)
    first = None
    for slots, every in ((1, 1), (3, 16), (8, 2), (0, 8)):
        got = [(d.tokens, d.logps) for d in decode_slots(model, prompts, replace(cfg, slots=slots,
                                                                                 stop_check_interval=every), CPU)]
        first = first or got
        assert [t for t, _ in got] == [t for t, _ in first]
        for (_, a), (_, b) in zip(got, first, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_compiled_step_equals_the_eager_one():
    """grpo.compile_generation: the decode step compiled whole (fullgraph) gives the eager step's tokens and
    log-probabilities (a 2-layer model; about 30 s of compiling on one core)."""
    args = flavor_args("tiny")
    args.max_seq_len, args.n_layers = 64, 2
    model = Llama(args)
    model.init_weights(seed=0)
    model.eval()
    prompts = group_prompts(args.vocab_size, lengths=(3, 7), group=3)
    cfg = GenerationConfig(max_new_tokens=8, temperature=1.0, top_p=0.9, stop_ids=STOPS, keep_stop=True, slots=4,
                           stop_check_interval=3)
    eager = decode_slots(model, prompts, cfg, CPU)
    compiled = decode_slots(model, prompts, replace(cfg, compile=True), CPU)
    assert [d.tokens for d in compiled] == [d.tokens for d in eager]
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(torch.tensor(a.logps), torch.tensor(b.logps), atol=1e-6, rtol=0)

