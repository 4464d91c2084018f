"""Generation with a KV cache against full forward passes, sampling, answer extraction, and scripts/generate.py."""

import importlib.util
import logging
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan_lite.checkpoint.hf import write_hf_folder
from titan_lite.config import parse_args
from titan_lite.eval.answers import extract_answer, same_answer
from titan_lite.eval.generate import GenerationConfig, generate, left_padded, prompts_of
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 99, 3], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [300, 301]]
CPU = torch.device("cpu")
NEW = 10


@pytest.fixture(scope="module")
def model() -> Llama:
    """The tiny model with weights scaled up, so its greedy continuations are not one repeated token."""
    args = flavor_args("tiny")
    args.max_seq_len = 32
    m = Llama(args)
    m.init_weights(seed=0)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(3)
    return m.eval()


@torch.no_grad()
def argmax_by_full_forwards(model: Llama, prompt: list[int], steps: int, stop: int | None = None) -> list[int]:
    """The reference: the training forward (no cache) on the whole sequence at every step, one prompt at a time."""
    seq, out = list(prompt), []
    for _ in range(steps):
        token = int(model(torch.tensor([seq]))[0, -1].argmax())
        if token == stop:
            break
        out.append(token)
        seq.append(token)
    return out


def test_cached_batched_greedy_equals_full_forwards(model):
    got = generate(model, PROMPTS, GenerationConfig(max_new_tokens=NEW), torch.device("cpu"))
    want = [argmax_by_full_forwards(model, p, NEW) for p in PROMPTS]
    assert got == want
    assert len({tuple(g) for g in got}) == len(PROMPTS)  # distinct continuations: the test has teeth


def family_model(flavor: str) -> Llama:
    args = flavor_args(flavor)
    args.max_seq_len = 32
    family = Llama(args)
    family.init_weights(seed=0)
    with torch.no_grad():
        for name, p in family.named_parameters():
            if p.dim() == 2:
                p.mul_(3)
            elif ".attention." in name:  # q/k/v biases and q/k norm weights away from their init
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return family.eval()


