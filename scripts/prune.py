"""One-shot pruning of a Hugging Face Llama folder (magnitude, Wanda, SparseGPT; unstructured, 2:4, 4:8) into a new
Hugging Face folder plus a per-layer sparsity report. Prints the memory plan before calibrating and the measured
peak after. Runs on one process or under torchrun (FSDP over the processes, --tp for tensor parallelism).

    python scripts/prune.py --hf_assets_path assets/hf/Llama-3.2-1B --output_dir outputs/pruned-1B \\
        --method wanda --sparsity 0.5 --pattern 2:4 --calib_path /data/c4/en/c4-train.00000-of-01024.json.gz \\
        --nsamples 128 --seq_len 2048
    torchrun --nproc_per_node 4 scripts/prune.py ...                     # calibration split over 4 GPUs
    python scripts/prune.py --flavor 8B --hf_assets_path assets/tokenizer --estimate_only \\
        --nsamples 128 --seq_len 2048 --device_memory_gib 24            # the plan only, in seconds, no weights
    python scripts/prune.py --hf_assets_path outputs/merged --remask_from outputs/pruned-1B \\
        --output_dir outputs/merged-sparse                              # the zeros of a pruned folder, re-applied
"""

import argparse
import sys
from pathlib import Path

import torch

from titan_lite.checkpoint.hf import export_hf
from titan_lite.config import JobConfig
from titan_lite.dry_run import device_memory_gib, plan_pruning_pass
from titan_lite.errors import ConfigError
from titan_lite.job.assembly import assemble_model, hf_weight_loader
from titan_lite.job.plan import plan_job
from titan_lite.job.script import DTYPES, is_rank0, job_config, resolve_dtype, run_script, start_job
from titan_lite.parallel.memory_estimate import GIB
from titan_lite.transforms.pruning.memory_plan import format_bytes
from titan_lite.transforms.pruning.remask import remask_hf_folder
from titan_lite.transforms.pruning.transform import REPORT_NAME, sparsity_report, write_report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf_assets_path", required=True,
                        help="HF folder: config.json, tokenizer and safetensors (only the tokenizer with "
                             "--estimate_only and --flavor)")
    parser.add_argument("--output_dir", help="the pruned HF folder to write (replaced if it exists)")
    parser.add_argument("--method", choices=("wanda", "magnitude", "sparsegpt"), default="wanda")
    parser.add_argument("--sparsity", type=float, default=0.5, help="fraction of each pruned linear set to zero")
    parser.add_argument("--pattern", choices=("unstructured", "2:4", "4:8"), default="unstructured")
    parser.add_argument("--calib_path", help="calibration text: a .txt/.jsonl/.json.gz/.parquet file or folder "
                                             "(default: the bundled Shakespeare plays)")
    parser.add_argument("--nsamples", type=int, default=128, help="calibration sequences")
    parser.add_argument("--seq_len", type=int, default=2048, help="tokens per calibration sequence")
    parser.add_argument("--batch_size", type=int, default=1, help="calibration sequences per forward")
    parser.add_argument("--skip", action="append", default=[],
                        help="glob of linear layers left dense, e.g. 'layers.0.*' (repeatable)")
    parser.add_argument("--blocksize", type=int, default=128, help="SparseGPT column block")
    parser.add_argument("--percdamp", type=float, default=0.01, help="SparseGPT Hessian dampening")
    parser.add_argument("--flavor", help="model flavor (default: the one config.json describes)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights and compute; auto = bfloat16 on GPUs, float32 on CPU")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel degree (FSDP takes the other processes)")
    parser.add_argument("--estimate_only", action="store_true",
                        help="print the memory plan for --ngpu devices (meta device, no weights read) and stop")
    parser.add_argument("--ngpu", type=int, default=1, help="with --estimate_only: devices to plan for")
    parser.add_argument("--device_memory_gib", type=float,
                        help="memory per device for the verdict (default: the visible GPU's, else 80)")
    parser.add_argument("--remask_from", help="instead of pruning: zero --hf_assets_path's linear weights where this "
                                              "pruned HF folder has zeros (e.g. after merging a LoRA adapter)")
    opts = parser.parse_args(argv)
    if not opts.estimate_only and not opts.output_dir:
        parser.error("--output_dir is required (or pass --estimate_only)")
    return opts


