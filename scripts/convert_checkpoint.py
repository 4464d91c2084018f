"""Offline conversion between titan_lite DCP checkpoints and Hugging Face safetensors folders (no process group).
The tensors keep the checkpoint's dtype unless --dtype says otherwise; the output is written whole or not at all.

    .venv/bin/python scripts/convert_checkpoint.py dcp-to-hf outputs/checkpoint/step-1000 outputs/hf --flavor 1B \
        --dtype bfloat16 --assets assets/hf/Llama-3.2-1B
    .venv/bin/python scripts/convert_checkpoint.py hf-to-dcp assets/hf/Llama-3.2-1B outputs/seed-checkpoint
"""

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.checkpoint.dcp import read_dcp_model
from titan_lite.checkpoint.hf import check_state_dict, read_hf_folder, write_hf_folder
from titan_lite.errors import ConfigError
from titan_lite.job.cli import ScriptParser
from titan_lite.job.outputs import FOLDER_HELP, output_folder
from titan_lite.job.script import check_output_folder, run_script
from titan_lite.models.args import LlamaArgs
from titan_lite.models.flavors import flavor_args
from titan_lite.models.hf.config import args_from_hf_config, read_hf_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The checkpoint manager saves {"model": model.state_dict(), ...}; DCP flattens that to "model.<fqn>".
DEFAULT_PREFIX = "model."
# Single-process DCP is the point of this script.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{dcp-to-hf,hf-to-dcp}")
    for name, help_text in (("dcp-to-hf", "a titan_lite DCP step folder -> a Hugging Face folder"),
                            ("hf-to-dcp", "a Hugging Face folder -> a titan_lite DCP checkpoint (model only)")):
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=parser.formatter_class)
        p.add_argument("input", help="the folder to read")
        p.add_argument("output", help=f"the folder to write: {FOLDER_HELP}")
        source = p.add_mutually_exclusive_group()
        source.add_argument("--flavor", help="model flavor (titan_lite.models.flavors.FLAVORS)")
        source.add_argument("--hf_config", help="an HF config.json describing the model")
        p.add_argument("--max_seq_len", type=int,
                       help="with --flavor: max_position_embeddings for config.json (raised to that of "
                            "--assets/config.json when it describes the same model)")
        p.add_argument("--dtype", choices=tuple(DTYPES),
                       help="dtype of the written tensors (default: the dtype the input holds)")
        p.add_argument("--key_prefix", default=DEFAULT_PREFIX,
                       help="prefix of the model's keys in the DCP checkpoint ('' for top-level keys)")
        if name == "dcp-to-hf":
            p.add_argument("--assets", help="folder whose tokenizer files (and token ids in config.json) are copied "
                                            "(its config.json also describes the model when neither --flavor nor "
                                            "--hf_config is given)")
            p.add_argument("--max_shard_gb", type=float, default=5.0, help="largest safetensors file, in GiB")
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
    if prefix.endswith(".") and "." not in prefix[:-1]:
        state = {prefix[:-1]: sd}  # nested, as the manager saves it; DCP flattens it to "<prefix><fqn>"
    else:
        state = {prefix + name: tensor for name, tensor in sd.items()}
    with output_folder("output", folder) as partial:
        dcp.save(state, checkpoint_id=str(partial), no_dist=True)


def output_dtype(opts: argparse.Namespace, sd: dict[str, torch.Tensor]) -> torch.dtype:
    """--dtype, else the input's own (the dtype of its floating-point tensors)."""
    if opts.dtype:
        return DTYPES[opts.dtype]
    return next((t.dtype for t in sd.values() if t.is_floating_point()), torch.float32)


# ------------------------------------------------------------------------------------------ commands


def _check_folders(opts: argparse.Namespace) -> None:
    if not Path(opts.input).is_dir():
        raise ConfigError(f"input '{opts.input}' is not a folder")
    check_output_folder("output", opts.output, {"input": opts.input, "--assets": getattr(opts, "assets", None)})


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dcp_to_hf(opts: argparse.Namespace) -> None:
    _check_folders(opts)
    args = model_args(opts)
    sd = read_dcp_model(opts.input, opts.key_prefix)
    check_state_dict(sd, args, opts.input)
    dtype = output_dtype(opts, sd)
    print(f"writing {opts.output}", flush=True)
    with output_folder("output", opts.output) as partial:
        write_hf_folder(sd, args, str(partial), dtype, opts.assets, int(opts.max_shard_gb * 2**30))
    print(f"wrote {opts.output} ({_dtype_name(dtype)})")


def hf_to_dcp(opts: argparse.Namespace) -> None:
    _check_folders(opts)
    args = model_args(opts)
    sd = read_hf_folder(opts.input, args)
    dtype = output_dtype(opts, sd)
    sd = {name: t.to(dtype) for name, t in sd.items()}
    if args.tie_word_embeddings:
        sd["output.weight"] = sd["tok_embeddings.weight"]  # model.state_dict() lists the tied head too
    print(f"writing {opts.output}", flush=True)
    write_dcp_model(sd, opts.output, opts.key_prefix)
    print(f"wrote {opts.output} ({_dtype_name(dtype)})")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    return run_script(lambda: dcp_to_hf(opts) if opts.command == "dcp-to-hf" else hf_to_dcp(opts))


if __name__ == "__main__":
    sys.exit(main())
