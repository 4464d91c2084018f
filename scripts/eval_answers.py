"""GSM8K-style answer accuracy of a model: greedy completions of math problems put into a prompt template, each
completion's final number (`#### N`, `The answer is: N`, `\\boxed{N}`, else the last number) against the
reference's, exactly as a training run's validation measures it. The model is a Hugging Face folder (plus a PEFT
adapter) or a run's DCP checkpoint; the template and fields come from --config (the run's TOML), else the options.
Conversations (a messages or conversations field) are problems too: the turns before the last assistant turn are
the prompt, that turn the reference. With --chat (or a --config run with instruct.chat_template) prompts are rendered
with the chat template (the run's, else the tokenizer folder's) and generation stops at its end-of-turn token.

    .venv/bin/python scripts/eval_answers.py --hf outputs/merged --data data/gsm8k/test.jsonl --problems 200
    .venv/bin/python scripts/eval_answers.py --hf assets/hf/Llama-3.1-8B \\
        --adapter outputs/run/checkpoint/step-584-adapter --config train_configs/llama3_8b_lora_gsm8k.toml \\
        --data data/gsm8k/main/test-00000-of-00001.parquet
    .venv/bin/python scripts/eval_answers.py --checkpoint outputs/lora_synthetic_gsm8k_cpu/checkpoint/step-400 \\
        --config train_configs/lora_synthetic_gsm8k_cpu.toml     # the run's own held-out problems

The last line printed is `answer accuracy: <correct>/<total> = <fraction>`.
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite import distributed as tl_dist
from titan_lite.config import JobConfig
from titan_lite.config import parse_args as parse_job_args
from titan_lite.config.schema import Instruct
from titan_lite.data.chat import TOKENIZER_TEMPLATE
from titan_lite.data.instruct import InstructionFile, Record, in_split, instruct_format, instruction_file_and_split
from titan_lite.errors import ConfigError
from titan_lite.eval.answer_accuracy import answer_accuracy
from titan_lite.job.cli import ScriptParser
from titan_lite.job.inference import build_model, model_config
from titan_lite.job.outputs import check_output_file
from titan_lite.job.script import run_script
from titan_lite.rl.answers import same_answer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULTS = Instruct()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="Hugging Face model folder (config.json, safetensors, tokenizer)")
    source.add_argument("--checkpoint", help="DCP step folder of a titan_lite run (needs --config)")
    parser.add_argument("--adapter", help="with --hf: a PEFT LoRA adapter folder applied to the model")
    parser.add_argument("--config", help="the run's TOML: its [instruct] template and fields, its held-out problems "
                                         "when --data is not given, and (with --checkpoint) its model")
    parser.add_argument("--data", help="problems: a .jsonl, .json or .parquet file of prompt/response examples "
                                       "(default: the --config run's validation problems)")
    parser.add_argument("--problems", type=int, default=100, help="evaluate the first N problems (0 = all)")
    parser.add_argument("--template", help=f"without --config: the prompt template (default {DEFAULTS.template!r})")
    parser.add_argument("--prompt_field", help=f"without --config: the prompt's field (default "
                                               f"{DEFAULTS.prompt_field!r})")
    parser.add_argument("--response_field", help=f"without --config: the reference answer's field (default "
                                                 f"{DEFAULTS.response_field!r})")
    parser.add_argument("--chat", action="store_true",
                        help="render problems with the chat template (the --config run's instruct.chat_template, else "
                             "the tokenizer folder's) and stop at its end-of-turn token")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="tokens generated per problem at most")
    parser.add_argument("--batch_size", type=int, default=8, help="problems generated together")
    parser.add_argument("--flavor", help="with --hf: the titan_lite flavor (default: the one matching config.json)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the --hf folder, or the config's assets)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the accelerator if any, else cpu)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="compute dtype (default float32 on CPU, else bfloat16)")
    parser.add_argument("--output", help="also write {'prompt', 'completion', 'reference', 'correct'} JSON lines")
    return parser.parse_args(argv)


def run_config(opts: argparse.Namespace) -> JobConfig | None:
    """The run's config (template, fields, held-out problems), or None without --config."""
    if not opts.config:
        return None
    if any((opts.template, opts.prompt_field, opts.response_field)):
        raise ConfigError("--template, --prompt_field and --response_field replace --config's [instruct]; give one")
    return parse_job_args(["--job.config_file", opts.config])


