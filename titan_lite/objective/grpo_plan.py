"""DRY_RUN's share of GRPO: the lines naming the loss, the rollout batch and the packed training batch; the memory a
held reference and the rollouts' per-token values add to the training step; and each step's rollout as a pass of its
own (the policy's weights and optimizer state, the decode engine's slot cache and staging area, a prefill's working
set and the decode step's logits: generation and the training forwards never hold their memory together)."""

from collections.abc import Callable

from titan_lite.config.schema import JobConfig
from titan_lite.job.estimate import compute_bytes
from titan_lite.job.plan import JobPlan, gradient_accumulation_steps
from titan_lite.metrics.memory import device_memory_gib
from titan_lite.objective.grpo import check_grpo, loss_spec, reference_of
from titan_lite.objective.reference import BASE
from titan_lite.objective.vocab import ACCELERATOR_CHUNK_ELEMENTS, CHUNK_ELEMENTS
from titan_lite.parallel.gather_once import HEADROOM
from titan_lite.parallel.memory_estimate import GIB, MemoryEstimate
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.rl.memory import cache_capacity, decoded_together, rollout_memory
from titan_lite.transforms import PassPlan, PlanItem


def grpo_reference_plan(plan: JobPlan, files_there: bool) -> JobPlan | None:
    """The reference held through training: a folder's (with beta > 0), else None (none, or the policy's base)."""
    if reference_of(plan.cfg).kind == BASE:
        check_grpo(plan)
    return reference_of(plan.cfg).dry_run_plan(plan, files_there)


def rollout_rows(cfg: JobConfig, dims: ParallelDims) -> tuple[int, int]:
    """(completions a rank samples per step, completions it decodes together)."""
    per_rank = cfg.training.local_batch_size * gradient_accumulation_steps(cfg, dims.dp_degree)
    return per_rank, decoded_together(cfg, per_rank)


def grpo_lines(plan: JobPlan, reference: JobPlan | None) -> list[str]:
    cfg, dims = plan.cfg, plan.parallel_dims
    g, kind = cfg.grpo, reference_of(cfg).kind
    if kind is None:
        where = "no reference (beta 0)"
    elif kind == BASE:
        where = "reference: the policy's own base, adapters off (no second copy), one forward per microbatch"
    else:
        where = (f"reference: {reference.cfg.model.flavor} from '{g.reference}', {reference.full_param_count():,} "
                 f"parameters in {reference.cfg.training.dtype}, frozen, sharded like the policy")
    per_rank, together = rollout_rows(cfg, dims)
    prompt, columns = cache_capacity(cfg, dims.tp)
    m = rollout_memory(cfg, plan.model_args, dims.tp, together, compute_bytes(cfg)[0])
    how = "" if dims.world_size == 1 else (", in lockstep with the other ranks unless FSDP's weights are gathered "
                                           "once and nothing else shards the forward")
    layout = (f"packed whole into windows of seq_len + 1 = {cfg.training.seq_len + 1:,} tokens (block-causal)"
              if g.packing else "one per row, padded to the longest of the microbatch")
    return [f"grpo: {loss_spec(cfg).describe()}; {where}",
            f"grpo rollouts: {plan.global_batch_size // g.num_generations} prompts x {g.num_generations} completions "
            f"= {plan.global_batch_size} per step, {per_rank} sampled on each data-parallel rank, decoded by the "
            f"decode engine in {together} slots{how}: a cache of {columns:,} columns each (prompts up to {prompt:,} "
            f"tokens + {g.max_completion_length:,} new) and a staging area of {m.staged} prompt(s) for a group's "
            f"prefill, {(m.cache + m.stage) / GIB:.2f} GiB per device",
            f"grpo training batch: microbatches of {cfg.training.local_batch_size} completions, their prompt + "
            f"completion sequences {layout}; each label's sampling log-probability and advantage ride along "
            f"(float32); {g.num_iterations} optimizer step(s) per rollout"]


