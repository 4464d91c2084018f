"""The trainer: config -> plan -> model (assembled) -> optimizer -> resume -> loop -> export; and the entry point."""

import gc
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titan_lite import distributed as tl_dist
from titan_lite.checkpoint.hf import export_hf
from titan_lite.checkpoint.manager import CheckpointManager, RankLocal, RNGState
from titan_lite.checkpoint.resume import checkpoint_root, plan_resume
from titan_lite.config import JobConfig, help_text, parse_args, to_toml, validate
from titan_lite.data.batch import Batch
from titan_lite.data.mixture import DomainWeights
from titan_lite.dry_run import dry_run, planned_world_size
from titan_lite.dtensor import full_tensor
from titan_lite.errors import FAULT, HANG, USER_ERROR, ConfigError, TrainingFault
from titan_lite.eval.validate import Validator
from titan_lite.faults import ACTIVITY, StopSignals, any_rank, is_collective_timeout, nonfinite_message, timeout_line
from titan_lite.folders import first_missing, remove_if_only
from titan_lite.job.assembly import BuiltModel, assemble_model
from titan_lite.job.plan import JobPlan, check_before_launch, plan_job
from titan_lite.job.sources import TrainingLoader, training_data
from titan_lite.launcher import another_rank_failed, register_rank, report_error
from titan_lite.metrics.flops import delta_rule_flops_per_token, model_flops_per_token
from titan_lite.metrics.logger import MetricsProcessor, add_log_file, init_logger
from titan_lite.metrics.profiler import maybe_enable_memory_snapshot, maybe_enable_profiling
from titan_lite.objective import build_objective, check_objective
from titan_lite.objective.load_balance import LoadBalance
from titan_lite.optim.lr_scheduler import LRSchedule
from titan_lite.optim.optimizer import build_optimizer
from titan_lite.parallel.grad_norm import clip_grad_norm

logger = logging.getLogger("titan_lite")
# Known, harmless warnings from torch and torchdata that would otherwise print on every rank at start.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
# Test hook: the gradients of this step become NaN (a numerical fault on a chosen step).
NAN_STEP_ENV = "TITAN_LITE_TEST_NAN_STEP"


@dataclass
class TrainState:
    """What the loop itself must remember across a resume."""

    step: int = 0
    ntokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.ntokens_seen = int(state["step"]), int(state["ntokens_seen"])


