"""Distillation as the training objective ([distill]): a frozen teacher, assembled by the same job plan and mesh as the
student (or the student's own base with its adapters switched off), whose logits on the same inputs train the student
through the chunked loss of kd.py; its checks before launch and its lines and memory in DRY_RUN's plan."""

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from titan_lite.checkpoint.manager import check_source_before_launch
from titan_lite.config import parse_args
from titan_lite.config.schema import ActivationCheckpoint, Checkpoint, Distill, JobConfig
from titan_lite.data.tokenizer import Tokenizer, build_tokenizer
from titan_lite.distributed import compute_dtype, device_type
from titan_lite.errors import ConfigError, quote_path
from titan_lite.job.assembly import assemble_model, build_parts, initial_weight_loader
from titan_lite.job.estimate import compute_bytes, data_parallel_units, local_numel, microbatching
from titan_lite.job.plan import HF_FLAVOR, JobPlan, check_initial_weights, plan_with_tokenizer, tokenizer_path
from titan_lite.job.script import model_flavor
from titan_lite.loss import Objective, cross_entropy_sum
from titan_lite.models.llama.args import flavor_args
from titan_lite.objective import kd
from titan_lite.objective.kd import DistillLoss, distill_loss_sum
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms import PlanItem

logger = logging.getLogger("titan_lite")
SELF_TEACHER = "base"
# Text whose ids two tokenizers must agree on to count as the same (words, digits, accents, CJK, spaces).
TOKENIZER_PROBE = "To be, or not to be: 1234 caf\u00e9 \u6771\u4eac  distillation\n\tThe END."


def self_teacher(cfg: JobConfig) -> bool:
    return cfg.distill.teacher_path == SELF_TEACHER


# ------------------------------------------------------------------------------------------ the teacher's job


def is_dcp_folder(path: Path) -> bool:
    return (path / ".metadata").is_file()


def teacher_config(cfg: JobConfig, device_type: str) -> JobConfig:
    """The teacher's job config: the student's with the teacher's model (no transforms), weights loaded from
    teacher_path, parameters stored in the compute dtype of `device_type`, resharded after every forward, nothing
    checkpointed."""
    d, t = cfg.distill, copy.deepcopy(cfg)
    path = Path(d.teacher_path)
    check_teacher_flavor(d)
    if is_dcp_folder(path):
        run = run_config_of(d, path)
        t.model.flavor = d.teacher_flavor or run.model.flavor
        t.model.hf_assets_path, t.model.tokenizer_path = run.model.hf_assets_path, run.model.tokenizer_path
        t.checkpoint = Checkpoint(initial_load_path=str(path))
    else:
        if not d.teacher_flavor and not path.exists():
            raise ConfigError(f"'distill.teacher_path' = {quote_path(path)} does not exist (to plan with DRY_RUN "
                              "before the teacher is downloaded, set 'distill.teacher_flavor')")
        if not d.teacher_flavor and not (path / "config.json").is_file():
            raise ConfigError(f"'distill.teacher_path' = '{path}' has no config.json, so the teacher's shape is "
                              "unknown: name its flavor in 'distill.teacher_flavor'")
        t.model.flavor = d.teacher_flavor or model_flavor(str(path), None)
        t.model.hf_assets_path, t.model.tokenizer_path = str(path), None
        t.checkpoint = Checkpoint(initial_load_path=str(path), initial_load_in_hf=True)
    t.model.converters, t.model.print_after_conversion = [], False
    t.activation_checkpoint = ActivationCheckpoint(mode="none")
    t.parallelism.fsdp_reshard_after_forward = "always"
    dtype = compute_dtype(cfg.training.mixed_precision_param, device_type)
    t.training.dtype = str(dtype).removeprefix("torch.")
    t.validation.enable = False
    t.distill = Distill()
    return t


def check_teacher_flavor(d: Distill) -> None:
    """distill.teacher_flavor, when set, is a known flavor (or 'hf'): its typo is named as this key."""
    if d.teacher_flavor and d.teacher_flavor != HF_FLAVOR:
        try:
            flavor_args(d.teacher_flavor)
        except KeyError as exc:
            raise ConfigError(f"'distill.teacher_flavor': {exc.args[0]} (or 'hf': the shape of "
                              "distill.teacher_path/config.json)") from None


