"""Generation with a KV cache against full forward passes, sampling, answer extraction, and scripts/generate.py."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan_lite.checkpoint.hf import write_hf_folder
from titan_lite.eval.answers import extract_answer, same_answer
from titan_lite.eval.generate import GenerationConfig, generate, left_padded, prompts_of
from titan_lite.models.llama import Llama, flavor_args

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 17, 99, 3], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [300, 301]]
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


def test_generation_stops_at_a_stop_token(model):
    want = argmax_by_full_forwards(model, PROMPTS[2], NEW)
    stop = want[3]
    got = generate(model, [PROMPTS[2], PROMPTS[0]], GenerationConfig(max_new_tokens=NEW, stop_ids=(stop,)),
                   torch.device("cpu"))
    assert got[0] == want[:want.index(stop)]
    assert got[1] == argmax_by_full_forwards(model, PROMPTS[0], NEW, stop=stop)


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
