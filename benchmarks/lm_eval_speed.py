"""Loglikelihood requests per second: titan_lite's lm_eval model (scripts/lm_eval.py) against lm_eval's own HF
backend (`lm_eval --model hf`) on the same HF folder, the same requests (the local shakespeare_choice task, repeated)
and the same batch size, timed alternately in one process.

    .venv/bin/python -m benchmarks.lm_eval_speed --flavor debugmodel --rounds 3
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks import cli
from titan_lite.checkpoint.hf import write_hf_folder
from titan_lite.data.tokenizer import LLAMA3_PATTERN, llama3_special_tokens
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "assets" / "tokenizer"
TASKS = REPO / "assets" / "lm_eval_tasks"


def write_tokenizer_json(folder: Path) -> None:
    """The bundled tiktoken tokenizer as a transformers-loadable tokenizer.json (BOS prepended, as Llama 3's)."""
    from tokenizers import processors  # transformers' dependency: only the oracle side needs it
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converted = TikTokenConverter(vocab_file=str(TOKENIZER / "tokenizer.model"), pattern=LLAMA3_PATTERN,
                                  extra_special_tokens=llama3_special_tokens()).converted()
    converted.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1792)])])
    converted.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def write_test_hf_folder(folder: Path, flavor: str = "tiny", seed: int = 0, scale: float = 3.0,
                         max_seq_len: int = 256) -> Path:
    """A seeded model of `flavor` as an HF folder that transformers and titan_lite both load: weights scaled by
    `scale` (so greedy continuations vary), bos/eos ids in config.json, the bundled tokenizer as tokenizer.json."""
    args = flavor_args(flavor)
    args.max_seq_len = max_seq_len
    model = Llama(args)
    model.init_weights(seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    write_hf_folder(dict(model.named_parameters()), args, str(folder), torch.float32)
    config = json.loads((folder / "config.json").read_text())
    config.update(bos_token_id=1792, eos_token_id=1793)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer_json(folder)
    return folder


def choice_requests(copies: int) -> list:
    """The loglikelihood requests of the local shakespeare_choice task (4 per document), `copies` times over with
    a distinct prefix per copy (so no two requests are the same)."""
    from lm_eval.api.instance import Instance  # lm_eval is an optional extra: imported by this benchmark only

    docs = [json.loads(line) for line in (TASKS / "shakespeare_choice.jsonl").read_text().splitlines()]
    return [Instance(request_type="loglikelihood", doc=doc, arguments=(f"{copy}. {doc['context']}\n", choice),
                     idx=i) for copy in range(copies) for doc in docs for i, choice in enumerate(doc["choices"])]


def build_lms(folder: Path, batch_size: int):
    """(titan_lite's TitanLM, lm_eval's HFLM) on the same folder, float32, on the CPU."""
    from lm_eval.models.huggingface import HFLM  # the optional extra, as above

    from titan_lite import distributed as tl_dist
    from titan_lite.eval.harness import TitanLM
    from titan_lite.eval.harness_model import ModelSpec, load_model

    device = torch.device("cpu")
    tl_dist.init_process_group(device, 600)
    titan = TitanLM(load_model(ModelSpec(pretrained=str(folder), dtype="float32"), device), device, batch_size)
    hf = HFLM(pretrained=str(folder), dtype="float32", batch_size=batch_size, device="cpu")
    return titan, hf


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__, ".venv/bin/python -m benchmarks.lm_eval_speed")
    parser.add_argument("--flavor", default="smollm2_135M", help="model shape (titan_lite flavor), random weights")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--copies", type=int, default=2, help="copies of the task's 160 requests per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per side (median reported)")
    parser.add_argument("--folder", default="outputs/bench_lm_eval", help="where the HF folder is written")
    opts = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = write_test_hf_folder(Path(opts.folder) / opts.flavor, opts.flavor, scale=1.0, max_seq_len=2048)
    titan, hf = build_lms(folder, opts.batch_size)
    requests = choice_requests(opts.copies)
    encoded = [((None, None), *titan._encode_pair(*r.args)) for r in requests]  # pre-tokenized: scoring alone
    assert encoded == [((None, None), *hf._encode_pair(*r.args)) for r in requests], "tokenizations differ"
    times: dict[str, list[float]] = {k: [] for k in ("titan_lite", "hf", "titan_lite scoring", "hf scoring")}
    for _ in range(opts.rounds + 1):  # the first round warms up and is dropped
        times["titan_lite"].append(timed(lambda: titan.loglikelihood(requests, disable_tqdm=True)))
        times["hf"].append(timed(lambda: hf.loglikelihood(requests, disable_tqdm=True)))
        times["titan_lite scoring"].append(timed(lambda: titan._loglikelihood_tokens(encoded, disable_tqdm=True)))
        times["hf scoring"].append(timed(lambda: hf._loglikelihood_tokens(encoded, disable_tqdm=True)))
    rate = {k: len(requests) / statistics.median(v[1:]) for k, v in times.items()}
    print(f"{len(requests)} loglikelihood requests, flavor {opts.flavor}, batch {opts.batch_size}, float32, CPU, "
          f"{torch.get_num_threads()} threads, median of {opts.rounds} rounds")
    for kind in ("", " scoring"):
        print(f"{'tokenize + score' if not kind else 'score only':>16}: titan_lite {rate['titan_lite' + kind]:.1f} "
              f"requests/s, lm_eval hf {rate['hf' + kind]:.1f} requests/s, "
              f"ratio {rate['titan_lite' + kind] / rate['hf' + kind]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
