"""Merge a PEFT LoRA adapter (titan_lite's export or PEFT's own) into its Hugging Face base model and write the merged
model as a Hugging Face folder (no process group, no GPU needed).

    python scripts/merge_lora.py --base assets/hf/Llama-3.1-8B \
        --adapter outputs/llama3_8b_lora_gsm8k/checkpoint/step-586-adapter --output_dir outputs/merged
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from titan_lite.checkpoint.hf import read_hf_folder, write_hf_folder
from titan_lite.checkpoint.peft import from_peft_tensors, read_peft_adapter
from titan_lite.errors import ConfigError
from titan_lite.models.llama.hf import args_from_hf_config, read_hf_config
from titan_lite.transforms.lora.adapters import adapted_modules_of, merge_adapters, peft_specs
from titan_lite.transforms.lora.sparse import adapter_keeps_sparsity

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="Hugging Face folder of the base model "
                        "(config.json + safetensors)")
    parser.add_argument("--adapter", required=True, help="PEFT adapter folder (adapter_config.json + "
                                                          "adapter_model.safetensors)")
    parser.add_argument("--output_dir", required=True, help="folder to write the merged model to "
                        "(replaced if it exists)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="dtype of the written weights (default: the base's)")
    parser.add_argument("--keep_sparsity", choices=("auto", "on", "off"), default="auto",
                        help="mask each update by its base weight's zeros, so the merged model keeps the base's "
                             "sparsity exactly; auto: on for an adapter trained with lora.keep_sparsity (default)")
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="largest safetensors file, in GiB")
    return parser.parse_args(argv)


def merge(opts: argparse.Namespace) -> str:
    start = time.monotonic()
    args = args_from_hf_config(read_hf_config(Path(opts.base) / "config.json"), source=f"{opts.base}/config.json")
    adapter = read_peft_adapter(opts.adapter)
    tensors = from_peft_tensors(adapter.tensors, args, opts.adapter)
    modules = adapted_modules_of(tensors)
    c = adapter.config
    variants = (", rsLoRA" if c.get("use_rslora") else "") + (", DoRA" if c.get("use_dora") else "")
    print(f"adapter: {len(modules)} adapted projections, r {c['r']}, alpha {c['lora_alpha']}{variants}", flush=True)
    print(f"reading the base model from {opts.base}", flush=True)
    state = read_hf_folder(opts.base, args)
    missing = [n for n in tensors if n.rsplit(".", 1)[-1] not in ("lora_a", "lora_b", "magnitude") and n not in state]
    if missing:
        raise ConfigError(f"{opts.adapter}: '{missing[0]}' is not a parameter of the base model")
    dtype = DTYPES[opts.dtype] if opts.dtype else next(iter(state.values())).dtype
    masked = sparse_merge(opts)
    merged = merge_adapters({**state, **tensors}, peft_specs(adapter, modules), masked)
    print(f"writing {opts.output_dir}", flush=True)
    write_hf_folder(merged, args, opts.output_dir, dtype, opts.base, int(opts.max_shard_gb * 2**30))
    kept = ", the base's zeros kept" if masked else ""
    return (f"merged {len(modules)} adapters from {opts.adapter} into {opts.base}{kept}: wrote {opts.output_dir} "
            f"({str(dtype).removeprefix('torch.')}) in {time.monotonic() - start:.1f}s")


def sparse_merge(opts: argparse.Namespace) -> bool:
    """Whether the merge masks the updates by the base's zeros (--keep_sparsity; auto: the adapter's marker)."""
    masked = opts.keep_sparsity == "on" or (opts.keep_sparsity == "auto" and adapter_keeps_sparsity(opts.adapter))
    if masked:
        print("keep_sparsity: each update is masked by its base weight's zeros", flush=True)
    return masked


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        print(merge(opts))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