def instruct_settings(opts: argparse.Namespace, cfg: JobConfig | None) -> Instruct:
    instruct = cfg.instruct if cfg is not None else Instruct(
        prompt_field=opts.prompt_field or DEFAULTS.prompt_field,
        response_field=opts.response_field or DEFAULTS.response_field, template=opts.template or DEFAULTS.template)
    if opts.chat:
        instruct.chat_template = instruct.chat_template or TOKENIZER_TEMPLATE
    return instruct


def problems(opts: argparse.Namespace, cfg: JobConfig | None, instruct: Instruct) -> tuple[list[Record], str]:
    """(the first --problems examples, where they come from): --data's every example, else the run's validation
    split (the held-out examples of its training file, or its validation file)."""
    if opts.data:
        file, split = InstructionFile(Path(opts.data), instruct, "--data"), "all"
    elif cfg is not None and cfg.training.dataset == "instruct":
        file, split = instruction_file_and_split(cfg, "validation")
    else:
        raise ConfigError("--data is needed (or --config of a run that trained on instruction data)")
    fraction = cfg.instruct.validation_fraction if cfg is not None else 0.0
    chosen = (ex for i, ex in file.examples() if in_split(i, split, fraction))
    found = list(itertools.islice(chosen, opts.problems or None))
    if not found:
        raise ConfigError(f"'{file.key}' = '{file.path}' holds no problems for the {split} split")
    return found, f"{file.path} ({split})"


def evaluate(opts: argparse.Namespace) -> str:
    if opts.problems < 0 or opts.batch_size < 1 or opts.max_new_tokens < 1:
        raise ConfigError("--problems must be at least 0, --batch_size and --max_new_tokens at least 1")
    if opts.adapter and not opts.hf:
        raise ConfigError("--adapter goes with --hf (a --checkpoint run's adapters come from its checkpoint)")
    if opts.output:
        check_output_file("--output", opts.output)
    cfg = run_config(opts)
    instruct = instruct_settings(opts, cfg)
    examples, where = problems(opts, cfg, instruct)
    device = torch.device(opts.device) if opts.device else tl_dist.local_device()
    dtype = DTYPES[opts.dtype] if opts.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    model_cfg = model_config(opts.hf, opts.adapter, opts.checkpoint, opts.config if opts.checkpoint else None,
                             opts.flavor, opts.tokenizer)
    tl_dist.init_process_group(device, model_cfg.comm.init_timeout_seconds)
    plan, built = build_model(model_cfg, opts.checkpoint, device)
    model = built.parts[0].to(dtype).eval()
    model_cfg.instruct = instruct
    fmt = instruct_format(model_cfg, plan.tokenizer)
    how = f"chat template {fmt.chat.template.origin}" if fmt.chat else f"template {instruct.template!r}"
    print(f"{len(examples)} problems from {where}; {how}", flush=True)
    start = time.monotonic()
    with torch.no_grad():
        result = answer_accuracy(model, fmt, examples, opts.max_new_tokens, device, opts.batch_size)
    for line in result.sample_lines(3):
        print(f"  {line}")
    if opts.output:
        write_completions(opts.output, result)
    model_name = opts.checkpoint or opts.hf + (f" + {opts.adapter}" if opts.adapter else "")
    return (f"answer accuracy: {result.correct}/{result.total} = {result.accuracy:.4f} ({model_name}; "
            f"{time.monotonic() - start:.1f}s)")


def write_completions(path: str, result) -> None:
    with open(path, "w") as out:
        for prompt, completion, reference in zip(result.prompts, result.completions, result.references, strict=True):
            out.write(json.dumps({"prompt": prompt, "completion": completion, "reference": reference,
                                  "correct": same_answer(completion, reference)}) + "\n")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    return run_script(lambda: print(evaluate(opts), flush=True))


if __name__ == "__main__":
    sys.exit(main())
