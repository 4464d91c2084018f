"""Pipeline parallelism: splits a meta Llama into stages, places them on the pp ranks and builds the schedule."""

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError
from titan_lite.models.decoder import Llama
from titan_lite.models.parts.moe import MoE
from titan_lite.parallel.parallel_dims import ParallelDims

# torch.distributed.pipelining imports torch._dynamo (about a second): only the schedule needs it, so it is imported
# where the stages and the schedule are built (DRY_RUN splits the model into stages without them).
if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineSchedule

# Schedules that run several (virtual) stages per rank; by default they get two stages per rank.
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
# Stages placed in a V: rank r holds stages r and (2 x pp - 1 - r), so the first and last stage share rank 0.
V_STYLE_SCHEDULES = ("ZBVZeroBubble",)
# Schedules whose torch implementation needs at least as many microbatches as there are stages.
NEED_MICROBATCHES_PER_STAGE = ("1F1B", "ZBVZeroBubble")


# ------------------------------------------------------------------------------ the layer split


def virtual_stage_count(pp: int, schedule: str, n_layers: int, first_less: int, last_less: int,
                        layers_per_stage: int | None = None) -> int:
    """Stages over the whole pipeline: fixed by layers_per_stage when set, else pp x (2 if multi-stage else 1)."""
    stages_per_rank = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
    if layers_per_stage is None:
        return pp * stages_per_rank
    if layers_per_stage < 1:
        raise ConfigError(f"'parallelism.pipeline_parallel_layers_per_stage' must be at least 1, "
                          f"got {layers_per_stage}")
    units = n_layers + first_less + last_less
    if units % layers_per_stage:
        raise ConfigError(
            f"'parallelism.pipeline_parallel_layers_per_stage' = {layers_per_stage} does not divide the layers: "
            f"{n_layers} layers + first_stage_less_layers {first_less} + last_stage_less_layers {last_less} = {units}, "
            f"and {units} % {layers_per_stage} = {units % layers_per_stage}")
    num_stages = units // layers_per_stage
    check_stage_count_fits(num_stages, pp, schedule, f"{units} / layers_per_stage {layers_per_stage}")
    return num_stages


def check_stage_count_fits(num_stages: int, pp: int, schedule: str, arithmetic: str) -> None:
    """The number of stages must spread evenly over the ranks and suit the schedule."""
    if num_stages % pp:
        raise ConfigError(f"pipeline stages {arithmetic} = {num_stages} do not divide evenly over "
                          f"'parallelism.pipeline_parallel_degree' {pp}")
    per_rank = num_stages // pp
    if schedule not in MULTI_STAGE_SCHEDULES and per_rank != 1:
        raise ConfigError(f"'parallelism.pipeline_parallel_schedule' = '{schedule}' runs one stage per rank, but "
                          f"{arithmetic} = {num_stages} stages over pp {pp} is {per_rank} per rank; use a multi-stage "
                          f"schedule ({', '.join(MULTI_STAGE_SCHEDULES)}) or change pipeline_parallel_layers_per_stage")
    if schedule in V_STYLE_SCHEDULES and per_rank != 2:
        raise ConfigError(f"'parallelism.pipeline_parallel_schedule' = '{schedule}' needs exactly 2 stages per rank, "
                          f"but {arithmetic} = {num_stages} stages over pp {pp} is {per_rank} per rank")


def stage_unit_counts(units: int, num_stages: int, layers_per_stage: int | None) -> list[int]:
    """How many units (transformer layers, embedding, output) each stage carries.

    An uneven remainder goes one unit each to the inner stages (1, 2, ...) and then to the last stage, since
    the first and last stages already carry the embedding and output head.
    """
    if layers_per_stage is not None:
        return [layers_per_stage] * num_stages
    base, extra = divmod(units, num_stages)
    order = list(range(1, num_stages - 1)) + [num_stages - 1]
    counts = [base] * num_stages
    for stage in order[:extra]:
        counts[stage] += 1
    return counts


