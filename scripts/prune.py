"""One-shot pruning of a Hugging Face Llama folder (magnitude, Wanda, SparseGPT; unstructured, 2:4, 4:8) into a new
Hugging Face folder plus a per-layer sparsity report. Prints the memory plan before calibrating and the measured
peak after. Runs on one process or under torchrun (FSDP over the processes, --tp for tensor parallelism).
--method taylor_structured removes whole attention heads and MLP channels instead (first-order Taylor importance,
LLM-Pruner style) and writes a smaller dense Llama with its own config.json, plus a structure report; --method depth
removes whole blocks (ShortGPT's block influence, or --layers_to_remove) and writes a shallower one, plus a depth
report. --layer_ratios owl gives each layer of magnitude, Wanda or SparseGPT its own sparsity (OWL).

    .venv/bin/python scripts/prune.py --hf_assets_path assets/hf/Llama-3.2-1B --output_dir outputs/pruned-1B \\
        --method wanda --sparsity 0.5 --pattern 2:4 --calib_path /data/c4/en/c4-train.00000-of-01024.json.gz \\
        --nsamples 128 --seq_len 2048
    torchrun --nproc_per_node 4 scripts/prune.py ...                     # calibration split over 4 GPUs
    .venv/bin/python scripts/prune.py --flavor 8B --hf_assets_path assets/tokenizer --estimate_only \\
        --nsamples 128 --seq_len 2048 --device_memory_gib 24            # the plan only, in seconds, no weights
    .venv/bin/python scripts/prune.py --hf_assets_path outputs/merged --remask_from outputs/pruned-1B \\
        --output_dir outputs/merged-sparse                              # the zeros of a pruned folder, re-applied
    torchrun --nproc_per_node 2 scripts/prune.py --hf_assets_path assets/hf/Llama-3.1-8B \\
        --output_dir outputs/8B-taylor --method taylor_structured --head_ratio 0.25 --ffn_ratio 0.25 \\
        --nsamples 10 --seq_len 64                                      # whole heads and MLP channels removed
    python scripts/prune.py --hf_assets_path assets/hf/Llama-3.1-8B --output_dir outputs/8B-depth24 \
        --method depth --remove_layers 8 --nsamples 64 --seq_len 2048   # the 8 least influential blocks removed
    torchrun --nproc_per_node 8 scripts/prune.py --hf_assets_path assets/hf/Qwen3-30B-A3B \
        --output_dir outputs/30B-reap50 --method reap --expert_ratio 0.5 --nsamples 128 --seq_len 2048
                                                                        # half of every MoE layer's experts removed
"""

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

# The checkout's titan_lite, whichever python runs the script (e.g. `.venv/bin/python scripts/...`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_lite.checkpoint.hf import export_hf, gather_full_state_dict
from titan_lite.checkpoint.resume import plan_weights
from titan_lite.config import JobConfig
from titan_lite.distributed import device_type as accelerator_type
from titan_lite.dry_run import device_memory_gib, pass_verdict, plan_passes, with_rank_parts
from titan_lite.errors import ConfigError
from titan_lite.folders import FOLDER_HELP, output_folder
from titan_lite.job.assembly import assemble_model, calibration_source
from titan_lite.job.cli import ScriptParser
from titan_lite.job.plan import JobPlan, plan_job
from titan_lite.job.script import (
    DTYPES,
    check_output_folder,
    check_text_data,
    is_rank0,
    job_config,
    resolve_dtype,
    run_script,
    start_job,
)
from titan_lite.metrics.memory import measure_peak
from titan_lite.models.args import LlamaArgs
from titan_lite.parallel.memory_estimate import GIB
from titan_lite.transforms import PassPlan
from titan_lite.transforms.pruning.memory_plan import format_bytes, precision
from titan_lite.transforms.pruning.remask import remask_hf_folder
from titan_lite.transforms.pruning.transform import REPORT_NAME, sparsity_report, write_report
from titan_lite.transforms.structured.depth import (
    block_influence,
    blocks_to_remove,
    check_depth_layout,
    check_removal,
    depth_keep,
    depth_pass_plan,
)
from titan_lite.transforms.structured.materialize import (
    StructureKeep,
    materialize_state_dict,
    param_count,
    write_materialized_hf,
)
from titan_lite.transforms.structured.reap import (
    EXPERT_SCORES,
    check_reap_layout,
    check_reap_model,
    expert_sums,
    experts_to_keep,
    model_param_count,
    reap_pass_plan,
    scores_of,
    without_experts,
)
from titan_lite.transforms.structured.taylor import (
    HEAD_MODES,
    check_taylor_layout,
    local_calibration,
    select_keep,
    taylor_scores,
)