def run_config_of(d: Distill, step_folder: Path) -> JobConfig:
    """The config of the run that wrote a DCP teacher: teacher_config, or the config.toml its run saved."""
    toml = Path(d.teacher_config) if d.teacher_config else step_folder.parent.parent / "config.toml"
    if not toml.is_file():
        raise ConfigError(f"'distill.teacher_path' = '{step_folder}' is a DCP checkpoint, but its run's config "
                          f"'{toml}' does not exist; set 'distill.teacher_config' to the TOML of the run that wrote it")
    run = parse_args(["--job.config_file", str(toml)])
    if run.model.converters:
        raise ConfigError(f"'distill.teacher_config' = '{toml}' has model.converters = {run.model.converters}: a DCP "
                          "teacher must be a plain model; export the run to a Hugging Face folder "
                          "(checkpoint.last_save_in_hf) and name that folder in 'distill.teacher_path'")
    return run


def teacher_plan(plan: JobPlan, device_type: str) -> JobPlan:
    """The teacher's job plan on the student's layout (the same ParallelDims, so the same mesh), its vocabulary and
    tokenizer checked against the student's."""
    tcfg = teacher_config(plan.cfg, device_type)
    tokenizer = plan.tokenizer
    if tokenizer is not None:
        check_same_tokenizer(tokenizer, tcfg, plan.cfg)
    tplan = plan_with_tokenizer(tcfg, plan.parallel_dims.world_size, tokenizer, count_epochs=False)
    if tplan.model_args.vocab_size != plan.model_args.vocab_size:
        raise ConfigError(f"the teacher '{plan.cfg.distill.teacher_path}' has a vocabulary of "
                          f"{tplan.model_args.vocab_size:,} tokens but the student ('model.flavor' = "
                          f"'{plan.cfg.model.flavor}') has {plan.model_args.vocab_size:,}: distillation compares "
                          "their logits token by token, so both need the same tokenizer and vocabulary")
    return replace(tplan, parallel_dims=plan.parallel_dims)


def check_same_tokenizer(student: Tokenizer, tcfg: JobConfig, cfg: JobConfig) -> None:
    """The teacher's tokenizer (when its folder has one) gives the student's ids: one line otherwise."""
    if tokenizer_path(tcfg) == tokenizer_path(cfg):
        return
    try:
        teacher = build_tokenizer(tokenizer_path(tcfg))
    except ConfigError:
        return  # a folder of weights only: the vocabulary sizes are compared instead
    same = teacher.vocab_size == student.vocab_size and \
        teacher.encode(TOKENIZER_PROBE, bos=True, eos=True) == student.encode(TOKENIZER_PROBE, bos=True, eos=True)
    if not same:
        raise ConfigError(f"the teacher's tokenizer in '{tokenizer_path(tcfg)}' ({teacher.vocab_size:,} tokens) is not "
                          f"the student's in '{tokenizer_path(cfg)}' ({student.vocab_size:,} tokens): distillation "
                          "needs one tokenizer, so that a token id means the same token to both")


def check_objective(plan: JobPlan) -> None:
    """Before launch: the teacher is usable (its files, shapes, vocabulary, tokenizer), or the self-teacher has a
    transform that keeps a base apart from what trains."""
    cfg = plan.cfg
    if not cfg.distill.enable:
        return
    if self_teacher(cfg):
        if plan.transforms.base_function([]) is None:
            raise ConfigError(f"'distill.teacher_path' = '{SELF_TEACHER}' runs the student's frozen base as the "
                              f"teacher, but no transform of 'model.converters' = {cfg.model.converters} keeps a base "
                              "apart from what it trains (adapters do); name a teacher folder instead")
        if cfg.distill.alpha == 1:
            raise ConfigError(f"'distill.teacher_path' = '{SELF_TEACHER}' with 'distill.alpha' = 1: the student starts "
                              "as its own base, so the KL and its gradient are zero and nothing would train; set "
                              "alpha below 1 (the KL then keeps the fine-tuned model near its base)")
        return
    if not Path(cfg.distill.teacher_path).exists():
        raise ConfigError(f"'distill.teacher_path' = {quote_path(cfg.distill.teacher_path)} does not exist (a Hugging "
                          f"Face folder, a DCP step folder of a titan_lite run, or '{SELF_TEACHER}')")
    tplan = teacher_plan(plan, device_type())
    check_initial_weights(tplan.cfg)
    check_source_before_launch(tplan.cfg, tplan.model_args)


