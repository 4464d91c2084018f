"""Merge a PEFT LoRA adapter (titan_lite's export or PEFT's own) into its Hugging Face base model and write the merged
model as a Hugging Face folder (no process group, no GPU needed). The merged folder's config.json records the
adapter, so merging the same adapter into it again is refused.

    .venv/bin/python scripts/merge_lora.py --base assets/hf/Llama-3.1-8B \
        --adapter outputs/llama3_8b_lora_gsm8k/checkpoint/step-586-adapter --output_dir outputs/merged
"""

import argparse
import sys
import time
from pathlib import Path

import torch

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.checkpoint.hf import read_hf_folder, write_hf_folder
from titan_lite.checkpoint.peft import (
    MERGED_KEY,
    adapter_digest,
    from_peft_tensors,
    other_base_line,
    read_peft_adapter,
    record_merge,
)
from titan_lite.errors import ConfigError
from titan_lite.job.cli import ScriptParser
from titan_lite.job.outputs import FOLDER_HELP, output_folder
from titan_lite.job.script import check_output_folder, require_folder, run_script
from titan_lite.models.hf.config import args_from_hf_config, read_hf_config
from titan_lite.transforms.lora.adapters import adapted_modules_of, merge_adapters, peft_specs
from titan_lite.transforms.lora.qlora import nf4_round_trip
from titan_lite.transforms.lora.sparse import adapter_keeps_sparsity

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--base", required=True, help="Hugging Face folder of the base model "
                        "(config.json + safetensors)")
    parser.add_argument("--adapter", required=True, help="PEFT adapter folder (adapter_config.json + "
                                                          "adapter_model.safetensors)")
    parser.add_argument("--output_dir", required=True, help=f"folder to write the merged model to: {FOLDER_HELP}")
    parser.add_argument("--dtype", choices=tuple(DTYPES),
                        help="dtype of the written weights (default: the base's dtype)")
    parser.add_argument("--base_nf4", action="store_true",
                        help="merge onto the base a QLoRA run trained on (lora.base_dtype = 'nf4'): every block "
                             "projection quantized to NF4 and dequantized, from the base's dtype (as a run whose "
                             "training.dtype is that dtype quantized it); default: onto the base as stored")
    parser.add_argument("--keep_sparsity", choices=("auto", "on", "off"), default="auto",
                        help="mask each update by its base weight's zeros, so the merged model keeps the base's "
                             "sparsity exactly; auto: on for an adapter trained with lora.keep_sparsity (default)")
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="largest safetensors file, in GiB")
    return parser.parse_args(argv)


def merged_before(base_config: dict, digest: str, opts: argparse.Namespace) -> list[dict]:
    """The base's record of merged adapters; ConfigError when this adapter is one of them."""
    record = list(base_config.get(MERGED_KEY, []))
    for entry in record:
        if entry.get("sha256") == digest:
            raise ConfigError(f"--base '{opts.base}' already has --adapter '{opts.adapter}' merged into it (recorded "
                              f"in its config.json '{MERGED_KEY}' as '{entry.get('adapter')}'); merge into the "
                              "original base instead")
    return record


def check_fits(tensors: dict[str, torch.Tensor], state: dict[str, torch.Tensor], opts: argparse.Namespace) -> None:
    """Every adapter pair fits its base weight: lora_a [r, in], lora_b [out, r] against weight [out, in]."""
    for name, tensor in tensors.items():
        module, kind = name.rsplit(".", 1)
        if kind not in ("lora_a", "lora_b") or f"{module}.weight" not in state:
            continue
        weight = list(state[f"{module}.weight"].shape)
        got, side = (tensor.shape[1], 1) if kind == "lora_a" else (tensor.shape[0], 0)
        if got != weight[side]:
            raise ConfigError(f"--adapter '{opts.adapter}': '{name}' has shape {list(tensor.shape)}, which does not "
                              f"fit the base's '{module}.weight' of shape {weight}: the adapter was trained on a "
                              f"model of other shapes than --base '{opts.base}'")