STRUCTURE_REPORT_NAME = "structure_report.json"
DEPTH_REPORT_NAME = "depth_report.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ScriptParser(__doc__)
    parser.add_argument("--hf_assets_path", required=True,
                        help="HF folder: config.json, tokenizer and safetensors (only the tokenizer with "
                             "--estimate_only and --flavor)")
    parser.add_argument("--output_dir", help=f"the pruned HF folder to write: {FOLDER_HELP}")
    parser.add_argument("--method", choices=("wanda", "magnitude", "sparsegpt", "taylor_structured", "depth", "reap"),
                        default="wanda", help="unstructured or N:M pruning (wanda, magnitude, sparsegpt), whole "
                                              "heads and MLP channels removed (taylor_structured), whole blocks "
                                              "removed (depth), or whole experts of MoE layers removed (reap)")
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
                            help="keep the first and last layers at full width (refused: see docs/pruning.md)")
    depth = parser.add_argument_group("depth")
    depth.add_argument("--remove_layers", type=int,
                       help="remove this many blocks: those of lowest block influence 1 - cos(input, output)")
    depth.add_argument("--layers_to_remove", help="remove these blocks instead (comma list of indices, e.g. 20,21)")
    reap = parser.add_argument_group("reap (mixture-of-experts models)")
    reap.add_argument("--expert_ratio", type=float,
                      help="fraction of every MoE layer's experts removed (the lowest-scoring ones)")
    reap.add_argument("--expert_score", choices=EXPERT_SCORES, default="reap",
                      help="reap: mean router weight x expert output norm over the tokens routed to the expert "
                           "(REAP); frequency: the share of routed tokens")
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
             "--pruning.hold_masks", "false", "--pruning.layer_ratios", opts.layer_ratios,
             "--pruning.owl_lambda", str(opts.owl_lambda), "--pruning.owl_m", str(opts.owl_m)]
    if opts.skip:
        extra += ["--pruning.skip", ",".join(opts.skip)]
    if opts.calib_path:
        check_text_data("--calib_path", opts.calib_path)
        extra += ["--pruning.dataset", "text", "--pruning.dataset_path", opts.calib_path]
    if opts.device_memory_gib is not None:
        extra += ["--dry_run.device_memory_gib", str(opts.device_memory_gib)]
    return job_config(opts.hf_assets_path, opts.flavor, dtype, opts.seq_len, opts.tp, extra)


def check_output(opts: argparse.Namespace) -> None:
    """--output_dir is no input, and new, empty or holds only what titan_lite wrote there."""
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
    print_pass_plan(pruning, capacity, "lower --nsamples or --batch_size, use bfloat16, or shard over more devices "
                                       "(torchrun)")


def print_pass_plan(plan, capacity: float, advice: str) -> None:
    """A calibration pass's memory rows and verdict; one line if it does not fit, else the estimate's last line."""
    print("memory plan per device:")
    print("\n".join([*plan.rows, f"  verdict: {pass_verdict(plan, capacity)}"]))
    if plan.peak / GIB > capacity:
        raise ConfigError(f"the plan does not fit: {plan.peak / GIB:.2f} GiB per device against {capacity:.2f} GiB; "
                          f"{advice}")
    print(f"estimate: peak {plan.peak / GIB:.2f} GiB per device fits {capacity:.2f} GiB")


def prune(opts: argparse.Namespace) -> None:
    check_output(opts)
    device_type = accelerator_type()
    cfg = pruning_config(opts, device_type)
    plan, device = start_job(cfg)
    # The transform's after_load prints the memory plan, calibrates, prunes and logs the measured peak.
    built = assemble_model(plan, device, load=plan_weights("hf", opts.hf_assets_path))
    transform = next(t for t in plan.transforms if t.name == "prune")
    report = sparsity_report(built.parts, cfg, plan.parallel_dims, transform.result, transform.plan,
                             transform.measured)
    out = Path(opts.output_dir)
    if is_rank0():
        print(f"writing {out}", flush=True)
    with output_folder("--output_dir", out, owner=is_rank0()) as partial:
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
    with output_folder("--output_dir", opts.output_dir) as partial:
        linears, rezeroed = remask_hf_folder(opts.hf_assets_path, opts.remask_from, partial)
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
                      ["--activation_checkpoint.mode", "full"])


