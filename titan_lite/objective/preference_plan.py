"""DRY_RUN's share of preference tuning: the lines naming the loss, the reference and the pairs' layout (with the
data there, what its first sequences hold), the memory a held reference adds to every rank, and the pass a
precomputed reference folder runs before training."""

from collections.abc import Callable

from titan_lite.config.schema import JobConfig
from titan_lite.data.dataloader import build_section_source
from titan_lite.errors import ConfigError
from titan_lite.job.estimate import compute_bytes
from titan_lite.job.plan import JobPlan
from titan_lite.objective.frozen import frozen_items
from titan_lite.objective.preference import check_preference, loss_spec, reference_of
from titan_lite.objective.reference import BASE
from titan_lite.objective.vocab import ACCELERATOR_CHUNK_ELEMENTS, CHUNK_ELEMENTS
from titan_lite.parallel.memory_estimate import GIB
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms import PassPlan, PlanItem


def preference_reference_plan(plan: JobPlan, files_there: bool) -> tuple[JobPlan | None, bool]:
    """(the reference's plan, whether training holds it): None for 'base' and reference-free losses; a folder's
    reference is held through training unless precomputed (then only during the pass before it)."""
    kind = reference_of(plan.cfg).kind
    if kind == BASE:
        check_preference(plan)
    reference = reference_of(plan.cfg).dry_run_plan(plan, files_there)
    return reference, reference is not None and not plan.cfg.preference.precompute_reference


def preference_lines(plan: JobPlan, reference: JobPlan | None) -> list[str]:
    cfg = plan.cfg
    p, spec, kind = cfg.preference, loss_spec(cfg), reference_of(cfg).kind
    if kind is None:
        where = "reference-free: no reference model"
    elif kind == BASE:
        where = "reference: the policy's own base, adapters off (no second copy)"
    else:
        where = (f"reference: {reference.cfg.model.flavor} from '{p.reference}', {reference.full_param_count():,} "
                 f"parameters in {reference.cfg.training.dtype}, frozen, sharded like the policy")
    if kind is not None:
        where += ("; precomputed in one forward pass over the pairs before training (then freed), kept as 2 float64 "
                  "per pair with the checkpoints" if p.precompute_reference
                  else "; one forward per microbatch without gradients before the policy's (its logits freed first)")
    window = cfg.training.seq_len + 1
    layout = (f"packed whole into windows of seq_len + 1 = {window:,} tokens" if p.packing
              else f"one pair per sequence of up to {window:,} tokens, padded to the longest of its batch")
    lines = [f"preference: {spec.describe()}; {where}",
             f"preference pairs: two block-causal documents each (prompt + chosen, prompt + rejected: the prompt "
             f"twice), {layout}; the loss averages over the global batch's pairs"]
    return lines + ([line] if (line := pair_statistics(cfg, plan.tokenizer)) else [])


def pair_statistics(cfg: JobConfig, tokenizer, windows: int = 64) -> str | None:
    """What the first sequences of the training data hold (pairs, and how their tokens divide into the prompts'
    two copies, the answers and padding), or None when the tokenizer or the data are not there yet."""
    if tokenizer is None:
        return None
    try:
        source = build_section_source(cfg, "training", tokenizer, infinite=False)
        samples = [sample for (sample, _), _ in zip(source.samples(), range(windows), strict=False)]
    except ConfigError:
        return None
    pairs = sum(len({int(d) // 2 for d in docs.tolist() if d >= 0}) for _, _, docs in samples)
    tokens = sum(docs.numel() for _, _, docs in samples)
    padding = sum(int((docs < 0).sum()) for _, _, docs in samples)
    answers = sum(int((labels >= 0).sum()) for _, labels, _ in samples)
    share = [100 * n / max(tokens, 1) for n in (tokens - padding - answers, answers, padding)]
    per = pairs / max(len(samples), 1)
    return (f"preference data: the first {len(samples)} sequences hold {pairs:,} pairs ({per:.1f} per sequence); "
            f"their tokens: {share[0]:.1f}% prompts (each twice), {share[1]:.1f}% answers (trained), "
            f"{share[2]:.1f}% padding")


def preference_memory(plan: JobPlan) -> Callable[[JobConfig, ParallelDims], list[PlanItem]]:
    """One rank's extra bytes besides a held reference's weights: the log-probabilities' float32 row blocks (their
    probabilities in the logits' dtype are the loss's saved tensor of the activations row)."""
    def items(cfg: JobConfig, dims: ParallelDims) -> list[PlanItem]:
        chunk = CHUNK_ELEMENTS if cfg.dry_run.device_type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
        return [PlanItem("buffers", 3 * chunk * 4, "preference log-probabilities: three float32 row blocks")]
    return items


def preference_passes(plan: JobPlan, reference: JobPlan | None):
    """The pass before training of a precomputed reference folder: the policy's weights, the reference's, and one
    forward without gradients (its logits and row blocks); none when no separate reference is loaded for it."""
    def passes(cfg: JobConfig, dims: ParallelDims, estimate) -> list[PassPlan]:
        if reference is None:
            return []
        c = compute_bytes(cfg)[0]
        held = frozen_items(reference, dims, c, "reference")
        tokens = cfg.training.local_batch_size * cfg.training.seq_len // dims.cp
        sharded = dims.tp > 1 and not cfg.parallelism.disable_loss_parallel
        vocab = -(-plan.model_args.vocab_size // dims.tp) if sharded else plan.model_args.vocab_size
        chunk = CHUNK_ELEMENTS if cfg.dry_run.device_type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
        forward = tokens * vocab * c + 3 * chunk * 4 + tokens * plan.model_args.dim * c * 4
        rows = [f"  {'policy':<12}{estimate.parameters / GIB:9.2f} GiB  its parameters (no gradients or optimizer "
                "state yet)", *(f"  {'reference':<12}{item.nbytes / GIB:9.2f} GiB  {item.note}" for item in held),
                f"  {'forward':<12}{forward / GIB:9.2f} GiB  logits {tokens:,} x {vocab:,} without gradients, "
                "three float32 row blocks and a layer's hidden states"]
        peak = estimate.parameters + sum(item.nbytes for item in held) + forward
        rows.append(f"  {'peak':<12}{peak / GIB:9.2f} GiB")
        return [PassPlan("the reference's precomputation",
                         f"precomputing the reference's log-probabilities before training ('{cfg.preference.reference}'"
                         " loaded for the pass, then freed), per device:", rows, peak,
                         "shard over more devices, or lower 'training.local_batch_size' (the pass's batch)")]
    return passes