def read_adapter_for(args, opts: argparse.Namespace) -> tuple:
    """The adapter in titan_lite names; an adapter for a model of other head counts is one line."""
    adapter = read_peft_adapter(opts.adapter)
    try:
        return adapter, from_peft_tensors(adapter.tensors, args, opts.adapter)
    except RuntimeError as exc:
        raise ConfigError(f"--adapter '{opts.adapter}' does not fit --base '{opts.base}' "
                          f"({' '.join(str(exc).split())})") from None


def merge(opts: argparse.Namespace) -> str:
    start = time.monotonic()
    require_folder("--base", opts.base, "config.json")
    require_folder("--adapter", opts.adapter, "adapter_config.json")
    check_output_folder("--output_dir", opts.output_dir, {"--base": opts.base, "--adapter": opts.adapter})
    base_config = read_hf_config(Path(opts.base) / "config.json")
    args = args_from_hf_config(base_config, source=f"{opts.base}/config.json")
    record = merged_before(base_config, adapter_digest(opts.adapter), opts)
    adapter, tensors = read_adapter_for(args, opts)
    warning = other_base_line(opts.adapter, opts.base)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    modules = adapted_modules_of(tensors)
    c = adapter.config
    variants = (", rsLoRA" if c.get("use_rslora") else "") + (", DoRA" if c.get("use_dora") else "")
    print(f"adapter: {len(modules)} adapted projections, r {c['r']}, alpha {c['lora_alpha']}{variants}", flush=True)
    print(f"reading the base model from {opts.base}", flush=True)
    state = read_hf_folder(opts.base, args)
    check_fits(tensors, state, opts)
    missing = [n for n in tensors if n.rsplit(".", 1)[-1] not in ("lora_a", "lora_b", "magnitude") and n not in state]
    if missing:
        raise ConfigError(f"{opts.adapter}: '{missing[0]}' is not a parameter of the base model")
    dtype = DTYPES[opts.dtype] if opts.dtype else next(iter(state.values())).dtype
    if opts.base_nf4:
        state, count = nf4_round_trip(state)
        print(f"quantized {count} block projections of the base to NF4 and back (what QLoRA trained on)", flush=True)
    masked = sparse_merge(opts, state, modules)
    merged = merge_adapters({**state, **tensors}, peft_specs(adapter, modules), masked)
    print(f"writing {opts.output_dir}", flush=True)
    with output_folder("--output_dir", opts.output_dir) as partial:
        write_hf_folder(merged, args, str(partial), dtype, opts.base, int(opts.max_shard_gb * 2**30))
        record_merge(partial, opts.adapter, record)
    kept = ", the base's zeros kept" if masked else ""
    return (f"merged {len(modules)} adapters from {opts.adapter} into {opts.base}{kept}: wrote {opts.output_dir} "
            f"({str(dtype).removeprefix('torch.')}) in {time.monotonic() - start:.1f}s")


def sparse_merge(opts: argparse.Namespace, state: dict[str, torch.Tensor], modules: list[str]) -> bool:
    """Whether the merge masks the updates by the base's zeros (--keep_sparsity; auto: the adapter's marker). A
    masked merge onto a base whose adapted weights hold no zeros would keep nothing: refused."""
    marker = adapter_keeps_sparsity(opts.adapter)
    masked = opts.keep_sparsity == "on" or (opts.keep_sparsity == "auto" and marker)
    if not masked:
        return False
    zeros = sum(int((state[f"{m}.weight"] == 0).sum()) for m in modules)
    if zeros == 0:
        why = ("--keep_sparsity on" if opts.keep_sparsity == "on" else
               "--keep_sparsity auto (the adapter was trained with masked updates: titan_lite_sparsity.json)")
        raise ConfigError(f"{why}, but the {len(modules)} adapted weights of --base '{opts.base}' hold no zeros: "
                          "there is no sparsity to keep; merge onto the pruned base the adapter was trained on, or "
                          "pass --keep_sparsity off for a dense merge")
    total = sum(state[f"{m}.weight"].numel() for m in modules)
    print(f"keep_sparsity: each update is masked by its base weight's zeros ({zeros / total:.2%} of the adapted "
          "weights)", flush=True)
    return True


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    return run_script(lambda: print(merge(opts), flush=True))


if __name__ == "__main__":
    sys.exit(main())
