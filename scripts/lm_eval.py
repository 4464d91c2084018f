"""Evaluate a titan_lite model with EleutherAI's lm-evaluation-harness: lm_eval's own options, the model fixed to
titan_lite and named by --model_args (an HF folder, with a PEFT adapter or not; or a DCP checkpoint of a run with
its TOML, its transforms rebuilt: an unmerged LoRA, pruning masks). Prints lm_eval's results table; --output_path
writes its JSON. One process, or torchrun (each process evaluates a share of the requests). The bundled offline
tasks (assets/lm_eval_tasks: shakespeare_choice, shakespeare_rolling, shakespeare_continue) are always available.

    .venv/bin/python scripts/lm_eval.py --model_args pretrained=outputs/merged --tasks shakespeare_choice
    .venv/bin/python scripts/lm_eval.py --model_args checkpoint=outputs/lora/checkpoint/step-600,config=my.toml \\
        --tasks hellaswag,arc_easy,gsm8k --batch_size 16 --output_path results/
    .venv/bin/torchrun --nproc_per_node 8 scripts/lm_eval.py --model_args ... --tasks ...
"""

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from titan_lite import distributed as tl_dist
from titan_lite.errors import ConfigError, pip_install
from titan_lite.job.cli import ScriptParser
from titan_lite.job.script import is_rank0, run_script

# This file is named lm_eval.py: its folder must not shadow the lm_eval package it runs.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

BUNDLED_TASKS = Path(__file__).resolve().parents[1] / "assets" / "lm_eval_tasks"
# The local data files of the bundled tasks (paths as their YAMLs give them) and the commands that make them.
SYNTHETIC_GSM8K = (".venv/bin/python scripts/make_synthetic_gsm8k.py --output data/synthetic_gsm8k/{} "
                   "--num_problems {} --seed {}")
DATA_MAKERS = {"data/synthetic_gsm8k/test.jsonl": SYNTHETIC_GSM8K.format("test.jsonl", 200, 1),
               "data/synthetic_gsm8k/train.jsonl": SYNTHETIC_GSM8K.format("train.jsonl", 2000, 0)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--model_args", nargs="+", required=True, metavar="KEY=VALUE",
                        help="pretrained=HF_FOLDER[,adapter=PEFT_FOLDER] or checkpoint=STEP_FOLDER,config=TOML; "
                             "optional dtype=auto|float32|bfloat16, max_length=N (default: config.json's context)")
    parser.add_argument("--tasks", required=True, help="comma-separated task names, groups, tags or YAML files")
    parser.add_argument("--include_path", help="a folder of extra task YAMLs (the bundled local tasks are included)")
    parser.add_argument("--num_fewshot", type=int, help="few-shot examples per prompt (default: the task's)")
    parser.add_argument("--batch_size", type=batch_size, default=1,
                        help="requests per forward on each process: a number, or auto (the largest that fits, found "
                             "on the longest requests) or auto:N (found again at N points as the requests get "
                             "shorter), as lm_eval takes them")
    parser.add_argument("--max_batch_size", type=int, default=64, help="the largest batch auto tries")
    parser.add_argument("--limit", type=float, help="only the first N documents of each task (a fraction if < 1)")
    parser.add_argument("--output_path", help="folder (or .json file) for the results JSON (and samples)")
    parser.add_argument("--log_samples", action="store_true", help="also write every request and response")
    parser.add_argument("--gen_kwargs", nargs="+", metavar="KEY=VALUE",
                        help="generation settings for every generate_until task (do_sample, temperature, top_k, "
                             "max_gen_toks, until)")
    parser.add_argument("--apply_chat_template", nargs="?", const=True, default=False, metavar="TEMPLATE",
                        help="wrap prompts in the tokenizer's chat template (chat_template.jinja or "
                             "tokenizer_config.json's chat_template), rendered as training renders conversations")
    parser.add_argument("--seed", default="0,1234,1234,1234", type=seeds,
                        help="python, numpy, torch and few-shot seeds: one integer for all, or four (None: unset)")
    return parser.parse_args(argv)


def batch_size(text: str) -> int | str:
    if text == "auto" or (text.startswith("auto:") and text[5:].isdigit() and int(text[5:]) >= 1):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise argparse.ArgumentTypeError(f"'{text}': expected a positive integer, auto or auto:N (N >= 1)")


def seeds(text: str) -> list[int | None]:
    parts = [None if p.strip().lower() == "none" else p.strip() for p in text.split(",")]
    if len(parts) not in (1, 4) or not all(p is None or p.lstrip("-").isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"'{text}': one integer, or four integers or None separated by commas")
    values = [None if p is None else int(p) for p in parts]
    return values * 4 if len(values) == 1 else values


def check_options(opts: argparse.Namespace) -> None:
    if opts.max_batch_size < 1:
        raise ConfigError(f"--max_batch_size {opts.max_batch_size}: expected at least 1")
    if opts.limit is not None and opts.limit <= 0:
        raise ConfigError(f"--limit {opts.limit}: expected a positive count or fraction")
    if opts.include_path and not Path(opts.include_path).is_dir():
        raise ConfigError(f"--include_path '{opts.include_path}' is not a folder")


def evaluate(opts: argparse.Namespace) -> None:
    # torch and the model code load after --help and option errors
    from titan_lite.eval.harness_model import load_model, parse_model_args, tokenizer_folder

    spec = parse_model_args(opts.model_args)
    check_options(opts)
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError("scripts/lm_eval.py needs EleutherAI's lm-evaluation-harness, the optional eval extra: "
                          f"{pip_install(extra='eval')}")
    # lm_eval is optional: imported only once it is known to be installed
    from titan_lite.eval.harness import (
        TitanLM,
        check_local_data,
        evaluator_config,
        folder_chat_template,
        results_file,
    )
    from titan_lite.eval.harness import evaluate as run_harness

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    template = None
    if opts.apply_chat_template:
        folder = tokenizer_folder(spec)
        template = folder_chat_template(folder)
        if template is None:
            raise ConfigError(f"--apply_chat_template: {folder / 'tokenizer_config.json'} has no chat_template "
                              f"(evaluate without it, or add one)")
    model_args = {k: v for k, v in vars(spec).items() if v is not None}
    opts.include_path = [str(BUNDLED_TASKS)] + ([opts.include_path] if opts.include_path else [])
    check_local_data(opts.tasks.split(","), opts.include_path, DATA_MAKERS)  # before lm_eval indexes its tasks
    cfg, task_manager = evaluator_config(opts, model_args)  # unknown tasks fail before the model loads
    device = tl_dist.local_device()
    tl_dist.init_process_group(device, 1800)
    start = time.monotonic()
    loaded = load_model(spec, device)
    if is_rank0():
        print(f"model {loaded.description} loaded in {time.monotonic() - start:.1f}s", flush=True)
    lm = TitanLM(loaded, device, opts.batch_size, seed=opts.seed[0] or 0, chat_template=template,
                 name=str(tokenizer_folder(spec)), max_batch_size=opts.max_batch_size)
    start = time.monotonic()
    results = run_harness(lm, cfg, task_manager, model_args)
    if results is not None:
        written = results_file(opts.output_path)
        print(f"evaluated {', '.join(results['results'])} in {time.monotonic() - start:.1f}s on "
              f"{lm.world_size} process(es)" + (f"; results in {written}" if written else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    return run_script(lambda: evaluate(opts))


if __name__ == "__main__":
    sys.exit(main())