def calibration_batches(opts: argparse.Namespace, plan: JobPlan, device: torch.device) -> list:
    """This rank's calibration batches: --calib_path's text, else the bundled plays."""
    dataset, path = ("text", opts.calib_path) if opts.calib_path else ("shakespeare", None)
    windows = calibration_source(plan, device)(dataset, path, opts.nsamples, opts.seq_len, opts.batch_size)
    return local_calibration(windows, opts.nsamples, plan.parallel_dims, device, path or dataset)


def write_smaller_model(opts: argparse.Namespace, sd: dict, args: LlamaArgs, keep: StructureKeep, dtype: torch.dtype,
                        measured, report_name: str, report_of: Callable[[LlamaArgs], dict],
                        describe: Callable[[LlamaArgs], str]) -> None:
    """Rank 0 materialises the kept structure of the full state dict and writes it, with its report, as one folder
    (atomically); every rank waits for it. report_of / describe: the report and the summary's words for new args."""
    if is_rank0():
        new_args, new_sd = materialize_state_dict(sd, args, keep)
        out = Path(opts.output_dir)
        print(f"writing {out}", flush=True)
        report = report_of(new_args)
        report["memory"] = {"measured_peak_bytes": measured.bytes, "measured_by": measured.source}
        with output_folder("--output_dir", out) as partial:
            write_materialized_hf(new_sd, new_args, partial, dtype, opts.hf_assets_path)
            write_report(report, partial / report_name)
        p = report["parameters"]
        print(f"pruned model written to {out}: {describe(new_args)}; {p['before']:,} -> {p['after']:,} parameters "
              f"(-{p['removed_fraction']:.1%}); report {out / report_name}", flush=True)
    if dist.is_initialized():
        dist.barrier()


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
    device_type = accelerator_type()
    cfg = structured_config(opts, device_type)
    plan, device = start_job(cfg)
    check_taylor_layout(plan.parallel_dims)
    args = plan.model_args
    check_dense(args, "taylor_structured")
    if args.is_hybrid:
        raise ConfigError("--method taylor_structured is not supported for Qwen3.5: it cuts attention heads, and the "
                          "Gated DeltaNet (linear_attention) layers' heads and channels are not cut; use --method "
                          "depth (whole blocks) or wanda / sparsegpt")
    built = assemble_model(plan, device, load=plan_weights("hf", opts.hf_assets_path))
    batches = calibration_batches(opts, plan, device)
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
    write_smaller_model(opts, sd, args, keep, dtype, measured, STRUCTURE_REPORT_NAME,
                        lambda new_args: structure_report(opts, args, new_args, keep, loss, time.monotonic() - begin),
                        lambda new_args: f"{args.n_heads} -> {new_args.n_heads} heads, {args.kv_heads} -> "
                                         f"{new_args.kv_heads} KV heads ({opts.head_mode}), ffn {args.ffn_dim} -> "
                                         f"{new_args.ffn_dim} in each of {args.n_layers} layers")


# ------------------------------------------------------------------------------------------ depth


def removal_list(opts: argparse.Namespace) -> list[int] | None:
    """--layers_to_remove as indices (None when the lowest-influence blocks are chosen)."""
    if opts.layers_to_remove is None:
        return None
    try:
        return [int(i) for i in opts.layers_to_remove.split(",")]
    except ValueError:
        raise ConfigError(f"--layers_to_remove '{opts.layers_to_remove}' is not a comma list of block indices "
                          "(e.g. 20,21)") from None


def check_depth_options(opts: argparse.Namespace) -> None:
    if opts.remove_layers is not None and opts.layers_to_remove is not None:
        raise ConfigError(f"--remove_layers {opts.remove_layers} and --layers_to_remove {opts.layers_to_remove} both "
                          "choose the blocks to remove: give one, not both")
    if opts.remove_layers is None and opts.layers_to_remove is None:
        raise ConfigError("--method depth needs one of --remove_layers K (the K blocks of lowest influence) or "
                          "--layers_to_remove i,j (those blocks)")
    if opts.remove_layers is not None and opts.remove_layers < 1:
        raise ConfigError(f"--remove_layers {opts.remove_layers} must be at least 1")
    removal_list(opts)
    if not opts.estimate_only:
        check_output(opts)
    if opts.calib_path:
        check_text_data("--calib_path", opts.calib_path)


