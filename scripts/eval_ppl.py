"""Perplexity of a Llama on a text file over non-overlapping windows of --seq_len tokens (the protocol of the pruning
papers: the text tokenized once, documents joined by a blank line, exp of the mean token NLL). The model comes from
a Hugging Face folder or a titan_lite DCP checkpoint; one process or torchrun (FSDP, --tp). The last line printed is
`perplexity: <value>`.

    .venv/bin/python scripts/eval_ppl.py --hf_assets_path outputs/pruned-1B --data wikitext2_test.txt --seq_len 2048
    .venv/bin/python scripts/eval_ppl.py --hf_assets_path assets/hf/Llama-3.2-1B \\
        --checkpoint outputs/checkpoint/step-1000 --data val.jsonl --seq_len 1024 --max_windows 64
"""

import argparse
import sys
from pathlib import Path

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.checkpoint.resume import plan_weights
from titan_lite.distributed import local_device
from titan_lite.errors import ConfigError
from titan_lite.eval.perplexity import evaluate_perplexity, read_text, text_windows
from titan_lite.job.assembly import assemble_model
from titan_lite.job.cli import ScriptParser
from titan_lite.job.script import (
    DTYPES,
    check_text_data,
    is_rank0,
    job_config,
    resolve_dtype,
    run_script,
    start_job,
)
from titan_lite.transforms.lora.adapters import lora_settings_from_peft


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--hf_assets_path", required=True,
                        help="HF folder: tokenizer, config.json and (without --checkpoint) the safetensors")
    parser.add_argument("--checkpoint", help="a titan_lite DCP step folder to read the weights from instead")
    parser.add_argument("--adapter", help="a PEFT LoRA adapter folder applied to the model, unmerged (masked by the "
                                          "base's zeros when it was trained with lora.keep_sparsity)")
    parser.add_argument("--data", required=True, help="the text: a .txt/.jsonl/.json.gz/.parquet file or folder")
    parser.add_argument("--seq_len", type=int, required=True, help="tokens per window")
    parser.add_argument("--max_windows", type=int, help="evaluate only the first K windows")
    parser.add_argument("--batch_size", type=int, default=1, help="windows per forward on each data-parallel rank")
    parser.add_argument("--flavor", help="model flavor (default: the one config.json describes)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights and compute; auto = bfloat16 on GPUs, float32 on CPU")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel degree (FSDP takes the other processes)")
    return parser.parse_args(argv)


def evaluate(opts: argparse.Namespace) -> None:
    check_text_data("--data", opts.data)
    if opts.seq_len < 2 or opts.batch_size < 1 or (opts.max_windows is not None and opts.max_windows < 1):
        raise ConfigError("--seq_len must be at least 2, --batch_size and --max_windows at least 1")
    if opts.checkpoint and not Path(opts.checkpoint).is_dir():
        raise ConfigError(f"--checkpoint '{opts.checkpoint}' is not a folder")
    dtype = resolve_dtype(opts.dtype, local_device().type)
    cfg = job_config(opts.hf_assets_path, opts.flavor, dtype, opts.seq_len, opts.tp)
    if opts.adapter:
        with_adapter(cfg, opts.adapter)
    plan, device = start_job(cfg)
    load = plan_weights("dcp", opts.checkpoint) if opts.checkpoint else plan_weights("hf", opts.hf_assets_path)
    built = assemble_model(plan, device, load=load)
    windows = text_windows(plan.tokenizer.encode(read_text(opts.data), bos=True, eos=False), opts.seq_len,
                           opts.max_windows)
    if is_rank0():
        model = opts.hf_assets_path + (f" + {opts.checkpoint}" if opts.checkpoint else "") + \
            (f" + {opts.adapter}" if opts.adapter else "")
        print(f"evaluating {model} on {windows.shape[0]} windows of {opts.seq_len} tokens from {opts.data} "
              f"({plan.parallel_dims.describe()}, {dtype})", flush=True)
    result = evaluate_perplexity(built.runner, windows, plan.parallel_dims, device, opts.batch_size)
    if is_rank0():
        print(f"windows: {result.windows}, predicted tokens: {result.tokens:,}, mean NLL: {result.mean_nll:.6f}")
        print(f"perplexity: {result.value:.4f}", flush=True)


def with_adapter(cfg, adapter: str) -> None:
    """The [lora] settings that reproduce the adapter; the base is the loaded folder."""
    cfg.model.converters = ["lora"]
    for key, value in lora_settings_from_peft(adapter).items():
        setattr(cfg.lora, key, value)
    cfg.checkpoint.initial_load_in_hf = True


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    return run_script(lambda: evaluate(opts))


if __name__ == "__main__":
    sys.exit(main())