def teacher_files_problem(cfg: JobConfig) -> str | None:
    """DRY_RUN's checklist line for a teacher not downloaded yet (the plan still prints from its flavor), or None."""
    if not cfg.distill.enable or self_teacher(cfg):
        return None
    path = Path(cfg.distill.teacher_path)
    if is_dcp_folder(path) or (path / "config.json").is_file():
        try:
            check_initial_weights(teacher_config(cfg, cfg.dry_run.device_type))
        except ConfigError as exc:
            return str(exc)
        return None
    return f"'distill.teacher_path' = '{path}': no Hugging Face folder or DCP checkpoint there (the teacher's weights)"


# ------------------------------------------------------------------------------------------ the objective


class DistillObjective(Objective):
    """alpha T^2 KL(teacher || student) (or reverse) + (1 - alpha) CE on the trained tokens. The teacher runs first,
    under no_grad, through the runner's forward; the KL and CE sums of the step are logged separately."""

    def __init__(self, loss_fn: Callable, spec: DistillLoss, teacher: Callable):
        super().__init__(loss_fn)
        self.spec = spec
        self.teacher = teacher  # (forward) -> logits
        self.parts: torch.Tensor | None = None  # this rank's [KL sum, CE sum] since the last step_metrics

    def teacher_logits(self, forward: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return self.teacher(forward)

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor,
                 teacher_logits: torch.Tensor | None = None) -> torch.Tensor:
        loss, parts = distill_loss_sum(logits, teacher_logits, labels, self.spec)
        parts = parts.double()
        self.parts = parts if self.parts is None else self.parts + parts
        return loss

    def step_metrics(self, global_sum: Callable[[torch.Tensor], torch.Tensor],
                     global_tokens: torch.Tensor) -> dict[str, float]:
        """The step's KL (at the temperature, before T^2 and alpha) and cross entropy per trained token."""
        parts, self.parts = self.parts, None
        kl, ce = (global_sum(parts) / global_tokens).tolist()
        return {"distill/kl": kl, "distill/ce": ce}


def separate_teacher(parts: list[nn.Module]) -> Callable:
    return lambda forward: forward(parts[0])