def depth_config(opts: argparse.Namespace, device_type: str) -> JobConfig:
    """The source model's job for scoring: its own shapes, weights and compute in the chosen dtype."""
    dtype = resolve_dtype(opts.dtype, device_type)
    extra = [] if opts.device_memory_gib is None else ["--dry_run.device_memory_gib", str(opts.device_memory_gib)]
    return job_config(opts.hf_assets_path, opts.flavor, dtype, opts.seq_len, opts.tp, extra)


def scoring_plan(plan: JobPlan, cfg: JobConfig, opts: argparse.Namespace, pass_plan) -> PassPlan:
    """A scoring pass's memory (depth_pass_plan, reap_pass_plan) on rank 0 of the plan's world, for an accelerator
    (parts on the meta device)."""
    def of(parts, dims):
        p = precision(cfg, dims, "cuda", getattr(torch, cfg.training.dtype))
        return pass_plan(plan.model_args, dims, parts, opts.nsamples, opts.batch_size, opts.seq_len, p)
    return with_rank_parts(plan, 0, of)


def estimate_depth(opts: argparse.Namespace) -> None:
    check_depth_options(opts)
    cfg = depth_config(opts, "cuda")
    plan = plan_job(cfg, opts.ngpu)
    check_depth_layout(plan.parallel_dims)
    check_dense(plan.model_args, "depth")
    check_removal_count(opts, plan.model_args.n_layers)
    capacity = device_memory_gib(cfg)
    scoring = scoring_plan(plan, cfg, opts, depth_pass_plan)
    print(f"{cfg.model.flavor}: {plan.full_param_count():,} parameters, {plan.model_args.n_layers} blocks; depth, "
          f"{opts.nsamples} x {opts.seq_len} calibration tokens in batches of {opts.batch_size}; "
          f"{plan.parallel_dims.describe()}; {cfg.training.dtype}")
    print_pass_plan(scoring, capacity, scoring.advice)


def check_dense(args: LlamaArgs, method: str) -> None:
    """depth and taylor_structured materialise dense feed-forwards: one line for a mixture of experts. Depth keeps a
    hybrid model's (Qwen3.5-MoE) and DeepSeek-V3's whole blocks, each kept block's tensors renamed as they are,
    experts included."""
    if args.n_experts and not (method == "depth" and (args.is_hybrid or args.is_latent)):
        raise ConfigError(f"--method {method} writes models whose feed-forwards are dense; this {args.family} model "
                          f"routes {len(args.moe_layers)} layers to experts: remove experts with --method reap")


def check_removal_count(opts: argparse.Namespace, n_layers: int) -> None:
    removed = removal_list(opts)
    if removed is not None:
        check_removal(removed, n_layers, "--layers_to_remove")
    elif opts.remove_layers >= n_layers:
        raise ConfigError(f"--remove_layers {opts.remove_layers} would remove every one of the model's {n_layers} "
                          "blocks; keep at least one")


def depth_report(opts: argparse.Namespace, args: LlamaArgs, new_args: LlamaArgs, scores: list[float],
                 removed: list[int], seconds: float) -> dict:
    before, after = param_count(args), param_count(new_args)
    return {
        "method": "depth", "importance": "block influence: 1 - mean over tokens of cos(block input, block output)",
        "chosen_by": "--layers_to_remove" if opts.layers_to_remove else f"--remove_layers {opts.remove_layers}",
        "calibration": {"path": opts.calib_path or "shakespeare", "nsamples": opts.nsamples, "seq_len": opts.seq_len},
        "block_influence": {str(i): score for i, score in enumerate(scores)},
        "removed": removed, "kept": [i for i in range(args.n_layers) if i not in removed],
        "parameters": {"before": before, "after": after, "removed_fraction": 1 - after / before},
        "seconds": round(seconds, 3),
    }