class Trainer:
    """One straight path, each step a short method: the design's life of a run (see docs/architecture.md)."""

    def __init__(self, cfg: JobConfig, plan: JobPlan | None = None):
        """`plan`: the pre-launch check's plan for this world size (its transforms already checked), or None."""
        self.cfg = cfg
        self.device = tl_dist.local_device()
        tl_dist.keep_freed_memory(self.device)
        tl_dist.configure_flight_recorder(cfg.comm, cfg.job.dump_folder, tl_dist.choose_backend(self.device))
        ACTIVITY.timeout("comm.init_timeout_seconds", cfg.comm.init_timeout_seconds)
        ACTIVITY.now("joining the process group")
        tl_dist.init_process_group(self.device, cfg.comm.init_timeout_seconds)
        self.rank = dist.get_rank()
        if plan is None or plan.parallel_dims.world_size != dist.get_world_size():
            plan = plan_job(cfg, dist.get_world_size())
        self.plan = plan
        self.parallel_dims = self.plan.parallel_dims
        self.parallel_dims.build_mesh(self.device.type)
        self.seed = cfg.debug.seed if cfg.debug.seed is not None else 0
        tl_dist.set_seed(self.seed, cfg.debug.deterministic, cfg.debug.deterministic_warn_only)
        self.transforms = self.plan.transforms
        self.train_state = TrainState()
        ACTIVITY.now("building the model")
        self.model = self.build_model()
        self.model_parts = self.model.parts
        self.runner = self.model.runner
        self.build_objective()
        self.load_balance = LoadBalance(self.model_parts, self.plan.model_args)
        self.optimizer = build_optimizer(cfg.optimizer, self.model_parts, self.device,
                                         self.transforms.param_groups(self.model_parts))
        self.transforms.bind_optimizer(self.optimizer)
        self.lr_schedule = LRSchedule([self.optimizer], cfg.lr_scheduler, cfg.training.steps)
        self.dataloader = self.build_train_loader()
        self.checkpointer = self.build_checkpointer()
        self.validator = self.build_validator()
        self.metrics = self.build_metrics()
        self.set_collective_timeout("comm.init_timeout_seconds", cfg.comm.init_timeout_seconds)

    # -------------------------------------------------------------------------------- building

    def build_model(self) -> BuiltModel:
        """Assembled parts started from the load plan's initial weights, unless this run's checkpoint holds the whole
        model (adapter-only checkpoints do not: then the initial weights come first and train() loads the rest)."""
        self.loading = plan_resume(self.cfg, announce=self.rank == 0)
        built = assemble_model(self.plan, self.device, seed=self.seed, load=self.loading)
        logger.info(f"model {self.cfg.model.name} {self.cfg.model.flavor}: {self.plan.full_param_count():,} parameters "
                    f"({built.param_count():,} held by rank {self.rank}); {self.parallel_dims.describe()}; "
                    f"gradient accumulation {self.plan.grad_accum}")
        return built

    def build_objective(self) -> None:
        """The one objective the trainer holds and hands to the runner: cross entropy, distillation with its frozen
        teacher (not checkpointed), preference tuning or GRPO with their reference (a precomputed one is
        checkpointed)."""
        self.objective = build_objective(self.plan, self.model, self.device, self.seed)
        self.objective_metrics: dict[str, float] = {}

    def checkpoint_folder(self) -> Path:
        return checkpoint_root(self.cfg)

    def build_train_loader(self) -> TrainingLoader:
        data = training_data(self.plan, self.runner, self.device, self.seed)
        self.mixture: DomainWeights | None = data.mixture
        return data.loader

    def build_checkpointer(self) -> CheckpointManager:
        world = dist.get_world_size()
        states = {
            "lr_scheduler": self.lr_schedule,
            "train_state": self.train_state,
            "dataloader": self.dataloader,  # the same on every rank, whatever the layout
            "rng": RankLocal(RNGState(self.device), f"rank{self.rank}_of_{world}",
                             lambda saved: "holds RNG states of another world size; RNGs keep this run's seeds"),
            **self.transforms.state(),
            **self.objective.states,  # the same on every rank
            **({"data_mixture": self.mixture} if self.mixture is not None else {}),  # the same on every rank
        }
        return CheckpointManager(self.cfg.checkpoint, self.checkpoint_folder(), self.model_parts, self.optimizer,
                                 states, saves_parameter=self.transforms.saves_parameter)

    def build_validator(self) -> Validator | None:
        if not self.cfg.validation.enable:
            return None
        return Validator(self.cfg, self.plan.tokenizer, self.parallel_dims, self.runner, self.device,
                         self.objective.objective)

    def build_metrics(self) -> MetricsProcessor:
        a = self.plan.model_args
        # an MoE token runs only its top-k experts: the FLOPs count the active parameters
        active = self.plan.full_param_count() - a.inactive_param_count()
        flops = model_flops_per_token(active, a.vocab_size * a.dim, a.attention_shapes(), self.cfg.training.seq_len,
                                      self.plan.frozen_matmul_param_count()) + delta_rule_flops_per_token(a)
        return MetricsProcessor(self.cfg, self.rank, self.device, flops, self.parallel_dims.non_data_parallel_size,
                                resuming=self.loading.resuming)

    # -------------------------------------------------------------------------------- one step

    def next_microbatches(self, data_iter) -> list[Batch]:
        """The step's microbatches on the device (with document ids of packed documents (block_causal), domain ids
        under a data mixture, per-token values of RL's rollouts)."""
        return [next(data_iter).to(self.device, non_blocking=True) for _ in range(self.plan.grad_accum)]

    def global_units(self, microbatches: list[Batch]) -> torch.Tensor:
        """What the loss averages over (tokens that carry a loss; preference pairs), and the objective's other
        counts, summed over the microbatches of every data-parallel rank."""
        objective = self.objective.objective
        local = sum(objective.units(batch) for batch in microbatches)
        if self.parallel_dims.dp_degree > 1:
            dist.all_reduce(local, group=self.parallel_dims.submesh("batch").get_group())
        objective.start_step(local)
        return local

    def train_step(self, microbatches: list[Batch], step: int) -> tuple[float, float]:
        """Accumulate gradients over the microbatches, clip, step; return the global loss and grad norm."""
        self.transforms.before_step(self.model_parts, step)
        if self.load_balance.enabled:
            self.load_balance.before_step(self.plan.global_batch_size, self.parallel_dims.gradient_average_degree)
        global_units = self.global_units(microbatches)
        global_tokens = global_units[0]
        # FSDP/DDP average gradients over the data-parallel ranks; scaling by that degree makes the result the
        # gradient of (sum of every rank's token losses) / (global tokens), identical to one big batch.
        scale = (self.parallel_dims.gradient_average_degree / global_tokens).to(torch.float32)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        domain_sums = self.mixture.new_sums(self.device) if self.mixture is not None else None
        objective = self.objective.objective
        for batch in microbatches:
            loss_sum += self.runner.forward_backward(batch, scale, objective, domain_sums).to(torch.float64)
        self.objective_metrics = objective.step_metrics(lambda sums: self.runner.global_sum(sums, loss_values=True),
                                                        global_units)
        self.add_transform_loss(step)
        self.maybe_poison_gradients_for_test(step)
        grad_norm = self.clip_gradients()
        loss = (self.runner.global_sum(loss_sum, loss_values=True) / global_tokens).item()
        # Both are global values, so every rank takes the same branch.
        fault = nonfinite_message(step, loss, grad_norm)
        if fault is None:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if fault is None:
            self.transforms.after_optimizer_step(self.model_parts, step)
            self.load_balance.update_biases(lambda sums: self.runner.global_sum(sums, loss_values=False))
        else:
            self.handle_nonfinite(fault)
        if domain_sums is not None:  # a skipped step's losses are not measured, but its window still ends
            sums = self.runner.global_sum(domain_sums, loss_values=True) if fault is None else domain_sums.zero_()
            self.mixture.observe(sums, step)
        self.lr_schedule.step(loss if fault is None else None)
        return loss, grad_norm

    def handle_nonfinite(self, fault: str) -> None:
        """training.on_nonfinite: stop with one line (nothing of this step is applied or saved), or skip the step."""
        if self.cfg.training.on_nonfinite == "stop":
            raise TrainingFault(f"{fault}; stopped before the optimizer step ('training.on_nonfinite' = 'stop'), so "
                                f"no checkpoint holds it; {self.checkpointer.newest_note()}; lower 'optimizer.lr' or "
                                f"set 'training.on_nonfinite' = 'skip' to skip such steps")
        logger.warning(f"{fault}: step skipped ('training.on_nonfinite' = 'skip'): no update is applied; the LR "
                       f"schedule and the data move on")

    def maybe_poison_gradients_for_test(self, step: int) -> None:
        if os.environ.get(NAN_STEP_ENV) == str(step):
            grads = [p.grad for m in self.model_parts for p in m.parameters() if p.grad is not None]
            if grads:
                grads[0].fill_(float("nan"))

    def add_transform_loss(self, step: int) -> None:
        """A transform's extra loss term, backpropagated once per optimizer step."""
        term = self.transforms.extra_loss(self.model_parts, step)
        if term is not None:
            full_tensor(term).backward()

    def clip_gradients(self) -> float:
        params = [p for m in self.model_parts for p in m.parameters() if p.grad is not None]
        pp_mesh = self.parallel_dims.submesh("pp") if self.parallel_dims.pp_enabled else None
        return clip_grad_norm(params, self.cfg.training.max_norm, pp_mesh)

    # -------------------------------------------------------------------------------- the loop

    def train(self, stop: StopSignals | None = None) -> None:
        """Train to training.steps, or until a stop signal (then save at the step boundary and return)."""
        cfg = self.cfg
        try:
            if cfg.checkpoint.create_seed_checkpoint:
                self.checkpointer.save_seed()
                return
            self.resume()
            start = self.train_state.step
            if start < cfg.training.steps:
                self.objective.before_training()  # a precomputed reference, unless the checkpoint holds it
            if start >= cfg.training.steps:
                where = "already at" if start == cfg.training.steps else "past"
                logger.info(f"the run is {where} 'training.steps' = {cfg.training.steps}: checkpoint step-{start} in "
                            f"'{self.checkpoint_folder()}'; nothing to train (raise --training.steps to continue it)")
            logger.info(f"training {cfg.training.steps} steps from step {start}; "
                        f"global batch {self.plan.global_batch_size} x {cfg.training.seq_len} tokens")
            gc.disable()
            self.metrics.start_window(start)
            stopped = self.loop(iter(self.dataloader), stop)
            if stopped:
                self.stop_at_step_boundary(stop, start)
                return
            self.checkpointer.finish()
            self.export()
            logger.info(f"training finished after {self.train_state.step} steps")
        finally:
            gc.enable()
            self.metrics.close()

    def loop(self, data_iter, stop: StopSignals | None) -> bool:
        """The steps; True when a stop request ended them early (every rank agrees on the step)."""
        cfg = self.cfg
        with maybe_enable_profiling(cfg, self.train_state.step) as profiler, \
                maybe_enable_memory_snapshot(cfg, self.train_state.step) as snapshot:
            while self.train_state.step < cfg.training.steps:
                if self.stop_requested(stop):
                    return True
                self.train_state.step += 1
                self.run_step(self.train_state.step, data_iter)
                for tracer in (profiler, snapshot):
                    if tracer is not None:
                        tracer.step()
        return False

    def stop_requested(self, stop: StopSignals | None) -> bool:
        ACTIVITY.now(f"agreeing on a stop after step {self.train_state.step}")
        return any_rank(stop is not None and stop.requested)

    def stop_at_step_boundary(self, stop: StopSignals | None, start: int) -> None:
        """A graceful stop: save this step (unless nothing changed since the checkpoint the run started from)."""
        step = self.train_state.step
        ACTIVITY.now(f"saving checkpoint step-{step} for a stop")
        saved = step > start and self.checkpointer.save(step, force=True)
        self.checkpointer.finish()
        cause = f"{stop.name} on this rank" if stop is not None and stop.requested else "another rank's request"
        if saved:
            outcome = f"checkpoint step-{step} saved in '{self.checkpoint_folder()}'; run the same command to continue"
        elif step == start:
            outcome = "no step ran since the run started, nothing to save"
        else:
            outcome = "nothing saved ('checkpoint.enable' is false or 'checkpoint.load_only' is true)"
        logger.info(f"stopped after step {step} ({cause}): {outcome}")

    def resume(self) -> None:
        """Load what the load plan leaves after assembly: this run's checkpoint, or an initial DCP training state."""
        ACTIVITY.now("loading the checkpoint")
        self.checkpointer.load_planned(self.loading)
        if self.loading.resuming:
            logger.info(f"resuming after step {self.train_state.step}")

    def run_step(self, step: int, data_iter) -> None:
        cfg = self.cfg
        ACTIVITY.now(f"reading step {step}'s batch (RL: sampling its rollout)")
        microbatches = self.next_microbatches(data_iter)
        ntokens = sum(batch.inputs.numel() for batch in microbatches)
        self.train_state.ntokens_seen += ntokens
        self.metrics.add_tokens(ntokens)
        lr = self.lr_schedule.last_lr()  # the LR this step uses; train_step advances the schedule
        ACTIVITY.now(f"in step {step} (forward, backward, gradient reductions)")
        loss, grad_norm = self.train_step(microbatches, step)
        if self.metrics.should_log(step) or step == cfg.training.steps:
            moe, per_layer = self.moe_metrics()
            extra = {**self.transforms.metrics(self.model_parts), **self.objective_metrics, **moe,
                     **self.dataloader.metrics()}
            self.metrics.log(step, loss, grad_norm, lr,
                             extra=extra if self.mixture is None else {**extra, **self.mixture.metrics()},
                             unprinted=per_layer)
        if self.validator is not None and step % cfg.validation.freq == 0:
            ACTIVITY.now(f"validating after step {step}")
            results = self.validator.evaluate(self.model_parts, step)
            self.metrics.log_validation(step, results.pop("loss", None), results)
        ACTIVITY.now(f"saving checkpoint step-{step}")
        self.checkpointer.save(step, last=step == cfg.training.steps)
        if step == 1:
            self.set_collective_timeout("comm.train_timeout_seconds", cfg.comm.train_timeout_seconds)
        if cfg.training.gc_debug or step % cfg.training.gc_freq == 0:
            gc.collect(1)

    def moe_metrics(self) -> tuple[dict[str, float], dict[str, float]]:
        """The step's MoE aux loss and expert load, printed and per layer (collective: every rank calls it at a
        logged step)."""
        if not self.load_balance.enabled:
            return {}, {}
        return self.load_balance.metrics(lambda sums: self.runner.global_sum(sums, loss_values=True),
                                         self.plan.global_batch_size, self.device)

    def export(self) -> None:
        """End of the run: the HF folder (last_save_in_hf) and the transforms' own artifacts. A run that does not
        checkpoint writes nothing, as torchtitan's (a setting that asks for an export was warned about at start)."""
        c = self.cfg.checkpoint
        if not c.enable:
            if c.last_save_in_hf or list(self.transforms):
                logger.info("nothing written at the end: 'checkpoint.enable' is false (no checkpoint, no Hugging Face "
                            "or adapter export, no pruned model or report)")
            return
        if c.load_only:
            return
        step = self.train_state.step
        if c.last_save_in_hf and self.transforms.exports_full_model():
            out = self.checkpoint_folder() / f"step-{step}-hf"
            logger.info(f"writing the Hugging Face export of step {step} to {out}")
            export_hf(self.model_parts, self.plan.model_args, str(out), getattr(torch, c.export_dtype),
                      self.cfg.model.hf_assets_path, self.parallel_dims, convert=self.hf_conversion())
            logger.info(f"Hugging Face export of step {step} written to {out}")
        self.transforms.export(self.model_parts, self.checkpoint_folder(), step)

    def hf_conversion(self):
        return self.transforms.export_state_dict if list(self.transforms) else None

    @staticmethod
    def set_collective_timeout(key: str, seconds: int) -> None:
        """Bound every collective of every process group (the init timeout until step 1 ends: compile and warm-up
        are slow; then the train timeout); a rank that waits longer stops with one line (see faults.timeout_line)."""
        tl_dist.set_collective_timeout(seconds)
        ACTIVITY.timeout(key, seconds)