def value_bytes(cfg: JobConfig, dims: ParallelDims) -> int:
    """The microbatch's per-token float32 values (log-probability, advantage, weight, the policy's log-probability,
    a reference's) and the log-probabilities' three float32 row blocks."""
    tokens = cfg.training.local_batch_size * cfg.training.seq_len // dims.cp
    chunk = CHUNK_ELEMENTS if cfg.dry_run.device_type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    return tokens * 4 * 6 + 3 * chunk * 4


def grpo_memory(plan: JobPlan) -> Callable[[JobConfig, ParallelDims], list[PlanItem]]:
    def items(cfg: JobConfig, dims: ParallelDims) -> list[PlanItem]:
        return [PlanItem("buffers", value_bytes(cfg, dims), "grpo: per-token values and log-probability row blocks")]
    return items


def grpo_passes(plan: JobPlan):
    """Each step's rollout on one rank: the training state it keeps (weights, optimizer, FSDP's buffers), the KV cache
    of a generation batch, the prefill's working set (one layer's, no gradients) and the decode step's logits."""
    def passes(cfg: JobConfig, dims: ParallelDims, estimate: MemoryEstimate) -> list[PassPlan]:
        c = compute_bytes(cfg)[0]
        m = rollout_memory(cfg, plan.model_args, dims.tp, rollout_rows(cfg, dims)[1], c)
        kept = estimate.parameters + estimate.optimizer + estimate.buffers
        rows = [f"  {'training':<12}{kept / GIB:9.2f} GiB  parameters, optimizer state and buffers, kept",
                f"  {'kv cache':<12}{m.cache / GIB:9.2f} GiB  the decode engine's {m.together} slots x {m.slots:,} "
                "columns",
                f"  {'staging':<12}{m.stage / GIB:9.2f} GiB  {m.staged} prompt(s) prefilled once for their group's "
                "completions",
                f"  {'prefill':<12}{m.prefill / GIB:9.2f} GiB  a layer's working set over {m.prompt_tokens:,} prompt "
                "tokens and its attention mask, no gradients",
                f"  {'decode':<12}{m.logits / GIB:9.2f} GiB  the next token's logits and its float32 distribution"]
        gathered = gathered_weights(cfg, dims, plan.full_param_count() * c // dims.tp, kept + m.total)
        if gathered:
            rows.append(f"  {'gathered':<12}{gathered / GIB:9.2f} GiB  FSDP's weights gathered once for the "
                        f"rollout (grpo.gather_once = '{cfg.grpo.gather_once}')")
        elif dims.fsdp_enabled or dims.dp_replicate_enabled:
            rows.append(f"  {'gathered':<12}{0:9.2f} GiB  FSDP gathers layer by layer in every decode step "
                        f"(grpo.gather_once = '{cfg.grpo.gather_once}')")
        peak = kept + m.total + gathered
        rows.append(f"  {'peak':<12}{peak / GIB:9.2f} GiB")
        advice = "set 'grpo.gather_once' = 'never', or " if gathered else ""
        return [PassPlan("the rollout", "each step's rollout (generation with the KV cache), per device:", rows, peak,
                         f"{advice}lower 'grpo.generation_batch_size' (completions decoded together) or "
                         "'grpo.max_completion_length', or shard over more devices")]
    return passes


def gathered_weights(cfg: JobConfig, dims: ParallelDims, unsharded: int, rollout: int) -> int:
    """Bytes the rollout holds for FSDP's weights gathered once (grpo.gather_once; auto: where they fit beside the
    rest of the rollout in the planned device's memory), 0 when it gathers layer by layer."""
    mode = cfg.grpo.gather_once
    if not (dims.fsdp_enabled or dims.dp_replicate_enabled) or mode == "never":
        return 0
    fits = rollout + unsharded <= HEADROOM * device_memory_gib(cfg) * GIB
    return unsharded if mode == "always" or fits else 0