def prune_depth(opts: argparse.Namespace) -> None:
    """Score every block on the sharded model (every rank gets the same scores), choose the blocks, and let rank 0
    write the shallower model."""
    check_depth_options(opts)
    begin = time.monotonic()
    device_type = accelerator_type()
    cfg = depth_config(opts, device_type)
    plan, device = start_job(cfg)
    check_depth_layout(plan.parallel_dims)
    args = plan.model_args
    check_dense(args, "depth")
    check_removal_count(opts, args.n_layers)
    built = assemble_model(plan, device, load=plan_weights("hf", opts.hf_assets_path))
    if is_rank0():
        p = precision(cfg, plan.parallel_dims, device_type, getattr(torch, cfg.training.dtype))
        scoring = depth_pass_plan(args, plan.parallel_dims, built.parts, opts.nsamples, opts.batch_size, opts.seq_len,
                                  p)
        print("\n".join([scoring.title, *scoring.rows]), flush=True)
    batches = calibration_batches(opts, plan, device)
    baseline = [t for part in built.parts for t in (*part.parameters(), *part.buffers())]
    with measure_peak(device, baseline) as measured:
        scores = block_influence(built.runner, batches, device)
    removed = removal_list(opts) or blocks_to_remove(scores, opts.remove_layers)
    if is_rank0():
        print("block influence (1 - cos): " + ", ".join(f"{i}: {s:.6f}" for i, s in enumerate(scores)), flush=True)
        print(f"peak memory per device {format_bytes(measured.bytes)} ({measured.source})", flush=True)
    dtype = getattr(torch, cfg.training.dtype)
    sd = gather_full_state_dict(built.parts, dtype, plan.parallel_dims)
    del built
    write_smaller_model(opts, sd, args, depth_keep(args, removed), dtype, measured, DEPTH_REPORT_NAME,
                        lambda new_args: depth_report(opts, args, new_args, scores, removed, time.monotonic() - begin),
                        lambda new_args: f"blocks {removed} removed, {args.n_layers} -> {new_args.n_layers} blocks")


# ------------------------------------------------------------------------------------------ reap

REAP_REPORT_NAME = "reap_report.json"


def check_reap_options(opts: argparse.Namespace) -> None:
    if opts.expert_ratio is None:
        raise ConfigError("--method reap needs --expert_ratio R: the fraction of every MoE layer's experts removed")
    if not opts.estimate_only:
        check_output(opts)
    if opts.calib_path:
        check_text_data("--calib_path", opts.calib_path)


def model_source(opts: argparse.Namespace) -> str:
    return f"flavor '{opts.flavor}'" if opts.flavor else f"'{opts.hf_assets_path}'"


def estimate_reap(opts: argparse.Namespace) -> None:
    check_reap_options(opts)
    cfg = depth_config(opts, "cuda")
    plan = plan_job(cfg, opts.ngpu)
    check_reap_layout(plan.parallel_dims)
    args = plan.model_args
    kept = check_reap_model(args, opts.expert_ratio, model_source(opts))
    capacity = device_memory_gib(cfg)
    scoring = scoring_plan(plan, cfg, opts, reap_pass_plan)
    print(f"{cfg.model.flavor}: {plan.full_param_count():,} parameters, {len(args.moe_layers)} MoE layers of "
          f"{args.n_experts} experts -> {kept}; REAP ({opts.expert_score}), {opts.nsamples} x {opts.seq_len} "
          f"calibration tokens in batches of {opts.batch_size}; {plan.parallel_dims.describe()}; {cfg.training.dtype}")
    print_pass_plan(scoring, capacity, scoring.advice)


def reap_report(opts: argparse.Namespace, args: LlamaArgs, new_args: LlamaArgs, scores: dict, keep: dict,
                seconds: float) -> dict:
    before, after = model_param_count(args), model_param_count(new_args)
    what = {"reap": "mean over the tokens routed to the expert of router weight x ||expert output||_2",
            "frequency": "share of the layer's routed (token, expert) pairs"}[opts.expert_score]
    return {
        "method": "reap", "expert_score": opts.expert_score, "score": what, "expert_ratio": opts.expert_ratio,
        "calibration": {"path": opts.calib_path or "shakespeare", "nsamples": opts.nsamples, "seq_len": opts.seq_len},
        "experts": {"before": args.n_experts, "after": new_args.n_experts, "num_experts_per_tok": args.moe_top_k},
        "layers": {str(layer): {"scores": scores[layer], "kept": keep[layer],
                                "removed": [j for j in range(args.n_experts) if j not in keep[layer]]}
                   for layer in sorted(keep)},
        "parameters": {"before": before, "after": after, "removed_fraction": 1 - after / before,
                       "active_after": after - new_args.inactive_param_count()},
        "seconds": round(seconds, 3),
    }


