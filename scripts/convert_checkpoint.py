"""Offline conversion between titan_lite DCP checkpoints and Hugging Face safetensors folders (no process group).

    python scripts/convert_checkpoint.py dcp-to-hf outputs/checkpoint/step-1000 outputs/hf --flavor 1B \
        --dtype bfloat16 --assets assets/hf/Llama-3.2-1B
    python scripts/convert_checkpoint.py hf-to-dcp assets/hf/Llama-3.2-1B outputs/seed-checkpoint
"""

import argparse
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from titan_lite.checkpoint.dcp import read_dcp_model
from titan_lite.checkpoint.hf import check_state_dict, read_hf_folder, write_hf_folder
from titan_lite.errors import ConfigError
from titan_lite.models.llama.args import LlamaArgs, flavor_args
from titan_lite.models.llama.hf import args_from_hf_config, read_hf_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The checkpoint manager saves {"model": model.state_dict(), ...}; DCP flattens that to "model.<fqn>".
DEFAULT_PREFIX = "model."
# Single-process DCP is the point of this script.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("dcp-to-hf", "a titan_lite DCP step folder -> a Hugging Face folder"),
                            ("hf-to-dcp", "a Hugging Face folder -> a titan_lite DCP checkpoint (model only)")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("input", help="the folder to read")
        p.add_argument("output", help="the folder to write (replaced if it exists)")
        source = p.add_mutually_exclusive_group()
        source.add_argument("--flavor", help="model flavor (titan_lite.models.llama.FLAVORS)")
        source.add_argument("--hf-config", help="an HF config.json describing the model")
        p.add_argument("--max-seq-len", type=int,
                       help="with --flavor: max_position_embeddings for config.json (raised to that of "
                            "--assets/config.json when it describes the same model)")
        p.add_argument("--dtype", choices=tuple(DTYPES), default="float32" if name == "hf-to-dcp" else "bfloat16",
                       help="dtype of the written tensors")
        p.add_argument("--key-prefix", default=DEFAULT_PREFIX,
                       help="prefix of the model's keys in the DCP checkpoint ('' for top-level keys)")
        if name == "dcp-to-hf":
            p.add_argument("--assets", help="folder whose tokenizer files (and token ids in config.json) are copied")
            p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, in GiB")
    return parser.parse_args(argv)


def model_args(opts: argparse.Namespace) -> LlamaArgs:
    """Args from --hf-config, --flavor, or else the config.json of the HF input (hf-to-dcp) or of --assets."""
    if opts.flavor:
        try:
            args = flavor_args(opts.flavor)
        except KeyError as exc:
            raise ConfigError(f"--flavor: {exc.args[0]}") from None
        if opts.max_seq_len:
            args.max_seq_len = opts.max_seq_len
        return args
    config_path = opts.hf_config
    if config_path is None:
        fallback = opts.input if opts.command == "hf-to-dcp" else getattr(opts, "assets", None)
        if fallback is None or not (Path(fallback) / "config.json").exists():
            raise ConfigError("no model description: pass --flavor or --hf-config")
        config_path = str(Path(fallback) / "config.json")
    return args_from_hf_config(read_hf_config(config_path), source=config_path)


# --------------------------------------------------------------------------------------------- DCP


def write_dcp_model(sd: dict[str, torch.Tensor], folder: str, prefix: str) -> None:
    """Save the model tensors as a DCP checkpoint laid out like the checkpoint manager's, atomically."""
    out = Path(folder)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if prefix.endswith(".") and "." not in prefix[:-1]:
        state = {prefix[:-1]: sd}  # nested, as the manager saves it; DCP flattens it to "<prefix><fqn>"
    else:
        state = {prefix + name: tensor for name, tensor in sd.items()}
    dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


# ------------------------------------------------------------------------------------------ commands


def dcp_to_hf(opts: argparse.Namespace) -> None:
    args = model_args(opts)
    sd = read_dcp_model(opts.input, opts.key_prefix)
    check_state_dict(sd, args, opts.input)
    write_hf_folder(sd, args, opts.output, DTYPES[opts.dtype], opts.assets, int(opts.max_shard_gb * 2**30))
    print(f"wrote {opts.output} ({opts.dtype})")


def hf_to_dcp(opts: argparse.Namespace) -> None:
    args = model_args(opts)
    sd = {name: t.to(DTYPES[opts.dtype]) for name, t in read_hf_folder(opts.input, args).items()}
    if args.tie_word_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]  # model.state_dict() lists the tied head too
    write_dcp_model(sd, opts.output, opts.key_prefix)
    print(f"wrote {opts.output} ({opts.dtype})")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        dcp_to_hf(opts) if opts.command == "dcp-to-hf" else hf_to_dcp(opts)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