def pruning_config(opts: argparse.Namespace, device_type: str) -> JobConfig:
    dtype = resolve_dtype(opts.dtype, device_type)
    extra = ["--model.converters", "prune", "--pruning.method", opts.method, "--pruning.sparsity", str(opts.sparsity),
             "--pruning.pattern", opts.pattern, "--pruning.nsamples", str(opts.nsamples),
             "--pruning.seq_len", str(opts.seq_len), "--pruning.batch_size", str(opts.batch_size),
             "--pruning.blocksize", str(opts.blocksize), "--pruning.percdamp", str(opts.percdamp),
             "--pruning.hold_masks", "false", "--checkpoint.export_dtype", dtype]
    if opts.skip:
        extra += ["--pruning.skip", ",".join(opts.skip)]
    if opts.calib_path:
        if not Path(opts.calib_path).exists():
            raise ConfigError(f"--calib_path '{opts.calib_path}' does not exist")
        extra += ["--pruning.dataset", "text", "--pruning.dataset_path", opts.calib_path]
    if opts.device_memory_gib is not None:
        extra += ["--dry_run.device_memory_gib", str(opts.device_memory_gib)]
    return job_config(opts.hf_assets_path, opts.flavor, dtype, opts.seq_len, opts.tp, extra)


def estimate(opts: argparse.Namespace) -> None:
    """The plan of rank 0 of --ngpu devices (every data-parallel rank does the same work), for an accelerator."""
    cfg = pruning_config(opts, "cuda")
    plan = plan_job(cfg, opts.ngpu)
    capacity = device_memory_gib(cfg)
    pruning = plan_pruning_pass(plan)
    print(f"{cfg.model.flavor}: {plan.full_param_count():,} parameters; {opts.method} {opts.pattern} at "
          f"{opts.sparsity:g}; {opts.nsamples} x {opts.seq_len} calibration tokens in batches of {opts.batch_size}; "
          f"{plan.parallel_dims.describe()}; {cfg.training.dtype}")
    print("memory plan per device:")
    print("\n".join(pruning.lines(capacity)))
    if not pruning.fits(capacity):
        raise ConfigError(f"the plan does not fit: {pruning.peak / GIB:.2f} GiB per device against {capacity:.2f} GiB; "
                          "lower --nsamples or --batch_size, use bfloat16, or shard over more devices (torchrun)")
    print(f"estimate: peak {pruning.peak / GIB:.2f} GiB per device fits {capacity:.2f} GiB")


def prune(opts: argparse.Namespace) -> None:
    device_type = "cpu" if not torch.accelerator.is_available() else torch.accelerator.current_accelerator().type
    cfg = pruning_config(opts, device_type)
    plan, device = start_job(cfg)
    # The transform's after_load prints the memory plan, calibrates, prunes and logs the measured peak.
    built = assemble_model(plan, device, load=hf_weight_loader(plan, opts.hf_assets_path))
    transform = next(t for t in plan.transforms if t.name == "prune")
    report = sparsity_report(built.parts, cfg, plan.parallel_dims, transform.result, transform.plan,
                             transform.measured)
    out = Path(opts.output_dir)
    export_hf(built.parts, plan.model_args, str(out), getattr(torch, cfg.training.dtype), opts.hf_assets_path,
              plan.parallel_dims)
    if is_rank0():
        write_report(report, out / REPORT_NAME)
        print(f"peak memory per device: measured {format_bytes(transform.measured.bytes)} "
              f"({transform.measured.source}), estimated {format_bytes(transform.plan.peak)}", flush=True)
        linears = report["pruned_linears"]
        print(f"pruned model written to {out}: {linears['sparsity']:.2%} of the weights of {linears['count']} linear "
              f"layers are zero ({opts.method} {opts.pattern}); report {out / REPORT_NAME}", flush=True)


def remask(opts: argparse.Namespace) -> None:
    for flag, folder in (("--hf_assets_path", opts.hf_assets_path), ("--remask_from", opts.remask_from)):
        if not Path(folder).is_dir():
            raise ConfigError(f"{flag} '{folder}' is not a folder")
    linears, rezeroed = remask_hf_folder(opts.hf_assets_path, opts.remask_from, opts.output_dir)
    print(f"re-applied the zeros of {opts.remask_from} to {linears} linear layers of {opts.hf_assets_path}: "
          f"{rezeroed:,} weights set back to zero; written to {opts.output_dir}")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.remask_from:
        return run_script(lambda: remask(opts))
    return run_script(lambda: estimate(opts) if opts.estimate_only else prune(opts))


if __name__ == "__main__":
    sys.exit(main())