def base_teacher(plan: JobPlan, student_parts: list[nn.Module]) -> Callable:
    """The student's own model computing its base function (the transforms switch off what they train)."""
    def run(forward: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
        with plan.transforms.base_function(student_parts):
            return forward(student_parts[0])
    return run


def build_objective(plan: JobPlan, student_parts: list[nn.Module], device: torch.device, seed: int,
                    loss_fn: Callable) -> Objective:
    """Cross entropy, or distillation with its teacher assembled here (loaded, frozen)."""
    d = plan.cfg.distill
    if not d.enable:
        return Objective(loss_fn)
    spec = DistillLoss(d.alpha, d.temperature, d.kind)
    what = f"alpha {d.alpha:g}, temperature {d.temperature:g}, {d.kind} KL"
    if self_teacher(plan.cfg):
        logger.info(f"distill: the teacher is the student's own base, its adapters switched off ({what})")
        return DistillObjective(loss_fn, spec, base_teacher(plan, student_parts))
    tplan = teacher_plan(plan, device.type)
    built = assemble_model(tplan, device, seed=seed, load=initial_weight_loader(tplan))
    for part in built.parts:
        part.requires_grad_(False)
        part.eval()
    logger.info(f"distill: teacher {tplan.cfg.model.flavor} from '{d.teacher_path}', {tplan.full_param_count():,} "
                f"parameters ({built.param_count():,} held by this rank, {tplan.cfg.training.dtype}, frozen) "
                f"({what})")
    return DistillObjective(loss_fn, spec, separate_teacher(built.parts))


# ------------------------------------------------------------------------------------------ DRY_RUN


@dataclass
class ObjectivePlan:
    """What DRY_RUN prints and counts for the objective: the teacher's plan (None for the self-teacher)."""

    plan: JobPlan
    teacher: JobPlan | None

    def lines(self) -> list[str]:
        d = self.plan.cfg.distill
        what = f"alpha {d.alpha:g}, temperature {d.temperature:g}, {d.kind} KL"
        if self.teacher is None:
            return [f"distill: self-teacher (the student's base, adapters off; no second copy), {what}"]
        t = self.teacher
        return [f"distill: teacher {t.cfg.model.flavor} from '{d.teacher_path}', {t.full_param_count():,} "
                f"parameters in {t.cfg.training.dtype}, frozen (no gradients or optimizer state), sharded like the "
                f"student; {what}"]

    def memory(self, cfg: JobConfig, dims: ParallelDims) -> list[PlanItem]:
        """One rank's extra bytes (`dims`: that rank's layout): the teacher's weights and its FSDP all-gathers, the
        teacher's logits alive through the student's forward, and the loss's float32 blocks."""
        c = compute_bytes(cfg)[0]
        items = self.teacher_items(dims, c) if self.teacher is not None else []
        microbatch, _ = microbatching(cfg, dims)
        tokens = microbatch * cfg.training.seq_len // dims.cp
        vocab = self.plan.model_args.vocab_size
        sharded = dims.tp > 1 and not cfg.parallelism.disable_loss_parallel
        local_vocab = -(-vocab // dims.tp) if sharded else vocab
        items.append(PlanItem("activations", tokens * local_vocab * c,
                              f"teacher logits {tokens:,} x {local_vocab:,} (the loss writes the gradient into them)"))
        chunk = kd._CHUNK_ELEMENTS if cfg.dry_run.device_type == "cpu" else kd._ACCELERATOR_CHUNK_ELEMENTS
        items.append(PlanItem("buffers", 6 * chunk * 4, "distillation loss: six float32 row blocks"))
        return items

    def teacher_items(self, dims: ParallelDims, c: int) -> list[PlanItem]:
        """The teacher's weights on this rank (built on the meta device as the run builds them) and, under FSDP, its
        two largest all-gathered groups."""
        tcfg = copy.deepcopy(self.teacher.cfg)
        tcfg.compile.enable = False  # compile is lazy: wrapping plans nothing more
        parts, _ = build_parts(replace(self.teacher, cfg=tcfg, parallel_dims=dims), torch.device("cpu"),
                               cross_entropy_sum)
        params = [p for part in parts for p in part.parameters()]
        local = sum(local_numel(p) for p in params)
        items = [PlanItem("parameters", sum(local_numel(p) * p.element_size() for p in params),
                          f"teacher {local:,} local x {tcfg.training.dtype} (frozen)")]
        if dims.fsdp_enabled or dims.dp_replicate_enabled:
            units = sorted(data_parallel_units(tcfg, dims, parts, None), key=lambda u: u.unsharded_numel)
            items.append(PlanItem("buffers", sum(u.unsharded_numel for u in units[-2:]) * c,
                                  "teacher: 2 all-gathered groups during its forward"))
        return items


def plan_objective(plan: JobPlan) -> ObjectivePlan | None:
    """The objective's DRY_RUN plan (the teacher from its folder, or from teacher_flavor when not there yet)."""
    cfg = plan.cfg
    if not cfg.distill.enable:
        return None
    if self_teacher(cfg):
        check_objective(plan)
        return ObjectivePlan(plan, None)
    there = teacher_files_problem(cfg) is None
    teacher = teacher_plan(plan if there else replace(plan, tokenizer=None), cfg.dry_run.device_type)
    return ObjectivePlan(plan, teacher)