def prune_reap(opts: argparse.Namespace) -> None:
    """Score every MoE layer's experts on the sharded model (every rank gets the same scores), keep the best of each
    layer, and let rank 0 write the smaller Qwen3-MoE folder with its report."""
    check_reap_options(opts)
    begin = time.monotonic()
    device_type = accelerator_type()
    cfg = depth_config(opts, device_type)
    plan, device = start_job(cfg)
    check_reap_layout(plan.parallel_dims)
    args = plan.model_args
    kept = check_reap_model(args, opts.expert_ratio, model_source(opts))
    built = assemble_model(plan, device, load=plan_weights("hf", opts.hf_assets_path))
    if is_rank0():
        p = precision(cfg, plan.parallel_dims, device_type, getattr(torch, cfg.training.dtype))
        scoring = reap_pass_plan(args, plan.parallel_dims, built.parts, opts.nsamples, opts.batch_size, opts.seq_len,
                                 p)
        print("\n".join([scoring.title, *scoring.rows]), flush=True)
    batches = calibration_batches(opts, plan, device)
    baseline = [t for part in built.parts for t in (*part.parameters(), *part.buffers())]
    with measure_peak(device, baseline) as measured:
        scores = scores_of(expert_sums(built.runner, batches, device), opts.expert_score)
    keep = experts_to_keep(scores, kept)
    if is_rank0():
        for layer, values in scores.items():
            print(f"layer {layer} {opts.expert_score} scores: " + ", ".join(f"{j}: {v:.6g}" for j, v in
                                                                           enumerate(values)), flush=True)
        print(f"peak memory per device {format_bytes(measured.bytes)} ({measured.source})", flush=True)
    dtype = getattr(torch, cfg.training.dtype)
    sd = gather_full_state_dict(built.parts, dtype, plan.parallel_dims)
    del built
    if is_rank0():
        new_sd, new_args = without_experts(sd, args, keep)
        out = Path(opts.output_dir)
        print(f"writing {out}", flush=True)
        report = reap_report(opts, args, new_args, scores, keep, time.monotonic() - begin)
        report["memory"] = {"measured_peak_bytes": measured.bytes, "measured_by": measured.source}
        with output_folder("--output_dir", out) as partial:
            write_materialized_hf(new_sd, new_args, partial, dtype, opts.hf_assets_path)
            write_report(report, partial / REAP_REPORT_NAME)
        p = report["parameters"]
        print(f"pruned model written to {out}: {args.n_experts} -> {new_args.n_experts} experts in each of "
              f"{len(args.moe_layers)} MoE layers ({opts.expert_score}); {p['before']:,} -> {p['after']:,} parameters "
              f"(-{p['removed_fraction']:.1%}), {p['active_after']:,} active; report {out / REAP_REPORT_NAME}",
              flush=True)
    if dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------------------------------ entry


def refuse_flags(opts: argparse.Namespace) -> str | None:
    """The line for flags of another method than the chosen one, or None."""
    structured = opts.head_ratio or opts.ffn_ratio or opts.keep_first_last or opts.head_mode != "per_group_query"
    if structured and opts.method != "taylor_structured":
        return (f"--head_ratio, --ffn_ratio, --head_mode and --keep_first_last apply to --method taylor_structured, "
                f"not {opts.method}")
    if (opts.remove_layers is not None or opts.layers_to_remove is not None) and opts.method != "depth":
        return f"--remove_layers and --layers_to_remove apply to --method depth, not {opts.method}"
    if opts.layer_ratios != "uniform" and opts.method in ("taylor_structured", "depth", "reap"):
        return f"--layer_ratios applies to magnitude, wanda and sparsegpt, not {opts.method}"
    if (opts.expert_ratio is not None or opts.expert_score != "reap") and opts.method != "reap":
        return f"--expert_ratio and --expert_score apply to --method reap, not {opts.method}"
    return None


def refuse(line: str) -> None:
    raise ConfigError(line)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.remask_from:
        return run_script(lambda: remask(opts))
    line = refuse_flags(opts)
    if line is not None:
        return run_script(lambda: refuse(line))
    if opts.method == "taylor_structured":
        return run_script(lambda: prune_structured(opts))
    if opts.method == "depth":
        return run_script(lambda: estimate_depth(opts) if opts.estimate_only else prune_depth(opts))
    if opts.method == "reap":
        return run_script(lambda: estimate_reap(opts) if opts.estimate_only else prune_reap(opts))
    return run_script(lambda: estimate(opts) if opts.estimate_only else prune(opts))


if __name__ == "__main__":
    sys.exit(main())
