"""Loglikelihood requests per second: titan_lite's lm_eval model (scripts/lm_eval.py) against lm_eval's own HF
backend (`lm_eval --model hf`) on the same HF folder, the same requests (the local shakespeare_choice task, repeated)
and the same batch size, timed alternately in one process.

    python -m benchmarks.lm_eval_speed --flavor debugmodel --rounds 3
"""

import json
from pathlib import Path

import torch

from titan_lite.checkpoint.hf import write_hf_folder
from titan_lite.data.tokenizer import LLAMA3_PATTERN, llama3_special_tokens
from titan_lite.models.llama import Llama, flavor_args

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