def split_layers(n_layers: int, num_stages: int, first_less: int = 1, last_less: int = 1,
                 layers_per_stage: int | None = None) -> list[list[int]]:
    """The global transformer-layer ids held by each stage, in order.

    The embedding counts as first_less layers on the first stage and the output head as last_less layers on
    the last stage; every stage must hold something and no stage can hold fewer than zero layers.
    """
    if first_less < 0 or last_less < 0:
        raise ConfigError(f"'parallelism.pipeline_parallel_first_stage_less_layers' ({first_less}) and "
                          f"'last_stage_less_layers' ({last_less}) must be at least 0")
    units = n_layers + first_less + last_less
    if units < num_stages:
        raise ConfigError(f"{n_layers} layers + first_stage_less_layers {first_less} + last_stage_less_layers "
                          f"{last_less} = {units} cannot fill {num_stages} pipeline stages (one layer each at least)")
    counts = stage_unit_counts(units, num_stages, layers_per_stage)
    layer_counts = list(counts)
    layer_counts[0] -= first_less
    layer_counts[-1] -= last_less
    for stage, count in ((0, layer_counts[0]), (num_stages - 1, layer_counts[-1])):
        if count < 0:
            raise ConfigError(
                f"pipeline stage {stage} would hold {count} transformer layers: {units} units "
                f"({n_layers} layers + first_stage_less_layers {first_less} + last_stage_less_layers {last_less}) "
                f"over {num_stages} stages is {counts[stage]} for that stage, less than its "
                f"{'first' if stage == 0 else 'last'}_stage_less_layers; lower it or use fewer stages")
    bounds = [0]
    for count in layer_counts:
        bounds.append(bounds[-1] + count)
    return [list(range(bounds[i], bounds[i + 1])) for i in range(num_stages)]


# ------------------------------------------------------------------------------ stages on ranks


def stage_to_rank(num_stages: int, pp: int, v_style: bool) -> list[int]:
    """The pp rank of every stage: a loop (stage s on rank s % pp) or a V (down the ranks, then back up)."""
    if not v_style:
        return [s % pp for s in range(num_stages)]
    ranks = []
    for s in range(num_stages):
        lap, pos = divmod(s, pp)
        ranks.append(pos if lap % 2 == 0 else pp - 1 - pos)
    return ranks


def stages_of_rank(rank: int, num_stages: int, pp: int, v_style: bool) -> list[int]:
    return [s for s, r in enumerate(stage_to_rank(num_stages, pp, v_style)) if r == rank]


def prune_to_stage(model: Llama, layer_ids: list[int], is_first: bool, is_last: bool) -> Llama:
    """A deep copy of the (meta) model holding only this stage's layers and, where it owns them, the ends; only
    those are copied (the model is cut down for the copy and restored after it)."""
    keep = {str(i) for i in layer_ids}
    held = {"layers": nn.ModuleDict({name: layer for name, layer in model.layers.items() if name in keep}),
            "tok_embeddings": model.tok_embeddings if is_first else None,
            "norm": model.norm if is_last else None, "output": model.output if is_last else None}
    whole = {name: getattr(model, name) for name in held}
    try:
        for name, module in held.items():
            setattr(model, name, module)
        return copy.deepcopy(model)
    finally:
        for name, module in whole.items():
            setattr(model, name, module)


# ------------------------------------------------------------------------------ microbatches


def microbatch_count(local_batch_size: int, microbatch_size: int, schedule: str, num_stages: int, pp: int,
                     batch_key: str = "training.local_batch_size") -> int:
    """local_batch_size / pipeline_parallel_microbatch_size, checked against what the schedule can run."""
    if local_batch_size % microbatch_size:
        raise ConfigError(f"'{batch_key}' {local_batch_size} is not a multiple of "
                          f"'parallelism.pipeline_parallel_microbatch_size' {microbatch_size}")
    n = local_batch_size // microbatch_size
    if schedule in NEED_MICROBATCHES_PER_STAGE and n < num_stages:
        raise ConfigError(f"'parallelism.pipeline_parallel_schedule' = '{schedule}' needs at least as many "
                          f"microbatches "
                          f"as stages ({num_stages}), but '{batch_key}' {local_batch_size} / microbatch_size "
                          f"{microbatch_size} = {n}; raise the batch size or lower the microbatch size")
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n // pp)
        if n % rounds:
            raise ConfigError(f"'parallelism.pipeline_parallel_schedule' = '{schedule}' runs microbatches in rounds of "
                              f"pp {pp}: {n} microbatches ('{batch_key}' {local_batch_size} / microbatch_size "
                              f"{microbatch_size}) must be at most {pp} or a multiple of {n // pp} rounds")
    return n


# ------------------------------------------------------------------------------ the schedule


