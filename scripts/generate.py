"""Generate text with a titan_lite model: from a Hugging Face folder, an HF folder plus a PEFT adapter, or a DCP
checkpoint of a run (with that run's config); prompts from --prompt, a file (one per line, or JSON lines with a
"prompt" field), or interactively from stdin (one prompt per line, until end of input). With --config of a run that
trained on instruction data, each prompt is put into that run's [instruct] template first (--raw_prompts: as given);
with --chat (or a --config run with instruct.chat_template) each prompt is a user turn rendered with the chat template
(the run's, else the tokenizer folder's) and generation stops at the template's end-of-turn token.
The tokens/s figure counts the time spent generating only (not loading, not waiting for input).

    .venv/bin/python scripts/generate.py --hf assets/hf/Llama-3.1-8B --adapter outputs/.../step-586-adapter \
        --prompt "Question: Natalia sold 48 clips in April ..." --max_new_tokens 256
    .venv/bin/python scripts/generate.py --checkpoint outputs/lora/checkpoint/step-600 \
        --config train_configs/my_run.toml \
        --prompts_file prompts.txt --output completions.jsonl
"""

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite import distributed as tl_dist
from titan_lite.config.schema import JobConfig
from titan_lite.data.chat import TOKENIZER_TEMPLATE
from titan_lite.data.instruct import instruct_format
from titan_lite.errors import ConfigError
from titan_lite.generate import GenerationConfig, iter_completions
from titan_lite.job.cli import ScriptParser
from titan_lite.job.inference import build_model, model_config
from titan_lite.job.outputs import check_output_file
from titan_lite.job.script import run_script

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = ScriptParser(__doc__)
    parser.epilog += ("\n\nArguments after the options, e.g. --training.seq_len 1024, are titan_lite config overrides "
                      "for --config.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="Hugging Face model folder (config.json, safetensors, tokenizer)")
    source.add_argument("--checkpoint", help="DCP step folder of a titan_lite run (needs --config)")
    parser.add_argument("--adapter", help="with --hf: a PEFT LoRA adapter folder applied to the model")
    parser.add_argument("--config", help="with --checkpoint: the run's TOML (model, [lora], initial weights)")
    parser.add_argument("--flavor", help="with --hf: the titan_lite flavor (default: the one matching config.json)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the --hf folder, or the config's assets)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts_file", help="prompts, one per line, or JSON lines with a 'prompt' field")
    parser.add_argument("--output", help="also write {'prompt', 'completion'} JSON lines to this file")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="tokens generated per prompt at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, help="sample among the k most likely tokens (with --temperature)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (with --temperature)")
    parser.add_argument("--batch_size", type=int, default=8, help="prompts generated together")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: the accelerator if any, else cpu)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="compute dtype (default float32 on CPU, else bfloat16)")
    parser.add_argument("--raw_prompts", action="store_true",
                        help="with --config: pass prompts as given, without the run's [instruct] template")
    parser.add_argument("--chat", action="store_true",
                        help="each prompt is a user turn in the chat template (the --config run's "
                             "instruct.chat_template, else the tokenizer folder's); stop at its end-of-turn token")
    return parser.parse_known_args(argv)


# ------------------------------------------------------------------------------------------ prompts


def prompts_from_file(path: str) -> list[str]:
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise ConfigError(f"--prompts_file '{path}' does not exist") from None
    if path.endswith(".jsonl"):
        try:
            return [json.loads(line)["prompt"] for line in lines]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"--prompts_file '{path}': every line must be a JSON object with a 'prompt'") from None
    return lines


