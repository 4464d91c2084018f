"""One-shot pruning of a Hugging Face Llama folder (magnitude, Wanda, SparseGPT; unstructured, 2:4, 4:8) into a new
Hugging Face folder plus a per-layer sparsity report. Prints the memory plan before calibrating and the measured
peak after. Runs on one process or under torchrun (FSDP over the processes, --tp for tensor parallelism).
--method taylor_structured removes whole attention heads and MLP channels instead (first-order Taylor importance,
LLM-Pruner style) and writes a smaller dense Llama with its own config.json, plus a structure report.

    python scripts/prune.py --hf_assets_path assets/hf/Llama-3.2-1B --output_dir outputs/pruned-1B \\
        --method wanda --sparsity 0.5 --pattern 2:4 --calib_path /data/c4/en/c4-train.00000-of-01024.json.gz \\
        --nsamples 128 --seq_len 2048
    torchrun --nproc_per_node 4 scripts/prune.py ...                     # calibration split over 4 GPUs
    python scripts/prune.py --flavor 8B --hf_assets_path assets/tokenizer --estimate_only \\
        --nsamples 128 --seq_len 2048 --device_memory_gib 24            # the plan only, in seconds, no weights
    python scripts/prune.py --hf_assets_path outputs/merged --remask_from outputs/pruned-1B \\
        --output_dir outputs/merged-sparse                              # the zeros of a pruned folder, re-applied
    torchrun --nproc_per_node 2 scripts/prune.py --hf_assets_path assets/hf/Llama-3.1-8B \\
        --output_dir outputs/8B-taylor --method taylor_structured --head_ratio 0.25 --ffn_ratio 0.25 \\
        --nsamples 10 --seq_len 64                                      # whole heads and MLP channels removed
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.checkpoint.hf import export_hf, gather_full_state_dict
from titan_lite.config import JobConfig
from titan_lite.dry_run import device_memory_gib, pass_verdict, plan_passes
from titan_lite.errors import ConfigError
from titan_lite.job.assembly import assemble_model, calibration_source, hf_weight_loader
from titan_lite.job.cli import ScriptParser
from titan_lite.job.plan import plan_job
from titan_lite.job.script import (
    DTYPES,
    atomic_folder,
    check_output_folder,
    check_text_data,
    is_rank0,
    job_config,
    resolve_dtype,
    run_script,
    start_job,
)
from titan_lite.metrics.memory import measure_peak
from titan_lite.models.llama.args import LlamaArgs
from titan_lite.parallel.memory_estimate import GIB
from titan_lite.transforms.pruning.memory_plan import format_bytes
from titan_lite.transforms.pruning.remask import remask_hf_folder
from titan_lite.transforms.pruning.transform import REPORT_NAME, sparsity_report, write_report
from titan_lite.transforms.structured.materialize import (
    StructureKeep,
    materialize_state_dict,
    param_count,
    write_materialized_hf,
)
from titan_lite.transforms.structured.taylor import (
    HEAD_MODES,
    check_taylor_layout,
    local_calibration,
    select_keep,
    taylor_scores,
)

STRUCTURE_REPORT_NAME = "structure_report.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--hf_assets_path", required=True,
                        help="HF folder: config.json, tokenizer and safetensors (only the tokenizer with "
                             "--estimate_only and --flavor)")
    parser.add_argument("--output_dir", help="the pruned HF folder to write (replaced if it exists)")
    parser.add_argument("--method", choices=("wanda", "magnitude", "sparsegpt", "taylor_structured"),
                        default="wanda", help="unstructured or N:M pruning (wanda, magnitude, sparsegpt), or whole "
                                              "heads and MLP channels removed (taylor_structured)")
    parser.add_argument("--sparsity", type=float, default=0.5, help="fraction of each pruned linear set to zero")
    parser.add_argument("--pattern", choices=("unstructured", "2:4", "4:8"), default="unstructured",
                        help="which weights compete: a whole row, or N of every M consecutive inputs")
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
    ratios = parser.add_argument_group("layer ratios (magnitude, wanda, sparsegpt; unstructured)")
    ratios.add_argument("--layer_ratios", choices=("uniform", "owl"), default="uniform",
                        help="every layer at --sparsity, or OWL's outlier-weighted sparsities (a layer with more "
                             "outlier Wanda scores is pruned less; they average --sparsity)")
    ratios.add_argument("--owl_lambda", type=float, default=0.08,
                        help="OWL: the layers' sparsities span 2 x lambda around --sparsity")
    ratios.add_argument("--owl_m", type=float, default=5.0,
                        help="OWL: a score is an outlier above M x its layer's mean score")
    structured = parser.add_argument_group("taylor_structured")
    structured.add_argument("--head_ratio", type=float, default=0.0,
                            help="fraction of attention heads removed in every layer (of the query heads of each KV "
                                 "group with per_group_query, of the KV groups with kv_group)")
    structured.add_argument("--ffn_ratio", type=float, default=0.0,
                            help="fraction of MLP channels removed in every layer")
    structured.add_argument("--head_mode", choices=HEAD_MODES, default="per_group_query",
                            help="per_group_query: keep every KV head, the same number of query heads in each group; "
                                 "kv_group: remove whole KV groups (a KV head and its query heads)")
    structured.add_argument("--keep_first_last", action="store_true",
                            help="keep the first and last layers at full width (refused: see the README)")
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
             "--pruning.hold_masks", "false", "--checkpoint.export_dtype", dtype,
             "--pruning.layer_ratios", opts.layer_ratios, "--pruning.owl_lambda", str(opts.owl_lambda),
             "--pruning.owl_m", str(opts.owl_m)]
    if opts.skip:
        extra += ["--pruning.skip", ",".join(opts.skip)]
    if opts.calib_path:
        check_text_data("--calib_path", opts.calib_path)
        extra += ["--pruning.dataset", "text", "--pruning.dataset_path", opts.calib_path]
    if opts.device_memory_gib is not None:
        extra += ["--dry_run.device_memory_gib", str(opts.device_memory_gib)]
    return job_config(opts.hf_assets_path, opts.flavor, dtype, opts.seq_len, opts.tp, extra)


def check_output(opts: argparse.Namespace) -> None:
    check_output_folder("--output_dir", opts.output_dir,
                        {"--hf_assets_path": opts.hf_assets_path, "--remask_from": opts.remask_from,
                         "--calib_path": opts.calib_path})


def estimate(opts: argparse.Namespace) -> None:
    """The plan of rank 0 of --ngpu devices (every data-parallel rank does the same work), for an accelerator."""
    cfg = pruning_config(opts, "cuda")
    plan = plan_job(cfg, opts.ngpu)
    capacity = device_memory_gib(cfg)
    pruning = plan_passes(plan)[0]  # the prune transform's one-shot pass
    print(f"{cfg.model.flavor}: {plan.full_param_count():,} parameters; {opts.method} {opts.pattern} at "
          f"{opts.sparsity:g}; {opts.nsamples} x {opts.seq_len} calibration tokens in batches of {opts.batch_size}; "
          f"{plan.parallel_dims.describe()}; {cfg.training.dtype}")
    print("memory plan per device:")
    print("\n".join([*pruning.rows, f"  verdict: {pass_verdict(pruning, capacity)}"]))
    if pruning.peak / GIB > capacity:
        raise ConfigError(f"the plan does not fit: {pruning.peak / GIB:.2f} GiB per device against {capacity:.2f} GiB; "
                          "lower --nsamples or --batch_size, use bfloat16, or shard over more devices (torchrun)")
    print(f"estimate: peak {pruning.peak / GIB:.2f} GiB per device fits {capacity:.2f} GiB")


def prune(opts: argparse.Namespace) -> None:
    check_output(opts)
    device_type = "cpu" if not torch.accelerator.is_available() else torch.accelerator.current_accelerator().type
    cfg = pruning_config(opts, device_type)
    plan, device = start_job(cfg)
    # The transform's after_load prints the memory plan, calibrates, prunes and logs the measured peak.
    built = assemble_model(plan, device, load=hf_weight_loader(plan, opts.hf_assets_path))
    transform = next(t for t in plan.transforms if t.name == "prune")
    report = sparsity_report(built.parts, cfg, plan.parallel_dims, transform.result, transform.plan,
                             transform.measured)
    out = Path(opts.output_dir)
    if is_rank0():
        print(f"writing {out}", flush=True)
    with atomic_folder(out, owner=is_rank0()) as partial:
        export_hf(built.parts, plan.model_args, str(partial), getattr(torch, cfg.training.dtype),
                  opts.hf_assets_path, plan.parallel_dims)
        if is_rank0():
            write_report(report, partial / REPORT_NAME)
    if is_rank0():
        print(f"peak memory per device: measured {format_bytes(transform.measured.bytes)} "
              f"({transform.measured.source}), estimated {format_bytes(transform.plan.peak)}", flush=True)
        linears = report["pruned_linears"]
        print(f"pruned model written to {out}: {linears['sparsity']:.2%} of the weights of {linears['count']} linear "
              f"layers are zero ({opts.method} {opts.pattern}{owl_summary(report)}); report {out / REPORT_NAME}",
              flush=True)


def owl_summary(report: dict) -> str:
    """', OWL layer sparsities 0.4521 to 0.5473' for an OWL report, else ''."""
    if "owl" not in report:
        return ""
    sparsities = [layer["sparsity"] for layer in report["owl"]["layers"].values()]
    return f", OWL layer sparsities {min(sparsities):.4f} to {max(sparsities):.4f}"


def remask(opts: argparse.Namespace) -> None:
    check_output(opts)
    for flag, folder in (("--hf_assets_path", opts.hf_assets_path), ("--remask_from", opts.remask_from)):
        if not Path(folder).is_dir():
            raise ConfigError(f"{flag} '{folder}' is not a folder")
    linears, rezeroed = remask_hf_folder(opts.hf_assets_path, opts.remask_from, opts.output_dir)
    print(f"re-applied the zeros of {opts.remask_from} to {linears} linear layers of {opts.hf_assets_path}: "
          f"{rezeroed:,} weights set back to zero; written to {opts.output_dir}")


def check_structured(opts: argparse.Namespace) -> None:
    if opts.keep_first_last:
        raise ConfigError("--keep_first_last would give the first and last layers other widths than the rest, which "
                          "a Hugging Face LlamaConfig cannot describe (one width per kind for every layer); every "
                          "layer is pruned alike")
    if opts.estimate_only:
        raise ConfigError("--estimate_only plans the memory of wanda, magnitude and sparsegpt; taylor_structured "
                          "needs one forward and backward pass per calibration batch (plan it like a training step "
                          "with DRY_RUN=1)")
    for flag, ratio in (("--head_ratio", opts.head_ratio), ("--ffn_ratio", opts.ffn_ratio)):
        if not 0.0 <= ratio < 1.0:
            raise ConfigError(f"{flag} {ratio} must be a fraction in [0, 1)")
    if opts.head_ratio == 0.0 and opts.ffn_ratio == 0.0:
        raise ConfigError("--method taylor_structured needs --head_ratio or --ffn_ratio above 0 (the fractions of "
                          "heads and MLP channels removed); with neither it would write an unpruned copy")
    check_output(opts)
    if opts.calib_path:
        check_text_data("--calib_path", opts.calib_path)


def structured_config(opts: argparse.Namespace, device_type: str) -> JobConfig:
    """The source model's job: its own shapes, parameters and compute in the chosen dtype, full activation
    checkpointing (the calibration backward is the memory peak)."""
    dtype = resolve_dtype(opts.dtype, device_type)
    return job_config(opts.hf_assets_path, opts.flavor, dtype, opts.seq_len, opts.tp,
                      ["--activation_checkpoint.mode", "full", "--checkpoint.export_dtype", dtype])


def structure_report(opts: argparse.Namespace, args: LlamaArgs, new_args: LlamaArgs, keep: StructureKeep,
                     loss: float, seconds: float) -> dict:
    before, after = param_count(args), param_count(new_args)
    return {
        "method": "taylor_structured", "importance": "|sum(W * dL/dW)| per group", "head_mode": opts.head_mode,
        "head_ratio": opts.head_ratio, "ffn_ratio": opts.ffn_ratio,
        "calibration": {"path": opts.calib_path or "shakespeare", "nsamples": opts.nsamples, "seq_len": opts.seq_len,
                        "loss": loss},
        "shapes": {key: {"before": getattr(args, key), "after": getattr(new_args, key)}
                   for key in ("n_layers", "dim", "n_heads", "kv_heads", "head_dim", "ffn_dim")},
        "parameters": {"before": before, "after": after, "removed_fraction": 1 - after / before},
        "layers": [{"layer": layer, "q_heads": q, "kv_heads": kv, "ffn_kept": len(f), "ffn": f}
                   for layer, q, kv, f in zip(keep.layers, keep.q_heads, keep.kv_heads, keep.ffn, strict=True)],
        "seconds": round(seconds, 3),
    }


def prune_structured(opts: argparse.Namespace) -> None:
    """Score heads and channels on the sharded model, select the same keep-set on every rank, and let rank 0
    materialise and write the smaller model."""
    check_structured(opts)
    begin = time.monotonic()
    device_type = "cpu" if not torch.accelerator.is_available() else torch.accelerator.current_accelerator().type
    cfg = structured_config(opts, device_type)
    plan, device = start_job(cfg)
    check_taylor_layout(plan.parallel_dims)
    args = plan.model_args
    built = assemble_model(plan, device, load=hf_weight_loader(plan, opts.hf_assets_path))
    dataset, path = ("text", opts.calib_path) if opts.calib_path else ("shakespeare", None)
    windows = calibration_source(plan, device)(dataset, path, opts.nsamples, opts.seq_len, opts.batch_size)
    batches = local_calibration(windows, opts.nsamples, plan.parallel_dims, device, path or dataset)
    baseline = [t for part in built.parts for t in (*part.parameters(), *part.buffers())]
    with measure_peak(device, baseline) as measured:
        scores, loss = taylor_scores(built.runner, batches, plan.parallel_dims, args, device)
    if is_rank0():
        print(f"importance scored on {opts.nsamples} x {opts.seq_len} calibration tokens (mean loss {loss:.4f}); "
              f"peak memory per device {format_bytes(measured.bytes)} ({measured.source})", flush=True)
    keep = select_keep(scores, args, opts.head_ratio, opts.ffn_ratio, opts.head_mode)
    dtype = getattr(torch, cfg.training.dtype)
    sd = gather_full_state_dict(built.parts, dtype, plan.parallel_dims)
    del built
    if is_rank0():
        new_args, new_sd = materialize_state_dict(sd, args, keep)
        out = Path(opts.output_dir)
        print(f"writing {out}", flush=True)
        report = structure_report(opts, args, new_args, keep, loss, time.monotonic() - begin)
        report["memory"] = {"measured_peak_bytes": measured.bytes, "measured_by": measured.source}
        with atomic_folder(out) as partial:
            write_materialized_hf(new_sd, new_args, partial, dtype, opts.hf_assets_path)
            write_report(report, partial / STRUCTURE_REPORT_NAME)
        p = report["parameters"]
        print(f"pruned model written to {out}: {args.n_heads} -> {new_args.n_heads} heads, {args.kv_heads} -> "
              f"{new_args.kv_heads} KV heads ({opts.head_mode}), ffn {args.ffn_dim} -> {new_args.ffn_dim} in each of "
              f"{args.n_layers} layers; {p['before']:,} -> {p['after']:,} parameters (-{p['removed_fraction']:.1%}); "
              f"report {out / STRUCTURE_REPORT_NAME}", flush=True)
    if dist.is_initialized():
        dist.barrier()


def refuse_structured_flags(opts: argparse.Namespace) -> None:
    raise ConfigError(f"--head_ratio, --ffn_ratio, --head_mode and --keep_first_last apply to --method "
                      f"taylor_structured, not {opts.method}")


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.remask_from:
        return run_script(lambda: remask(opts))
    if opts.method == "taylor_structured":
        return run_script(lambda: prune_structured(opts))
    if opts.head_ratio or opts.ffn_ratio or opts.keep_first_last or opts.head_mode != "per_group_query":
        return run_script(lambda: refuse_structured_flags(opts))
    return run_script(lambda: estimate(opts) if opts.estimate_only else prune(opts))


if __name__ == "__main__":
    sys.exit(main())