def build_schedule(schedule: str, stages: "list[PipelineStage]", n_microbatches: int,
                   loss_fn: Callable | None) -> "_PipelineSchedule":
    """The torch schedule over this rank's stages.

    scale_grads=False: the loss function already carries the 1 / global-token factor, so the per-microbatch
    gradients sum to exactly the single-process gradient; torch's default would divide again by n_microbatches.
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class  # see the top

    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        assert len(stages) == 1, f"{schedule} runs one stage per rank, got {len(stages)}"
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


def schedule_stages(schedule: "_PipelineSchedule") -> "list[PipelineStage]":
    """The stages a schedule runs on this rank."""
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def validation_microbatch_count(cfg: JobConfig, num_stages: int) -> int:
    p = cfg.parallelism
    return microbatch_count(cfg.validation.local_batch_size, p.pipeline_parallel_microbatch_size,
                            p.pipeline_parallel_schedule, num_stages, p.pipeline_parallel_degree,
                            batch_key="validation.local_batch_size")


# A loss over a target of its own: loss(output, target microbatch) -> (token-loss sum, a part the caller collects).
TargetLoss = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]


class PipelineRunner:
    """This rank's pipeline schedule, run on whole local batches: a training step (forward and backward over the
    microbatches) or a forward-only evaluation; both return the sum of the batch's token losses (zero on ranks
    without the last stage). A run may compute another loss over a target of its own (data mixtures' per-domain
    sums, preference tuning's pairs): each real microbatch's part is then in `last_parts` (on the last stage)."""

    def __init__(self, cfg: JobConfig, loss_fn: Callable):
        self.cfg = cfg
        self.loss_fn = loss_fn
        self.schedule: _PipelineSchedule | None = None
        self._eval_schedules: dict[int, _PipelineSchedule] = {}
        self._scale: torch.Tensor | None = None
        self._loss_sums: list[torch.Tensor] = []
        self._target_loss: TargetLoss | None = None
        self._parts: list[Any] = []
        self.last_parts: list[Any] = []
        self._trained = False

    def attach(self, schedule: "_PipelineSchedule") -> None:
        self.schedule = schedule
        stages = schedule_stages(schedule)
        # With V-style schedules one rank holds both the first and the last stage.
        self.has_first_stage = any(stage.is_first for stage in stages)
        self.has_last_stage = any(stage.is_last for stage in stages)

    def scaled_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss a schedule backpropagates: the microbatch's token-loss sum times the step's scale."""
        if self._target_loss is None:
            loss_sum = self.loss_fn(output, labels)
        else:
            loss_sum, part = self._target_loss(output, labels)
            self._parts.append(part)
        self._loss_sums.append(loss_sum.detach())
        return loss_sum * self._scale

    def step(self, inputs: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, domains: torch.Tensor | None = None,
             domain_sums: torch.Tensor | None = None, domain_loss: Callable | None = None,
             extra: dict[str, torch.Tensor] | None = None, target_loss: TargetLoss | None = None) -> torch.Tensor:
        """Forward and backward of one local batch through the stages; gradients accumulate in the parts. With
        domains, domain_loss(output, labels, domains, sums) is the loss and the last stage adds the real
        microbatches' per-domain sums to domain_sums (see ModelRunner.forward_backward). With target_loss, `labels`
        is its target ([batch, ...], cut into microbatches) and it is the loss. `extra`: the forward's keyword
        inputs besides the token ids ([batch, ...] tensors), cut into microbatches for every stage."""
        first, self._trained = not self._trained, True
        try:
            return self._step(inputs, labels, scale, domains, domain_sums, domain_loss, extra, target_loss)
        finally:
            if first:  # the schedule's first run inferred shapes with one extra forward per stage
                for stage in schedule_stages(self.schedule):
                    for module in stage.submod.modules():
                        if isinstance(module, MoE):
                            module.discard_first_forward()

    def _step(self, inputs: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, domains: torch.Tensor | None,
              domain_sums: torch.Tensor | None, domain_loss: Callable | None,
              extra: dict[str, torch.Tensor] | None, target_loss: "TargetLoss | None") -> torch.Tensor:
        if domains is None:
            return self._run(self.schedule.step, inputs, labels, scale, extra, target_loss)

        def per_domain(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            part = torch.zeros_like(domain_sums)  # the targets carry the domain ids as a last column
            return domain_loss(output, target[:, :-1], target[:, -1], part), part
        loss_sum = self._run(self.schedule.step, inputs, torch.cat([labels, domains[:, None]], dim=1), scale, extra,
                             per_domain)
        for part in self.last_parts:
            domain_sums += part
        return loss_sum

    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor, extra: dict[str, torch.Tensor] | None = None,
                 target_loss: TargetLoss | None = None) -> torch.Tensor:
        """Forward only, through a twin schedule sized for batches of this many rows."""
        return self._run(self.eval_schedule(inputs.shape[0]).eval, inputs, labels,
                         torch.ones((), device=inputs.device), extra, target_loss)

    def _run(self, run: Callable, inputs: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor,
             extra: dict[str, torch.Tensor] | None = None, target_loss: TargetLoss | None = None) -> torch.Tensor:
        self._scale, self._loss_sums, self._target_loss, self._parts = scale, [], target_loss, []
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first_stage else ()
        kwargs = {"target": labels, "losses": losses} if self.has_last_stage else {}
        try:
            run(*args, return_outputs=False, **kwargs, **(extra or {}))
        finally:
            self._target_loss = None
        # A schedule's first run also calls the loss once on placeholder activations to infer shapes (its value is
        # garbage); the real microbatches are the last len(losses) calls.
        real = len(losses) if self.has_last_stage else 0
        self.last_parts = self._parts[len(self._parts) - real:] if real else []
        if not self.has_last_stage:
            return torch.zeros((), device=inputs.device)
        return torch.stack(self._loss_sums[-len(losses):]).sum()

    def eval_schedule(self, rows: int | None = None) -> "_PipelineSchedule":
        """A schedule of the same kind over the same stage modules, for forward-only batches of `rows` rows
        (default: validation batches), run with .eval().

        Fresh PipelineStage objects infer the activation shapes of those batches (batch size and sequence length
        may differ from training) once, instead of the training stages re-inferring at every switch.
        """
        from torch.distributed.pipelining import PipelineStage  # see the top

        old = schedule_stages(self.schedule)
        p = self.cfg.parallelism
        n_micro = validation_microbatch_count(self.cfg, old[0].num_stages) if rows is None else \
            microbatch_count(rows, p.pipeline_parallel_microbatch_size, p.pipeline_parallel_schedule,
                             old[0].num_stages, p.pipeline_parallel_degree)
        if n_micro not in self._eval_schedules:
            stages = [PipelineStage(s.submod, s.stage_index, s.num_stages, s.device, group=s.group) for s in old]
            self._eval_schedules[n_micro] = build_schedule(p.pipeline_parallel_schedule, stages, n_micro,
                                                           self.scaled_loss)
        return self._eval_schedules[n_micro]


def check_pipeline_config(cfg: JobConfig, n_layers: int, tied_embeddings: bool) -> tuple[int, list[list[int]], int]:
    """(stage count, layers of every stage, microbatches per local batch), or a ConfigError."""
    p = cfg.parallelism
    if tied_embeddings:
        raise ConfigError(f"flavor '{cfg.model.flavor}' ties its input embedding to the output head, which cannot be "
                          f"split across pipeline stages; use 'parallelism.pipeline_parallel_degree' 1 or an untied "
                          f"flavor")
    first_less, last_less = p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
    num_stages = virtual_stage_count(p.pipeline_parallel_degree, p.pipeline_parallel_schedule, n_layers,
                                     first_less, last_less, p.pipeline_parallel_layers_per_stage)
    layers = split_layers(n_layers, num_stages, first_less, last_less, p.pipeline_parallel_layers_per_stage)
    n_micro = microbatch_count(cfg.training.local_batch_size, p.pipeline_parallel_microbatch_size,
                               p.pipeline_parallel_schedule, num_stages, p.pipeline_parallel_degree)
    if cfg.validation.enable:
        validation_microbatch_count(cfg, num_stages)  # fail now, not at the first validation
    return num_stages, layers, n_micro


def split_llama(model: Llama, parallel_dims: ParallelDims, cfg: JobConfig) -> tuple[list[int], list[nn.Module]]:
    """This rank's stage ids and their parts of the meta model (DRY_RUN plans from these; no schedule needed)."""
    schedule_name = cfg.parallelism.pipeline_parallel_schedule
    num_stages, layers, _ = check_pipeline_config(cfg, model.args.n_layers, model.args.tie_word_embeddings)
    pp_mesh = parallel_dims.submesh("pp")
    stage_ids = stages_of_rank(pp_mesh.get_local_rank(), num_stages, pp_mesh.size(),
                               v_style=schedule_name in V_STYLE_SCHEDULES)
    return stage_ids, [prune_to_stage(model, layers[s], is_first=s == 0, is_last=s == num_stages - 1)
                       for s in stage_ids]


def pipeline_llama(model: Llama, parallel_dims: ParallelDims, cfg: JobConfig, device: torch.device,
                   loss_fn: Callable) -> tuple[PipelineRunner, list[nn.Module]]:
    """Split the meta model into this rank's stages and build the schedule over them, behind a PipelineRunner.

    The stages wrap the still-meta parts: PipelineStage only keeps a reference to its module and infers
    activation shapes on the first step, so parallelising, materialising and initialising the parts in place
    afterwards (the trainer's order) is safe.
    """
    from torch.distributed.pipelining import PipelineStage  # see the top

    num_stages, _, n_micro = check_pipeline_config(cfg, model.args.n_layers, model.args.tie_word_embeddings)
    stage_ids, parts = split_llama(model, parallel_dims, cfg)
    group = parallel_dims.submesh("pp").get_group()
    stages = [PipelineStage(part, stage_id, num_stages, device, group=group)
              for stage_id, part in zip(stage_ids, parts, strict=True)]
    runner = PipelineRunner(cfg, loss_fn)
    runner.attach(build_schedule(cfg.parallelism.pipeline_parallel_schedule, stages, n_micro, runner.scaled_loss))
    return runner, parts