@pytest.mark.parametrize("flavor", ["tiny_qwen3", "tiny_qwen2", "tiny_mistral"])
def test_cached_logits_equal_full_forwards_on_the_families(flavor):
    """q/k norms before the cache's RoPE, biased q/k/v, and the sliding window (8): two rows (one left-padded) run
    past the window, fed one token at a time through the cache; every step's logits equal the full forward's at
    that position (greedy tokens alone would not show a missing window here), and greedy generation equals full
    forwards."""
    from titan_lite.eval.generate import KVCache

    family = family_model(flavor)
    rows = [torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (24, 21)]
    prompts = [row[:5] for row in rows]  # the same prompt length; the second row padded by 3 below
    prompts[1] = rows[1][:2]
    tokens, real = left_padded(prompts, 0, torch.device("cpu"))
    cache = KVCache(family.args, 2, tokens.shape[1] + 19, torch.device("cpu"))
    positions = (real.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        steps = [family(tokens, cache=cache.step(real, positions))[:, -1]]
        for t in range(19):
            feed = torch.tensor([[rows[0][5 + t]], [rows[1][2 + t]]])
            steps.append(family(feed, cache=cache.step(torch.ones(2, 1, dtype=torch.bool),
                                                      torch.tensor([[5 + t], [2 + t]])))[:, -1])
        full = [family(torch.tensor([row]))[0] for row in rows]
    for i, start in enumerate((4, 1)):
        got = torch.stack([step[i] for step in steps])
        torch.testing.assert_close(got, full[i][start:start + 20], atol=1e-4, rtol=0)
    got = generate(family, PROMPTS, GenerationConfig(max_new_tokens=NEW), torch.device("cpu"))
    assert got == [argmax_by_full_forwards(family, p, NEW) for p in PROMPTS]


def test_generation_stops_at_a_stop_token(model):
    want = argmax_by_full_forwards(model, PROMPTS[2], NEW)
    stop = want[3]
    got = generate(model, [PROMPTS[2], PROMPTS[0]], GenerationConfig(max_new_tokens=NEW, stop_ids=(stop,)),
                   torch.device("cpu"))
    assert got[0] == want[:want.index(stop)]
    assert got[1] == argmax_by_full_forwards(model, PROMPTS[0], NEW, stop=stop)


class ClockedModel(torch.nn.Module):
    """The model on a fake clock: every forward (the prefill, each decode step) takes one second."""

    def __init__(self, model: Llama, clock: list[float]):
        super().__init__()
        self.inner, self.args, self.clock = model, model.args, clock

    def forward(self, tokens, cache=None):
        self.clock[0] += 1.0
        return self.inner(tokens, cache=cache)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_answer_accuracy_reports_progress_with_a_true_eta_while_it_generates(model, monkeypatch):
    """Two batches of two problems, 10 forwards (seconds) each: lines every 3 s while the first batch still decodes
    (not after all the work), each one's elapsed time plus its ETA the whole 20 s."""
    from titan_lite.data.instruct import Example, InstructFormat
    from titan_lite.data.tokenizer import build_tokenizer
    from titan_lite.eval import answer_accuracy as accuracy
    from titan_lite.metrics import logger as metrics_logger

    clock = [0.0]
    monkeypatch.setattr(metrics_logger, "time", type("FakeTime", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    monkeypatch.setattr(metrics_logger.Progress.__init__, "__defaults__", (3.0, False))  # every_s = 3
    fmt = InstructFormat(parse_args([]).instruct, build_tokenizer(str(ROOT / "assets" / "tokenizer")))
    monkeypatch.setattr(fmt, "stop_ids", lambda: (-1,))  # no early stop: every row decodes max_new_tokens
    metrics_logger.init_logger()  # INFO lines (conftest restores the logger)
    handler, log = _Lines(), logging.getLogger("titan_lite")
    log.addHandler(handler)
    try:
        result = accuracy.answer_accuracy(ClockedModel(model, clock), fmt, [Example(f"{i} + 1?", "#### 2")
                                                                            for i in range(4)], 10, CPU, 2)
    finally:
        log.removeHandler(handler)
    assert result.total == 4 and clock[0] == 20
    lines = [line for line in handler.lines if line.startswith("answer accuracy: generating: ")]
    assert lines[0] == "answer accuracy: generating: 4 completions of up to 10 tokens"
    progress = [re.fullmatch(r"answer accuracy: generating: (\d)/4 completions of up to 10 tokens in (\d+)s, eta "
                             r"(\d+)s", line) for line in lines[1:]]
    assert len(progress) >= 4 and all(progress), lines
    assert progress[0].group(1) == "0"  # during the first batch
    for match in progress:
        assert int(match.group(2)) + int(match.group(3)) == 20, lines


def test_sampling_is_seeded_and_respects_top_k(model):
    cfg = GenerationConfig(max_new_tokens=6, temperature=1.0, top_k=1, seed=3)
    assert generate(model, PROMPTS, cfg, torch.device("cpu")) == [argmax_by_full_forwards(model, p, 6) for p in PROMPTS]
    wide = GenerationConfig(max_new_tokens=6, temperature=2.0, seed=3)
    first = generate(model, PROMPTS, wide, torch.device("cpu"))
    assert first == generate(model, PROMPTS, wide, torch.device("cpu"))
    assert first != generate(model, PROMPTS, GenerationConfig(max_new_tokens=6, temperature=2.0, seed=4),
                             torch.device("cpu"))


def test_padded_batches_of_either_side_give_back_the_prompts():
    tokens, real = left_padded(PROMPTS, pad_id=0, device=torch.device("cpu"))
    assert prompts_of(tokens, real) == PROMPTS
    right = torch.zeros_like(tokens)
    mask = torch.zeros_like(real)
    for i, p in enumerate(PROMPTS):
        right[i, :len(p)], mask[i, :len(p)] = torch.tensor(p), True
    assert prompts_of(right, mask) == PROMPTS


@pytest.mark.parametrize("text, answer", [
    ("She has 3 + 4 = 7 apples.\n#### 1,234", "1234"),
    ("So the total is $18.00. The answer is: 18", "18"),
    ("x = 2.50, then we add 5 to get 7.5", "7.5"),
    ("the answer is 3/6", "1/2"),
    ("\\boxed{-42}", "-42"),
    ("no number here", None),
])
def test_final_answer_extraction(text, answer):
    assert extract_answer(text) == answer


def test_same_answer_compares_normalised_numbers():
    assert same_answer("... The answer is: 1,000", "work #### 1000")
    assert not same_answer("The answer is 12", "#### 13")
    assert not same_answer("no idea", "#### 13")


# ------------------------------------------------------------------------------------------ scripts/generate.py


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_folder(model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gen") / "hf"
    write_hf_folder(dict(model.named_parameters()), model.args, str(folder), torch.float32,
                    str(ROOT / "assets/tokenizer"))
    return folder


def test_generate_script_from_an_hf_folder(hf_folder, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("To be, or not to be\nWhat light\n")
    out = tmp_path / "out.jsonl"
    code = load_script("generate").main(["--hf", str(hf_folder), "--prompts_file", str(prompts), "--max_new_tokens",
                                         "5", "--output", str(out)])
    assert not dist.is_initialized()  # the script leaves no process group behind
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and lines[-1].startswith("generated 2 completions, ") and str(out) in lines[-1]
    assert "--- [1] To be, or not to be" in lines and len(out.read_text().splitlines()) == 2


def test_generate_script_errors_are_one_line(hf_folder, capsys):
    code = load_script("generate").main(["--checkpoint", str(hf_folder)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "error: --checkpoint needs --config, the TOML of the run that saved it"


def direct_truncated_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_k: int | None,
                           top_p: float) -> torch.Tensor:
    """log p(token) of softmax(logits / T) cut to the top k, then to the top p of the mass, renormalised: written
    out row by row, as the sampler's documentation states it."""
    out = []
    for row, token in zip(logits.double(), tokens.tolist(), strict=True):
        p = torch.softmax(row / temperature, dim=0)
        keep = torch.ones_like(p, dtype=torch.bool)
        if top_k:
            keep &= row >= row.sort(descending=True).values[top_k - 1]
        p = torch.where(keep, p, 0.0) / torch.where(keep, p, 0.0).sum()
        order = p.argsort(descending=True)
        before = torch.cumsum(p[order], 0) - p[order]
        keep[order[before > top_p]] = False
        p = torch.where(keep, p, 0.0)
        out.append(math.log(p[token] / p.sum()) if keep[token] else -math.inf)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("top_k, top_p", [(None, 0.8), (12, 1.0), (12, 0.6)])
def test_sampled_logprobs_are_the_truncated_renormalised_distributions(top_k, top_p):
    """logprobs "sampled": the drawn token's log-probability under the distribution it was drawn from (1e-6 of a
    direct computation, fp32); "full": today's log_softmax(logits / T), bit for bit, and the same draw."""
    from titan_lite.generate import Sampling, choose, chosen_logps

    logits = 3 * torch.randn(64, 100, generator=torch.Generator().manual_seed(4))
    uniforms = torch.rand(64, generator=torch.Generator().manual_seed(5))
    sampled, full = Sampling(0.7, top_k, top_p, "sampled"), Sampling(0.7, top_k, top_p)
    tokens = choose(logits, sampled, uniforms)
    assert torch.equal(tokens, choose(logits, full, uniforms))
    got = chosen_logps(logits, tokens, sampled)
    assert got.dtype == torch.float32 and got.isfinite().all()
    torch.testing.assert_close(got.double(), direct_truncated_logps(logits, tokens, 0.7, top_k, top_p),
                               atol=1e-6, rtol=0)
    today = torch.log_softmax(logits.float() * (1 / 0.7), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.equal(chosen_logps(logits, tokens, full), today)
    assert (got > today).all()  # the renormalised mass is below 1 on every row here