# ------------------------------------------------------------------------------------------ entry


def save_config(cfg: JobConfig) -> None:
    """The run folder records the run: the resolved config as TOML and the log file (rank 0 writes both)."""
    if cfg.job.print_config:
        logger.info("resolved config:\n" + to_toml(cfg))
    if int(os.environ.get("RANK", 0)) != 0:
        return
    if cfg.job.log_file:
        add_log_file(Path(cfg.job.dump_folder) / cfg.job.log_file)
    if cfg.job.save_config_file:
        out = Path(cfg.job.dump_folder) / cfg.job.save_config_file
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(to_toml(cfg))


def warn_surprises(cfg: JobConfig) -> None:
    """Settings that run but probably not as meant: one warning line each."""
    warmup = cfg.lr_scheduler.warmup_steps
    if cfg.lr_scheduler.warmup_ratio is None and warmup > cfg.training.steps:
        logger.warning(f"'lr_scheduler.warmup_steps' = {warmup} is longer than the run ('training.steps' = "
                       f"{cfg.training.steps}): the learning rate never reaches 'optimizer.lr'")


def run(cfg: JobConfig) -> int:
    """Validate, then: the pre-launch check (run_train.sh before torchrun), DRY_RUN, or training."""
    if os.environ.get("TITAN_LITE_CHECK_ONLY") == "1":
        check_objective(check_before_launch(cfg, planned_world_size()))
        return 0
    if cfg.comm.mode != "default" or os.environ.get("DRY_RUN") == "1":
        validate(cfg, files=False)
        return dry_run(cfg)
    created = first_missing(cfg.job.dump_folder)
    try:
        # Each rank checks what run_train.sh used to check in a separate process before torchrun (one process start
        # less per launch); a user error still ends the run in one line through the launcher.
        plan = check_before_launch(cfg, int(os.environ.get("WORLD_SIZE", planned_world_size())))
        check_objective(plan)
        save_config(cfg)
        warn_surprises(cfg)
        logger.info(f"job: {cfg.job.description}")
        with StopSignals().installed() as stop:
            register_rank()  # after the handlers: the launcher signals registered ranks
            Trainer(cfg, plan).train(stop)
    except ConfigError:
        if created is not None and int(os.environ.get("RANK", 0)) == 0:  # a refusal leaves no folder of its own
            dump = Path(cfg.job.dump_folder).absolute().relative_to(created)
            remove_if_only(created, [dump / name for name in (cfg.job.save_config_file, cfg.job.log_file) if name])
        raise
    tl_dist.remove_empty_trace_folder(cfg.comm, cfg.job.dump_folder)
    tl_dist.shutdown()
    return 0


