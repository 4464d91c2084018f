"""Materialise a Sheared-pruning checkpoint: the pruned dense Llama (deterministic gates with the exact target
counts, soft values folded in) as a Hugging Face folder with its new config.json (no process group, no GPU needed).

    .venv/bin/python scripts/materialize_pruned.py --checkpoint outputs/llama3_8b_sheared/checkpoint/step-3200 \
        --config train_configs/llama3_8b_sheared.toml --output_dir outputs/llama3_8b_sheared_pruned
"""

import argparse
import sys
import time
from pathlib import Path

import torch

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.checkpoint.dcp import read_dcp_model
from titan_lite.config import parse_args as parse_job_args
from titan_lite.config import validate
from titan_lite.errors import ConfigError
from titan_lite.folders import FOLDER_HELP, output_folder
from titan_lite.job.cli import ScriptParser
from titan_lite.job.plan import build_model_args
from titan_lite.job.script import check_output_folder, run_script
from titan_lite.transforms.sheared import ShearedTransform
from titan_lite.transforms.sheared.keep import GATE_PREFIX, materialize_pruned
from titan_lite.transforms.structured.materialize import param_count, write_materialized_hf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--checkpoint", required=True, help="DCP step folder of the pruning run "
                        "(e.g. <dump_folder>/checkpoint/step-N)")
    parser.add_argument("--config", required=True, help="the pruning run's TOML (model flavor and [sheared] targets)")
    parser.add_argument("--output_dir", required=True, help=f"folder to write the pruned model to: {FOLDER_HELP}")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="dtype of the written weights (default: the "
                        "config's checkpoint.export_dtype)")
    return parser.parse_args(argv)


def materialize(opts: argparse.Namespace) -> str:
    start = time.monotonic()
    if not Path(opts.config).is_file():
        raise ConfigError(f"--config '{opts.config}' does not exist")
    cfg = parse_job_args(["--job.config_file", opts.config])
    validate(cfg, files=False)
    check_output_folder("--output_dir", opts.output_dir, {"--checkpoint": opts.checkpoint})
    if "sheared" not in cfg.model.converters:
        raise ConfigError(f"--config '{opts.config}': 'model.converters' = {cfg.model.converters} has no 'sheared'; "
                          "give the pruning run's config")
    args = build_model_args(cfg, None)
    targets = ShearedTransform(cfg).targets_for(args)
    print(f"reading {opts.checkpoint}", flush=True)
    state = {name: t.float() for name, t in read_dcp_model(opts.checkpoint, "model.").items()}
    if not any(name.startswith(GATE_PREFIX) for name in state):
        raise ConfigError(f"--checkpoint '{opts.checkpoint}' holds no Sheared gates ('{GATE_PREFIX}*'): not a "
                          "checkpoint of a run with model.converters = [\"sheared\"]")
    pruned, new_args = materialize_pruned(state, args, targets)
    dtype = DTYPES[opts.dtype or cfg.checkpoint.export_dtype]
    print(f"writing {opts.output_dir}", flush=True)
    try:
        with output_folder("--output_dir", opts.output_dir) as partial:
            write_materialized_hf(pruned, new_args, partial, dtype, cfg.model.hf_assets_path)
    except ValueError as exc:  # per-layer widths, which an HF config.json cannot describe
        raise ConfigError(str(exc)) from None
    return (f"materialised {opts.checkpoint}: {param_count(args):,} -> {param_count(new_args):,} parameters "
            f"({new_args.n_layers} layers, {new_args.n_heads} heads / {new_args.kv_heads} KV heads, "
            f"dim {new_args.dim}, intermediate {new_args.ffn_dim}); wrote {opts.output_dir} "
            f"({str(dtype).removeprefix('torch.')}) in {time.monotonic() - start:.1f}s")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    return run_script(lambda: print(materialize(opts), flush=True))


if __name__ == "__main__":
    sys.exit(main())