def run(opts: argparse.Namespace, overrides: list[str]) -> str:
    if opts.adapter and not opts.hf:
        raise ConfigError("--adapter goes with --hf (a --checkpoint run's adapters come from its checkpoint)")
    if opts.output:
        check_output_file("--output", opts.output)
    device = torch.device(opts.device) if opts.device else tl_dist.local_device()
    dtype = DTYPES[opts.dtype] if opts.dtype else (torch.float32 if device.type == "cpu" else torch.bfloat16)
    cfg = model_config(opts.hf, opts.adapter, opts.checkpoint, opts.config, opts.flavor, opts.tokenizer, overrides)
    tl_dist.init_process_group(device, cfg.comm.init_timeout_seconds)
    start = time.monotonic()
    plan, built = build_model(cfg, opts.checkpoint, device)
    model = built.parts[0].to(dtype)
    print(f"model {cfg.model.flavor} loaded in {time.monotonic() - start:.1f}s"
          + (f" with the adapter {opts.adapter}" if opts.adapter else ""), flush=True)
    gen = GenerationConfig(max_new_tokens=opts.max_new_tokens, temperature=opts.temperature, top_k=opts.top_k,
                           seed=opts.seed)
    prompts = opts.prompt + (prompts_from_file(opts.prompts_file) if opts.prompts_file else [])
    interactive = not prompts
    render = PromptRenderer(cfg, opts, plan.tokenizer)
    gen.stop_ids = render.stop_ids
    out = open(opts.output, "w") if opts.output else None
    count, new_tokens, elapsed = 0, 0, 0.0
    try:
        batches = ([line.rstrip("\n")] for line in sys.stdin if line.strip()) if interactive else [prompts]
        for batch in batches:
            shown, ids = zip(*(render(p) for p in batch), strict=True)
            start = time.monotonic()
            # each batch's completions printed as it finishes: a long prompts file shows its progress
            for completion in iter_completions(model, plan.tokenizer, list(shown), gen, device, opts.batch_size,
                                               prompt_ids=list(ids)):
                elapsed, start = elapsed + time.monotonic() - start, time.monotonic()
                count, new_tokens = count + 1, new_tokens + len(completion.tokens)
                print(completion.text if interactive else f"--- [{count}] {completion.prompt}\n{completion.text}",
                      flush=True)
                if out is not None:
                    out.write(json.dumps({"prompt": completion.prompt, "completion": completion.text}) + "\n")
    finally:
        if out is not None:
            out.close()
    return (f"generated {count} completions, {new_tokens} new tokens in {elapsed:.1f}s "
            f"({new_tokens / max(elapsed, 1e-9):.1f} tokens/s)" + (f"; written to {opts.output}" if out else ""))


class PromptRenderer:
    """prompt -> (the text the model continues, its token ids): the prompt as given (with bos), in the --config run's
    [instruct] template, or as a user turn in the chat template (--chat, or a run with instruct.chat_template);
    `stop_ids`: where generation stops (eos, or the chat template's end-of-turn token too)."""

    def __init__(self, cfg: JobConfig, opts: argparse.Namespace, tokenizer):
        if opts.chat and opts.raw_prompts:
            raise ConfigError("--chat and --raw_prompts contradict each other: give one")
        instruct_run = bool(opts.config) and cfg.training.dataset == "instruct"
        self.chat = opts.chat or (instruct_run and bool(cfg.instruct.chat_template) and not opts.raw_prompts)
        self.templated = instruct_run and not opts.raw_prompts
        if self.chat:
            cfg.instruct.chat_template = cfg.instruct.chat_template or TOKENIZER_TEMPLATE
        self.format = instruct_format(cfg, tokenizer)
        self.stop_ids = self.format.stop_ids()
        if self.chat:
            print(f"prompts are user turns of the chat template {self.format.chat.template.origin}; generation "
                  f"stops at token ids {list(self.stop_ids)}", flush=True)
        elif self.templated:
            print(f"prompts go into the run's template {cfg.instruct.template!r} (--raw_prompts: as given)", flush=True)

    def __call__(self, prompt: str) -> tuple[str, list[int]]:
        if self.chat or self.templated:
            return self.format.prompt(prompt)
        return prompt, self.format.tokenizer.encode(prompt, bos=True, eos=False)


def main(argv: list[str] | None = None) -> int:
    opts, overrides = parse_args(argv)
    return run_script(lambda: print(run(opts, overrides), flush=True))


if __name__ == "__main__":
    sys.exit(main())