def one_line_error(exc: Exception) -> tuple[int, str] | None:
    """(exit code, line) of an error that ends a run with one line: a user error, a training fault, a collective
    that timed out. None for anything else (a bug: its traceback is printed)."""
    if isinstance(exc, ConfigError):
        return USER_ERROR, str(exc)
    if isinstance(exc, TrainingFault):
        return FAULT, str(exc)
    if is_collective_timeout(exc):
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        return HANG, timeout_line(exc, rank, world)
    return None


def preload() -> None:
    """What a training rank imports after it starts (TensorBoard's writer: ~0.6 s): titan_lite.launcher --preload
    imports it once before it forks the ranks."""
    import torch.utils.tensorboard  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    init_logger()
    try:
        return run(parse_args(argv))
    except Exception as exc:
        tl_dist.shutdown_quietly()
        known = one_line_error(exc)
        if known is not None:
            report_error(*known)  # to the launcher, which prints it once; else to stderr
            return known[0]
        if another_rank_failed():  # a consequence of the error that rank reported: the launcher prints that one
            return 1
        raise
    except BaseException:
        tl_dist.shutdown_quietly()  # no barrier: the other ranks may never get there
        raise


if __name__ == "__main__":
    # The process's import-time objects (torch's, about a million) leave the collector's view: the collections that
    # setting up a run triggers, before the training loop turns it off, would walk them all (~1 s of CPU a rank).
    gc.freeze()
    sys.exit(main())
