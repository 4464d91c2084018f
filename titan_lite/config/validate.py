"""Checks a parsed JobConfig for impossible values before any heavy work; each failure is one ConfigError line."""

import dataclasses
import math
import re
from pathlib import Path

from titan_lite.config.gates import check_switched_off
from titan_lite.config.manager import choices_of, iter_options, not_one_of
from titan_lite.config.schema import REFERENCE_FREE, JobConfig
from titan_lite.errors import ConfigError, quote_path
from titan_lite.folders import partial_folder


def _get(cfg: JobConfig, key: str):
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def check_choices_and_unsupported(cfg: JobConfig) -> None:
    """Literal fields hold one of their values; `unsupported` fields keep their default."""
    for key, f, tp in iter_options():
        value = _get(cfg, key)
        choices = choices_of(tp)
        if choices and value is not None and value not in choices:
            raise ConfigError(not_one_of(key, value, choices))
        reason = f.metadata.get("unsupported")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if reason and value != default:
            raise ConfigError(f"'{key}' = {value!r} is not supported: {reason}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _at_least(cfg: JobConfig, key: str, minimum: int) -> None:
    value = _get(cfg, key)
    _require(value >= minimum, f"'{key}' must be at least {minimum}, got {value}")


def _positive(cfg: JobConfig, key: str) -> None:
    value = _get(cfg, key)
    _require(value > 0, f"'{key}' must be positive, got {value}")


def _minus_one_or_positive(cfg: JobConfig, key: str) -> None:
    value = _get(cfg, key)
    _require(value == -1 or value >= 1, f"'{key}' must be -1 or positive, got {value}")


def check_ranges(cfg: JobConfig) -> None:
    """Every per-key range, then the checks that relate keys to each other."""
    check_training(cfg)
    check_optimizer(cfg)
    for key in ("metrics.log_freq", "profiling.profile_freq", "comm.init_timeout_seconds",
                "comm.train_timeout_seconds"):
        _at_least(cfg, key, 1)
    check_lr_scheduler(cfg)
    check_parallelism(cfg)
    check_validation(cfg)
    check_instruct(cfg)
    check_attention(cfg)
    check_data_mixture(cfg)
    check_activation_checkpoint(cfg)
    check_compile(cfg)
    check_checkpoint(cfg)
    check_pipeline(cfg)
    check_pruning(cfg)
    check_sheared(cfg)
    check_distill(cfg)
    check_preference(cfg)
    check_grpo(cfg)


def check_training(cfg: JobConfig) -> None:
    for key in ("training.steps", "training.local_batch_size", "training.gc_freq"):
        _at_least(cfg, key, 1)
    _at_least(cfg, "training.seq_len", 2)
    if cfg.training.epochs is not None and not cfg.training.epochs > 0:
        raise ConfigError(f"'training.epochs' must be a positive number of passes over the data, got "
                          f"{cfg.training.epochs}")
    _minus_one_or_positive(cfg, "training.global_batch_size")
    check_dataloader(cfg, "training")


def check_dataloader(cfg: JobConfig, section: str) -> None:
    """[training.dataloader] or [validation.dataloader]: worker options need workers."""
    prefix = f"{section}.dataloader"
    loader = _get(cfg, prefix)
    _at_least(cfg, f"{prefix}.num_workers", 0)
    if loader.prefetch_factor is not None:
        _at_least(cfg, f"{prefix}.prefetch_factor", 1)
        _require(loader.num_workers > 0, f"'{prefix}.prefetch_factor' = {loader.prefetch_factor} needs "
                                         f"'{prefix}.num_workers' > 0 (leave it unset with 0 workers)")
    _require(loader.num_workers > 0 or not loader.persistent_workers,
             f"'{prefix}.persistent_workers' = true needs '{prefix}.num_workers' > 0")


def check_optimizer(cfg: JobConfig) -> None:
    for key in ("optimizer.lr", "optimizer.eps"):
        _positive(cfg, key)
    for name in ("beta1", "beta2"):
        beta = getattr(cfg.optimizer, name)
        _require(0 <= beta < 1, f"'optimizer.{name}' must be in [0, 1), got {beta}")


def check_parallelism(cfg: JobConfig) -> None:
    for name in ("data_parallel_replicate_degree", "tensor_parallel_degree", "pipeline_parallel_degree",
                 "context_parallel_degree", "pipeline_parallel_microbatch_size", "expert_parallel_degree"):
        _at_least(cfg, f"parallelism.{name}", 1)
    _minus_one_or_positive(cfg, "parallelism.data_parallel_shard_degree")
    check_expert_parallel(cfg)


def check_expert_parallel(cfg: JobConfig) -> None:
    """torchtitan's EP options titan_lite lacks are inert while EP is off and refused with it."""
    p = cfg.parallelism
    if p.expert_parallel_degree == 1:
        return
    _require(p.expert_parallel_comm_backend == "standard",
             f"'parallelism.expert_parallel_comm_backend' = '{p.expert_parallel_comm_backend}' is not supported: "
             "titan_lite exchanges tokens with torch.distributed's all-to-all ('standard')")
    _require(not p.pipeline_parallel_expert_parallel_overlap,
             "'parallelism.pipeline_parallel_expert_parallel_overlap' = true needs torchtitan's DualPipeV schedule, "
             "which titan_lite does not have; set it to false")


def check_validation(cfg: JobConfig) -> None:
    if not cfg.validation.enable:
        return
    for key in ("validation.freq", "validation.local_batch_size"):
        _at_least(cfg, key, 1)
    _at_least(cfg, "validation.seq_len", 2)
    _minus_one_or_positive(cfg, "validation.steps")
    check_dataloader(cfg, "validation")
    for key in ("validation.answer_problems", "validation.sample_outputs"):
        _at_least(cfg, key, 0)
    _at_least(cfg, "validation.max_new_tokens", 1)


def check_instruct(cfg: JobConfig) -> None:
    """[instruct] and the datasets that use it: fields, template, held-out split, and where generation runs."""
    i, v, p = cfg.instruct, cfg.validation, cfg.parallelism
    uses = cfg.training.dataset == "instruct" or (v.enable and v.dataset == "instruct")
    if not uses:
        _require(not (v.enable and v.answer_problems > 0),
                 f"'validation.answer_problems' = {v.answer_problems} needs 'validation.dataset' = 'instruct' "
                 "(prompt/response examples to generate answers for)")
        return
    for key in ("prompt_field", "response_field"):
        _require(bool(getattr(i, key).strip()), f"'instruct.{key}' must name a field, got {getattr(i, key)!r}")
    _require(i.prompt_field != i.response_field,
             f"'instruct.prompt_field' and 'instruct.response_field' are both {i.prompt_field!r}; they must differ")
    _require("{prompt}" in i.template, f"'instruct.template' = {i.template!r} has no {{prompt}} placeholder")
    fields = {k: getattr(i, k) for k in ("prompt_field", "response_field", "messages_field", "conversations_field")}
    for key in ("messages_field", "conversations_field"):
        _require(bool(fields[key].strip()), f"'instruct.{key}' must name a field, got {fields[key]!r}")
        _require(list(fields.values()).count(fields[key]) == 1,
                 f"'instruct.{key}' = {fields[key]!r} is also another instruct field; the fields must differ")
    _require(0 <= i.validation_fraction < 1,
             f"'instruct.validation_fraction' must be in [0, 1), got {i.validation_fraction}")
    if v.enable and v.dataset == "instruct" and v.dataset_path is None:
        _require(cfg.training.dataset == "instruct",
                 "'validation.dataset' = 'instruct' without 'validation.dataset_path' holds out examples of the "
                 f"training file, but 'training.dataset' = '{cfg.training.dataset}'; set validation.dataset_path")
        _require(i.validation_fraction > 0, "'validation.dataset' = 'instruct' without 'validation.dataset_path' "
                                            "needs 'instruct.validation_fraction' > 0 (the held-out split)")
    _require(i.packing or p.context_parallel_degree == 1,
             "dataset 'instruct' with 'parallelism.context_parallel_degree' > 1 needs 'instruct.packing' = true "
             "(padded batches vary in length; packed ones are seq_len long)")
    if v.enable and v.dataset == "instruct" and v.answer_problems > 0:
        split = {"tensor_parallel_degree": p.tensor_parallel_degree, "pipeline_parallel_degree":
                 p.pipeline_parallel_degree, "context_parallel_degree": p.context_parallel_degree}
        for name, degree in split.items():
            _require(degree == 1, f"'validation.answer_problems' = {v.answer_problems} (generation) runs on one "
                                  f"process or FSDP/HSDP only, not with 'parallelism.{name}' = {degree}; set "
                                  "validation.answer_problems = 0 (loss and token accuracy still work)")


def check_attention(cfg: JobConfig) -> None:
    """[model] attn_type: torchtitan's varlen kernel is not part of titan_lite."""
    _require(cfg.model.attn_type != "varlen",
             "'model.attn_type' = 'varlen' is not supported: titan_lite attends with sdpa or flex; both take "
             "'model.attn_mask_type' = 'block_causal' for packed documents")


def check_data_mixture(cfg: JobConfig) -> None:
    """[data_mixture]: one path per domain, and per-domain lists of the same length."""
    m = cfg.data_mixture
    if not m.enable:
        return
    n = len(m.dataset_paths)
    _require(n >= 1, "'data_mixture.enable' = true needs 'data_mixture.dataset_paths' (one path per domain)")
    for key in ("domains", "weights", "reference_losses"):
        given = len(getattr(m, key))
        _require(given in (0, n), f"'data_mixture.{key}' has {given} entries but 'data_mixture.dataset_paths' has "
                                  f"{n} domains; give one per domain (or none)")
    _require(len(set(m.domains)) == len(m.domains), f"'data_mixture.domains' = {m.domains} repeats a name")
    for i, w in enumerate(m.weights):
        _require(math.isfinite(w) and w >= 0, f"'data_mixture.weights[{i}]' = {w} must be a number >= 0")
    _require(not m.weights or sum(m.weights) > 0, "'data_mixture.weights' are all 0; at least one must be positive")
    for i, loss in enumerate(m.reference_losses):
        _require(math.isfinite(loss), f"'data_mixture.reference_losses[{i}]' = {loss} must be a finite number")
    _at_least(cfg, "data_mixture.update_freq", 1)
    _require(math.isfinite(m.eta) and m.eta > 0, f"'data_mixture.eta' must be positive, got {m.eta}")
    _require(0 <= m.smoothing < 1, f"'data_mixture.smoothing' must be in [0, 1), got {m.smoothing}")
    _require(cfg.training.dataset != "instruct",
             "'data_mixture.enable' = true replaces 'training.dataset' with pre-training domains; it does not mix "
             "instruction data ('training.dataset' = 'instruct')")
    _require(cfg.training.epochs is None, "'training.epochs' counts passes over 'training.dataset'; a data mixture "
                                          "draws its domains without end: set 'training.steps' instead")


def check_lr_scheduler(cfg: JobConfig) -> None:
    s = cfg.lr_scheduler
    _at_least(cfg, "lr_scheduler.warmup_steps", 0)
    if s.warmup_ratio is not None:
        _require(0 <= s.warmup_ratio < 1, f"'lr_scheduler.warmup_ratio' must be in [0, 1), got {s.warmup_ratio}")
    if s.total_steps is not None:
        _positive(cfg, "lr_scheduler.total_steps")
    if s.decay_ratio is not None:
        _require(0 <= s.decay_ratio <= 1, f"'lr_scheduler.decay_ratio' must be in [0, 1], got {s.decay_ratio}")
    _require(0 <= s.min_lr_factor <= 1, f"'lr_scheduler.min_lr_factor' must be in [0, 1], got {s.min_lr_factor}")
    if s.name == "greedy":
        _require(s.greedy_factor > 1, f"'lr_scheduler.greedy_factor' must be greater than 1, got {s.greedy_factor}")
        _at_least(cfg, "lr_scheduler.greedy_patience", 1)
        _require(0 <= s.greedy_smoothing < 1,
                 f"'lr_scheduler.greedy_smoothing' must be in [0, 1), got {s.greedy_smoothing}")
        _require(0 < s.greedy_min_lr_factor <= 1 <= s.greedy_max_lr_factor,
                 "'lr_scheduler.greedy_min_lr_factor' must be in (0, 1] and 'greedy_max_lr_factor' at least 1, "
                 f"got {s.greedy_min_lr_factor} and {s.greedy_max_lr_factor}")
        _at_least(cfg, "lr_scheduler.greedy_cooldown", 0)


def check_activation_checkpoint(cfg: JobConfig) -> None:
    ac = cfg.activation_checkpoint
    if ac.mode == "memory_budget":
        raise ConfigError("'activation_checkpoint.mode' = 'memory_budget' is not supported: "
                          "use none, full or selective")
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        option = ac.selective_ac_option
        _require(option.isdigit() and int(option) >= 1,
                 f"'activation_checkpoint.selective_ac_option' must be 'op' or a positive integer, got {option!r}")


def check_compile(cfg: JobConfig) -> None:
    unknown = [c for c in cfg.compile.components if c not in ("model", "loss")]
    _require(not unknown, f"'compile.components' has {', '.join(map(repr, unknown))}; expected some of: model, loss")


def check_pipeline(cfg: JobConfig) -> None:
    """Pipeline checks of the schedule against other settings (microbatch counts: parallel/pipeline.py)."""
    p = cfg.parallelism
    if p.pipeline_parallel_degree <= 1:
        return
    _require(not (cfg.validation.enable and p.pipeline_parallel_schedule == "ZBVZeroBubble"),
             "'validation.enable' with 'parallelism.pipeline_parallel_schedule' = 'ZBVZeroBubble' is not supported: "
             "torch's ZBV schedule has no forward-only (eval) mode; use another schedule or disable validation")
    zero_bubble = p.pipeline_parallel_schedule in ("InterleavedZeroBubble", "ZBVZeroBubble")
    _require(not (zero_bubble and cfg.compile.enable and "model" in cfg.compile.components),
             f"'parallelism.pipeline_parallel_schedule' = '{p.pipeline_parallel_schedule}' splits the backward into "
             "input and weight passes, which torch does not support on compiled modules; drop 'model' from "
             "'compile.components' or use another schedule")


def check_pruning(cfg: JobConfig) -> None:
    p = cfg.pruning
    _require(0 < p.sparsity < 1, f"'pruning.sparsity' must be in (0, 1), got {p.sparsity}")
    if p.pattern != "unstructured":
        n, m = (int(v) for v in p.pattern.split(":"))
        _require(abs(p.sparsity - n / m) < 1e-9,
                 f"'pruning.sparsity' = {p.sparsity} contradicts 'pruning.pattern' = '{p.pattern}', which zeroes "
                 f"exactly {n / m:g} of the weights; set sparsity {n / m:g}")
        _require(p.blocksize % m == 0, f"'pruning.blocksize' = {p.blocksize} must be a multiple of {m} for "
                                       f"'pruning.pattern' = '{p.pattern}' (a group never straddles two blocks)")
    for key in ("nsamples", "seq_len", "batch_size", "blocksize"):
        _require(getattr(p, key) >= 1, f"'pruning.{key}' must be at least 1, got {getattr(p, key)}")
    _require(p.percdamp > 0, f"'pruning.percdamp' must be positive, got {p.percdamp}")
    if p.layer_ratios == "owl":
        _require(p.pattern == "unstructured", f"'pruning.layer_ratios' = 'owl' gives each layer its own sparsity, but "
                                              f"'pruning.pattern' = '{p.pattern}' zeroes exactly the same fraction of "
                                              "every layer; use pattern 'unstructured' or layer_ratios 'uniform'")
        _require(p.owl_m > 0, f"'pruning.owl_m' must be positive, got {p.owl_m}")
        low, high = p.sparsity - 2 * p.owl_lambda, p.sparsity + 2 * p.owl_lambda
        _require(p.owl_lambda > 0 and low >= 0 and high < 1,
                 f"'pruning.owl_lambda' = {p.owl_lambda} with 'pruning.sparsity' = {p.sparsity}: a layer's sparsity "
                 f"may lie anywhere in sparsity +- 2 x owl_lambda = [{low:g}, {high:g}], which must be within [0, 1) "
                 "(and owl_lambda positive)")


def check_sheared(cfg: JobConfig) -> None:
    s = cfg.sheared
    for kind, target in (("layer", "target_layers"), ("head", "target_heads"), ("hidden", "target_dim"),
                         ("intermediate", "target_intermediate")):
        sparsity = getattr(s, f"{kind}_sparsity")
        _require(0 <= sparsity < 1, f"'sheared.{kind}_sparsity' must be in [0, 1), got {sparsity}")
        _require(getattr(s, target) is None or sparsity == 0,
                 f"'sheared.{kind}_sparsity' = {sparsity} contradicts 'sheared.{target}' = {getattr(s, target)}: "
                 "give the target either as an architecture or as a sparsity")
    for key in ("target_layers", "target_heads", "target_kv_heads", "target_dim", "target_intermediate"):
        value = getattr(s, key)
        _require(value is None or value >= 1, f"'sheared.{key}' must be at least 1, got {value}")
    _require(s.target_kv_heads is None or s.head_mode == "kv_group",
             f"'sheared.target_kv_heads' = {s.target_kv_heads} needs 'sheared.head_mode' = 'kv_group' "
             "(per_group_query keeps every KV head)")
    _require(s.warmup_steps >= 0, f"'sheared.warmup_steps' must be at least 0, got {s.warmup_steps}")
    for key in ("mask_lr", "lambda_lr"):
        _require(getattr(s, key) > 0, f"'sheared.{key}' must be positive, got {getattr(s, key)}")
    _require(s.target_tp_degree >= 1, f"'sheared.target_tp_degree' must be at least 1, got {s.target_tp_degree}")


def check_distill(cfg: JobConfig) -> None:
    d = cfg.distill
    if not d.enable:
        return
    _require(bool(d.teacher_path), "'distill.enable' = true needs 'distill.teacher_path': a Hugging Face folder, a DCP "
                                   "step folder, or 'base' (the student's own frozen base)")
    _require(0 <= d.alpha <= 1, f"'distill.alpha' must be in (0, 1], got {d.alpha}")
    _require(d.alpha > 0, "'distill.alpha' = 0 weighs the teacher's KL term by 0: the run would load the teacher and "
                          "run it every step for nothing; set alpha in (0, 1], or drop 'distill.enable' to train on "
                          "cross entropy alone")
    _require(d.temperature > 0, f"'distill.temperature' must be positive, got {d.temperature}")
    _require(cfg.parallelism.pipeline_parallel_degree == 1,
             f"'distill.enable' does not run under pipeline parallelism ('parallelism.pipeline_parallel_degree' = "
             f"{cfg.parallelism.pipeline_parallel_degree}): the teacher's logits would have to follow the student's "
             "microbatches through the stages; use FSDP/HSDP, TP and CP")
    _require(not cfg.data_mixture.enable, "'distill.enable' cannot go with 'data_mixture.enable': the mixture weighs "
                                          "domains by their cross entropy, not by the distillation loss")


def check_preference(cfg: JobConfig) -> None:
    """[preference]: read only with training.dataset = 'preference'; its values, and what it cannot go with."""
    p, v = cfg.preference, cfg.validation
    if cfg.training.dataset != "preference":  # its settings while so: config/gates.py (read_when)
        _require(not (v.enable and v.dataset == "preference"),
                 "'validation.dataset' = 'preference' measures the preference loss, which needs "
                 f"'training.dataset' = 'preference' (got '{cfg.training.dataset}')")
        return
    _require(math.isfinite(p.beta) and p.beta > 0, f"'preference.beta' must be positive, got {p.beta}")
    _require(0 <= p.label_smoothing < 0.5, f"'preference.label_smoothing' must be in [0, 0.5), got {p.label_smoothing}")
    _require(p.label_smoothing == 0 or p.loss in ("sigmoid", "simpo"),
             f"'preference.label_smoothing' = {p.label_smoothing} applies to loss 'sigmoid' (cDPO, robust DPO) and "
             f"'simpo' only, not '{p.loss}'")
    _require(not p.robust or p.loss == "sigmoid", f"'preference.robust' = true is robust DPO: it needs loss 'sigmoid', "
                                                  f"not '{p.loss}'")
    _require(math.isfinite(p.simpo_gamma), f"'preference.simpo_gamma' must be a finite number, got {p.simpo_gamma}")
    _require(math.isfinite(p.sft_weight) and p.sft_weight >= 0,
             f"'preference.sft_weight' must be a number >= 0, got {p.sft_weight}")
    _require(not (p.loss == "orpo" and p.sft_weight > 0),
             f"'preference.sft_weight' = {p.sft_weight} with loss 'orpo': ORPO has its own NLL term on the chosen "
             "answers (weight 1; beta weighs the odds ratio); set sft_weight = 0")
    _require(bool(p.reference.strip()), "'preference.reference' must be 'base' (the policy with its adapters off) or "
                                        "a Hugging Face or DCP folder, got ''")
    _require(not (p.precompute_reference and p.loss in REFERENCE_FREE),
             f"'preference.precompute_reference' = true with loss '{p.loss}', which is reference-free: there is no "
             "reference to compute")
    _require(p.max_prompt_length >= 0, f"'preference.max_prompt_length' must be at least 0, got {p.max_prompt_length}")
    for section in ("training", "validation") if v.enable else ("training",):
        check_prompt_room(p.max_prompt_length, section, getattr(cfg, section).seq_len)
    _require(0 <= p.validation_fraction < 1,
             f"'preference.validation_fraction' must be in [0, 1), got {p.validation_fraction}")
    fields = {k: getattr(p, k) for k in ("prompt_field", "chosen_field", "rejected_field")}
    for key, name in fields.items():
        _require(bool(name.strip()), f"'preference.{key}' must name a field, got {name!r}")
        _require(list(fields.values()).count(name) == 1,
                 f"'preference.{key}' = {name!r} is also another preference field; the fields must differ")
    check_documents_dataset(cfg, "preference", "preference.validation_fraction", p.validation_fraction,
                            "validation measures the preference loss and rewards on held-out pairs",
                            "preference validation reports rewards and accuracies on held-out pairs",
                            "a pair's two answers")
    _require(p.packing or cfg.parallelism.context_parallel_degree == 1,
             "'preference.packing' = false with 'parallelism.context_parallel_degree' > 1: padded batches vary in "
             "length, packed ones are seq_len long; set preference.packing = true")
    par = cfg.parallelism
    _require(par.pipeline_parallel_degree == 1 or par.context_parallel_degree == 1,
             "'training.dataset' = 'preference' with both pipeline and context parallelism is not supported: the last "
             "stage's loss reads each pipeline microbatch's pairs whole; use one of them (with FSDP/TP)")
    _require(par.pipeline_parallel_degree == 1 or par.pipeline_parallel_schedule != "ZBVZeroBubble" or
             p.loss in REFERENCE_FREE,
             f"'parallelism.pipeline_parallel_schedule' = 'ZBVZeroBubble' with loss '{p.loss}': the reference runs as "
             "a forward-only pipeline pass, which torch's ZBV schedule has no mode for; use another schedule")
    _require(not cfg.distill.enable, "'distill.enable' cannot go with 'training.dataset' = 'preference': a run has one "
                                     "objective")
    _require(not cfg.data_mixture.enable, "'data_mixture.enable' cannot go with 'training.dataset' = 'preference': "
                                          "the mixture draws pre-training domains")


def check_prompt_room(max_prompt_length: int, section: str, seq_len: int) -> None:
    """A pair's two documents each hold the prompt, in seq_len + 1 tokens: a prompt kept at max_prompt_length must
    leave each answer at least one token, or every pair that is cut would be dropped instead."""
    most = (seq_len - 1) // 2
    _require(max_prompt_length <= most,
             f"'preference.max_prompt_length' = {max_prompt_length} leaves no room for the answers in a window of "
             f"'{section}.seq_len' + 1 = {seq_len + 1} tokens (a pair holds its prompt twice, once per answer): set "
             f"it to at most {most}, or 0 (a quarter of seq_len)")
def check_documents_dataset(cfg: JobConfig, dataset: str, fraction_key: str, fraction: float, measures: str,
                            reports: str, documents: str) -> None:
    """A dataset whose rows train as block-causal documents (preference pairs, RL's completions): validated on its
    own terms, from a held-out split or a file of its own, and block-causal attention."""
    v = cfg.validation
    if v.enable:
        _require(v.dataset == dataset, f"'validation.dataset' = '{v.dataset}' with 'training.dataset' = "
                                       f"'{dataset}': {measures}; set validation.dataset = '{dataset}'")
        _require(v.dataset_path is not None or fraction > 0,
                 f"'validation.dataset' = '{dataset}' without 'validation.dataset_path' needs '{fraction_key}' > 0 "
                 "(the held-out split)")
        _require(v.answer_problems == 0, f"'validation.answer_problems' needs instruction data; {reports}")
    _require(cfg.model.attn_mask_type != "causal",
             f"'training.dataset' = '{dataset}' packs {documents} as block-causal documents: "
             "'model.attn_mask_type' must be 'block_causal' (or unset), not 'causal'")


def check_grpo(cfg: JobConfig) -> None:
    """[grpo]: read only with training.dataset = 'prompts'; its values, and what online RL cannot go with."""
    g, v, par = cfg.grpo, cfg.validation, cfg.parallelism
    if cfg.training.dataset != "prompts":  # its settings while so: config/gates.py (read_when)
        _require(not (v.enable and v.dataset == "prompts"),
                 "'validation.dataset' = 'prompts' answers held-out prompts with [grpo]'s rewards, which needs "
                 f"'training.dataset' = 'prompts' (got '{cfg.training.dataset}')")
        return
    _require(g.num_generations >= 2, f"'grpo.num_generations' = {g.num_generations}: GRPO compares each completion "
                                     "with the others of its prompt's group, so it needs at least 2")
    _require(g.max_completion_length >= 1,
             f"'grpo.max_completion_length' must be at least 1, got {g.max_completion_length}")
    _require(g.max_completion_length < cfg.training.seq_len,
             f"'grpo.max_completion_length' = {g.max_completion_length} leaves no room for a prompt in "
             f"'training.seq_len' = {cfg.training.seq_len}: a prompt plus its completion must fit one sequence")
    _require(math.isfinite(g.temperature) and g.temperature > 0,
             f"'grpo.temperature' must be positive (rollouts sample), got {g.temperature}")
    _require(0 < g.top_p <= 1, f"'grpo.top_p' must be in (0, 1], got {g.top_p}")
    _require(g.logprobs != "sampled" or g.top_p < 1 or g.top_k > 0,
             "'grpo.logprobs' = 'sampled' has no effect: with 'grpo.top_p' = 1 and 'grpo.top_k' = 0 the sampled "
             "distribution is the full one; set top_p < 1 or top_k, or logprobs = 'full'")
    for key in ("top_k", "generation_batch_size", "length_penalty_buffer"):
        _at_least(cfg, f"grpo.{key}", 0)
    _at_least(cfg, "grpo.num_iterations", 1)
    _at_least(cfg, "grpo.stop_check_interval", 1)
    _require(0 <= g.epsilon < 1, f"'grpo.epsilon' must be in [0, 1), got {g.epsilon}")
    _require(g.epsilon_high is None or g.epsilon_high >= 0,
             f"'grpo.epsilon_high' must be at least 0, got {g.epsilon_high}")
    _require(math.isfinite(g.beta) and g.beta >= 0, f"'grpo.beta' must be a number >= 0, got {g.beta}")
    check_grpo_rewards(cfg)
    _require(not (g.beta == 0 and (g.reference != "base" or g.reference_flavor or g.reference_config)),
             f"'grpo.reference' = {g.reference!r} has no effect: 'grpo.beta' = 0 has no KL term (no reference is "
             "loaded); set --grpo.beta or drop the reference settings")
    _require(bool(g.reference.strip()), "'grpo.reference' must be 'base' (the policy with its adapters off) or a "
                                        "Hugging Face or DCP folder, got ''")
    _require(0 <= g.validation_fraction < 1, f"'grpo.validation_fraction' must be in [0, 1), got "
                                             f"{g.validation_fraction}")
    _require("{prompt}" in g.template, f"'grpo.template' = {g.template!r} has no {{prompt}} placeholder")
    _require(bool(g.prompt_field.strip()), f"'grpo.prompt_field' must name a field, got {g.prompt_field!r}")
    check_documents_dataset(cfg, "prompts", "grpo.validation_fraction", g.validation_fraction,
                            "validation answers held-out prompts and reports their rewards",
                            "prompts validation answers every held-out prompt (validation.steps batches of them)",
                            "prompt + completion sequences")
    _require(par.pipeline_parallel_degree == 1,
             f"'training.dataset' = 'prompts' does not run under pipeline parallelism ('parallelism."
             f"pipeline_parallel_degree' = {par.pipeline_parallel_degree}): rollouts decode one token at a time "
             "through every layer, which would cross every stage in turn with no schedule for it; use FSDP/HSDP, TP "
             "and CP")
    _require(cfg.training.epochs is None, "'training.epochs' with 'training.dataset' = 'prompts': a step answers "
                                          "global_batch_size / grpo.num_generations prompts; set training.steps")
    for other, on in (("distill.enable", cfg.distill.enable), ("data_mixture.enable", cfg.data_mixture.enable)):
        _require(not on, f"'{other}' cannot go with 'training.dataset' = 'prompts': a run has one objective and one "
                         "source of data")


def check_grpo_rewards(cfg: JobConfig) -> None:
    """The reward functions' settings: known names, weights one per function, each built-in's own key set only
    when that built-in is used."""
    g = cfg.grpo
    _require(bool(g.reward_funcs), "'grpo.reward_funcs' is empty: name at least one reward function (answer_match, "
                                   "format, length_penalty or 'module.path:function')")
    _require(len(set(g.reward_funcs)) == len(g.reward_funcs), f"'grpo.reward_funcs' = {g.reward_funcs} repeats a "
                                                              "function (weigh it with reward_weights instead)")
    _require(not g.reward_weights or len(g.reward_weights) == len(g.reward_funcs),
             f"'grpo.reward_weights' has {len(g.reward_weights)} weights but 'grpo.reward_funcs' has "
             f"{len(g.reward_funcs)} functions; give one weight per function (or none)")
    for i, w in enumerate(g.reward_weights):
        _require(math.isfinite(w), f"'grpo.reward_weights[{i}]' = {w} must be a finite number")
    for name, key, changed in (("format", "format_pattern", bool(g.format_pattern)),
                               ("length_penalty", "length_penalty_buffer", g.length_penalty_buffer != 0)):
        _require(name in g.reward_funcs or not changed,
                 f"'grpo.{key}' has no effect: it configures the '{name}' reward, which 'grpo.reward_funcs' = "
                 f"{g.reward_funcs} does not list; add it or drop the setting")
    _require("format" not in g.reward_funcs or bool(g.format_pattern),
             "'grpo.reward_funcs' has 'format' but 'grpo.format_pattern' is empty: set the regular expression a "
             "completion must match")
    if g.format_pattern:
        try:
            re.compile(g.format_pattern)
        except re.error as exc:
            raise ConfigError(f"'grpo.format_pattern' = {g.format_pattern!r} is not a regular expression: {exc}") \
                from None
    _require("length_penalty" not in g.reward_funcs or 0 < g.length_penalty_buffer <= g.max_completion_length,
             f"'grpo.reward_funcs' has 'length_penalty': 'grpo.length_penalty_buffer' must be in [1, "
             f"max_completion_length = {g.max_completion_length}], got {g.length_penalty_buffer}")


def check_checkpoint(cfg: JobConfig) -> None:
    c = cfg.checkpoint
    _at_least(cfg, "checkpoint.interval", 1)
    _at_least(cfg, "checkpoint.keep_latest_k", 0)
    allowed = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng"}
    for key in c.exclude_from_loading:
        _require(key in allowed,
                 f"'checkpoint.exclude_from_loading' has '{key}'; expected some of: {', '.join(sorted(allowed))}")
    if c.create_seed_checkpoint:
        _require(c.enable, "'checkpoint.create_seed_checkpoint' = true needs 'checkpoint.enable' = true")
        _require(not c.load_only,
                 "'checkpoint.create_seed_checkpoint' = true contradicts 'checkpoint.load_only' = true")


def _require_data(key: str, path: str) -> None:
    """A data path exists; when it does not but an interrupted scripts/tokenize_data.py run left its partial folder
    beside it, say how to finish it."""
    partial = partial_folder(path)
    hint = (f" (an interrupted scripts/tokenize_data.py run left {quote_path(partial)}: run the same command again "
            "to finish it)") if partial.is_dir() else ""
    _require(Path(path).exists(), f"'{key}' = {quote_path(path)} does not exist{hint}")


def check_paths(cfg: JobConfig) -> None:
    t = cfg.training
    if t.dataset_path is not None:
        _require_data("training.dataset_path", t.dataset_path)
    if cfg.validation.enable and cfg.validation.dataset_path is not None:
        _require_data("validation.dataset_path", cfg.validation.dataset_path)
    if cfg.data_mixture.enable:
        for i, path in enumerate(cfg.data_mixture.dataset_paths):
            _require_data(f"data_mixture.dataset_paths[{i}]", path)
    if cfg.pruning.dataset_path is not None:
        _require(Path(cfg.pruning.dataset_path).exists(),
                 f"'pruning.dataset_path' = {quote_path(cfg.pruning.dataset_path)} does not exist")
    if cfg.checkpoint.initial_load_path is not None:
        _require(Path(cfg.checkpoint.initial_load_path).exists(),
                 f"'checkpoint.initial_load_path' = {quote_path(cfg.checkpoint.initial_load_path)} does not exist")


def validate(cfg: JobConfig, files: bool = True) -> None:
    """Every value check that needs neither the world size nor the model; `files` also checks that the paths it
    names exist (DRY_RUN lists missing files instead)."""
    check_choices_and_unsupported(cfg)
    check_ranges(cfg)
    check_switched_off(cfg)
    if files:
        check_paths(cfg)
