"""The trainer: config -> mesh -> tokenizer -> meta model -> transforms -> parallelize -> init -> load -> loop -> export."""

import contextlib
import gc
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_lite import distributed as tl_dist
from titan_lite.config import JobConfig, help_text, parse_args, to_toml, validate
from titan_lite.errors import ConfigError
from titan_lite.data.dataloader import build_dataloader
from titan_lite.data.datasets import check_dataset
from titan_lite.data.tokenizer import build_tokenizer
from titan_lite.metrics.flops import num_flops_per_token
from titan_lite.metrics.logger import MetricsProcessor, init_logger
from titan_lite.metrics.profiler import maybe_enable_memory_snapshot, maybe_enable_profiling
from titan_lite.models.llama import Llama, LlamaArgs, flavor_args
from titan_lite.models.llama.hf import check_args_against_hf_config
from titan_lite.optim.lr_scheduler import LRSchedule
from titan_lite.optim.optimizer import build_optimizer
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.parallelize import parallelize_llama
from titan_lite.parallel.tensor_parallel import check_tp_divisibility
from titan_lite.transforms import build_transforms
from titan_lite.transforms.base import run_after_step

logger = logging.getLogger("titan_lite")
# Known, harmless warnings from torch and torchdata that would otherwise print on every rank at start.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

IGNORE_INDEX = -100


@dataclass
class TrainState:
    """What the loop itself must remember across a resume."""

    step: int = 0
    ntokens_seen: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.ntokens_seen = int(state["step"]), int(state["ntokens_seen"])


# ---------------------------------------------------------------------------------- shared helpers


def tokenizer_path(cfg: JobConfig) -> str:
    path = cfg.model.tokenizer_path or cfg.model.hf_assets_path
    if not path:
        raise ConfigError("no tokenizer: set 'model.hf_assets_path' to a folder with tokenizer.model or tokenizer.json")
    return path


def build_model_args(cfg: JobConfig, vocab_size: int) -> LlamaArgs:
    """The flavor's args updated from the config (sequence length) and checked against the tokenizer."""
    try:
        args = flavor_args(cfg.model.flavor)
    except KeyError as exc:
        raise ConfigError(f"'model.flavor': {exc.args[0]}") from None
    args.max_seq_len = max(cfg.training.seq_len, cfg.validation.seq_len if cfg.validation.enable else 0)
    if vocab_size > args.vocab_size:
        raise ConfigError(f"the tokenizer at '{tokenizer_path(cfg)}' has {vocab_size} tokens but flavor "
                          f"'{cfg.model.flavor}' has vocab_size {args.vocab_size}")
    hf_config = Path(cfg.model.hf_assets_path or "") / "config.json"
    if cfg.model.hf_assets_path and hf_config.is_file():
        check_args_against_hf_config(args, str(hf_config))
    return args


def gradient_accumulation_steps(cfg: JobConfig, dp_degree: int) -> int:
    t = cfg.training
    per_step = t.local_batch_size * dp_degree
    if t.global_batch_size == -1:
        return 1
    if t.global_batch_size % per_step:
        raise ConfigError(f"'training.global_batch_size' {t.global_batch_size} is not a multiple of local_batch_size "
                          f"{t.local_batch_size} x data-parallel degree {dp_degree} = {per_step}")
    return t.global_batch_size // per_step


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token losses, so the caller can normalise by the global token count."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def to_local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly replicated DTensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ------------------------------------------------------------------------------------------ trainer


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.device = tl_dist.local_device()
        tl_dist.init_process_group(self.device, cfg.comm.init_timeout_seconds)
        self.rank = dist.get_rank()
        self.parallel_dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
        self.parallel_dims.build_mesh(self.device.type)
        seed = cfg.debug.seed if cfg.debug.seed is not None else 0
        tl_dist.set_seed(seed, cfg.debug.deterministic, cfg.debug.deterministic_warn_only)
        self.tokenizer = build_tokenizer(tokenizer_path(cfg))
        self.model_args = build_model_args(cfg, self.tokenizer.vocab_size)
        self.grad_accum = gradient_accumulation_steps(cfg, self.parallel_dims.dp_degree)
        self.transforms = build_transforms(cfg.model.converters, cfg)
        self.model_parts = self.build_model(seed)
        self.loss_fn = self.build_loss_fn()
        self.optimizer = build_optimizer(cfg.optimizer, self.model_parts, self.device,
                                         [g for t in self.transforms for g in t.param_groups(self.model_parts)])
        self.lr_schedule = LRSchedule([self.optimizer], cfg.lr_scheduler, cfg.training.steps)
        self.dataloader = self.build_data(cfg.training.dataset, cfg.training.dataset_path, cfg.training.seq_len,
                                          cfg.training.local_batch_size, cfg.training.dataloader, infinite=True)
        self.train_state = TrainState()
        self.checkpointer = self.build_checkpointer()
        self.metrics = self.build_metrics()

    # -------------------------------------------------------------------------------- building

    def build_model(self, seed: int) -> list[nn.Module]:
        """Meta model -> transforms -> parallelize -> materialise -> init -> transforms after load."""
        with torch.device("meta"):
            model = Llama(self.model_args)
        for transform in self.transforms:
            transform.convert(model)
        if self.cfg.model.print_after_conversion:
            logger.info(f"model after transforms:\n{model}")
        model_parts = self.split_pipeline(model)
        model_parts = [parallelize_llama(m, self.parallel_dims, self.cfg) for m in model_parts]
        if self.pp_schedule is not None:
            from titan_lite.parallel.pipeline import rebind_stage_modules

            rebind_stage_modules(self.pp_schedule, model_parts)
        for part in model_parts:
            # FSDP CPU offload keeps the sharded parameters on the CPU; buffers (RoPE) still go to the device.
            part.to_empty(device="cpu" if self.cfg.training.enable_cpu_offload else self.device)
            part.init_weights(seed=seed, buffer_device=self.device)
            part.train()
        logger.info(f"model {self.cfg.model.name} {self.cfg.model.flavor}: {model.num_params():,} parameters "
                    f"({sum(p.numel() for m in model_parts for p in m.parameters()):,} held by rank {self.rank}); "
                    f"{self.parallel_dims.describe()}; gradient accumulation {self.grad_accum}")
        return model_parts

    def split_pipeline(self, model: Llama) -> list[nn.Module]:
        """Pipeline parallelism splits the model into this rank's stages (see parallel/pipeline.py)."""
        self.pp_schedule = None
        if not self.parallel_dims.pp_enabled:
            return [model]
        from titan_lite.parallel.pipeline import pipeline_llama, schedule_stages

        self.pp_schedule, parts = pipeline_llama(model, self.parallel_dims, self.cfg, self.device, self.pp_loss_fn)
        # With V-style schedules one rank holds both the first and the last stage.
        self.pp_has_first_stage = any(stage.is_first for stage in schedule_stages(self.pp_schedule))
        self.pp_has_last_stage = any(stage.is_last for stage in schedule_stages(self.pp_schedule))
        return parts

    def build_loss_fn(self):
        if self.cfg.compile.enable and "loss" in self.cfg.compile.components:
            from titan_lite.parallel.parallelize import loss_parallel_enabled

            if loss_parallel_enabled(self.parallel_dims, self.cfg):
                # Compiled, cross-entropy ignores loss_parallel()'s handlers and normalises each vocab shard on its
                # own (a wrong loss, silently): the sharded loss stays eager.
                logger.info("compile: the loss is not compiled under loss parallel (tensor parallel)")
                return cross_entropy_sum
            return torch.compile(cross_entropy_sum, backend=self.cfg.compile.backend)
        return cross_entropy_sum

    def build_data(self, dataset: str, path: str | None, seq_len: int, batch: int, loader_cfg, infinite: bool):
        batch_mesh = self.parallel_dims.submesh("batch")
        key_prefix = "training" if infinite else "validation"
        return build_dataloader(dataset, path, self.tokenizer, seq_len, batch,
                                dp_rank=batch_mesh.get_local_rank(), dp_world_size=batch_mesh.size(),
                                infinite=infinite, num_workers=loader_cfg.num_workers, pin_memory=loader_cfg.pin_memory,
                                persistent_workers=loader_cfg.persistent_workers,
                                prefetch_factor=loader_cfg.prefetch_factor, key_prefix=key_prefix)

    def build_checkpointer(self):
        from titan_lite.checkpoint.manager import CheckpointManager

        return CheckpointManager(self.cfg, self)

    def build_metrics(self) -> MetricsProcessor:
        a = self.model_args
        # Counted on a meta copy: pipeline stages and shards each hold only part of the model.
        flops = num_flops_per_token(self._full_param_count(), a.vocab_size * a.dim, a.n_layers, a.n_heads, a.head_dim,
                                    self.cfg.training.seq_len)
        return MetricsProcessor(self.cfg, self.rank, self.device, flops, self.parallel_dims.non_data_parallel_size)

    def _full_param_count(self) -> int:
        with torch.device("meta"):
            return Llama(self.model_args).num_params()

    # -------------------------------------------------------------------------------- one step

    def train_context(self) -> contextlib.ExitStack:
        """Loss parallel under TP (the loss runs on vocab-sharded logits); autocast when mixed precision is asked
        for but FSDP (which applies it itself) is off."""
        from torch.distributed.tensor.parallel import loss_parallel

        from titan_lite.parallel.parallelize import loss_parallel_enabled

        stack = contextlib.ExitStack()
        if loss_parallel_enabled(self.parallel_dims, self.cfg):
            stack.enter_context(loss_parallel())
        dtype = mixed_precision_dtype(self.cfg, self.device)
        data_parallel = self.parallel_dims.fsdp_enabled or self.parallel_dims.dp_replicate_enabled
        if dtype != torch.float32 and not data_parallel:
            stack.enter_context(torch.autocast(self.device.type, dtype=dtype))
        return stack

    def next_microbatches(self, data_iter) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = []
        for _ in range(self.grad_accum):
            inputs, labels = next(data_iter)
            batches.append((inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)))
        return batches

    def global_token_count(self, microbatches) -> torch.Tensor:
        """Tokens that carry a loss, summed over the microbatches of every data-parallel rank."""
        local = sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches).to(torch.float64)
        if self.parallel_dims.dp_degree > 1:
            dist.all_reduce(local, group=self.parallel_dims.submesh("batch").get_group())
        return local

    def context_parallel_shard(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This CP rank's sequence chunks of a [batch, seq] microbatch; its token losses then sum over the "loss"
        mesh (dp x cp) while the global token count stays the count of the whole batch."""
        if not self.parallel_dims.cp_enabled:
            return inputs, labels
        from titan_lite.parallel.context_parallel import shard_batch

        return shard_batch((inputs, labels), self.parallel_dims, self.cfg.parallelism.context_parallel_load_balancer)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """One microbatch: returns the detached sum of its token losses."""
        inputs, labels = self.context_parallel_shard(inputs, labels)
        if self.pp_schedule is not None:
            return self.pipeline_forward_backward(inputs, labels, scale)
        with self.train_context():
            logits = self.model_parts[0](inputs)
            loss_sum = self.loss_fn(logits, labels)
            del logits
            (loss_sum * scale).backward()
        return loss_sum.detach()

    def pp_loss_fn(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss a pipeline schedule backpropagates: token-loss sum over the step's global token count."""
        loss_sum = self.loss_fn(output, labels)
        self._pp_loss_sums.append(loss_sum.detach())
        return loss_sum * self._loss_scale

    def pipeline_forward_backward(self, inputs, labels, scale) -> torch.Tensor:
        return self.run_pipeline(self.pp_schedule.step, inputs, labels, scale)

    def run_pipeline(self, run, inputs, labels, scale) -> torch.Tensor:
        """One local batch through a schedule's step or eval; the sum of its token losses (zero off the last stage)."""
        self._loss_scale, self._pp_loss_sums = scale, []
        is_first, is_last = self.pp_has_first_stage, self.pp_has_last_stage
        args = (inputs,) if is_first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": labels, "losses": losses} if is_last else {}
        with self.train_context():
            run(*args, return_outputs=False, **kwargs)
        if not is_last:
            return torch.zeros((), device=self.device)
        # A schedule's first run also calls the loss once on placeholder activations to infer shapes (its value is
        # garbage); the real microbatches are the last len(losses) calls.
        return torch.stack(self._pp_loss_sums[-len(losses):]).sum()

    def train_step(self, microbatches) -> tuple[float, float]:
        """Accumulate gradients over the microbatches, clip, step; return the global loss and grad norm."""
        global_tokens = self.global_token_count(microbatches)
        # FSDP/DDP average gradients over the data-parallel ranks; scaling by that degree makes the result the
        # gradient of (sum of every rank's token losses) / (global tokens), identical to one big batch.
        scale = (self.parallel_dims.gradient_average_degree / global_tokens).to(torch.float32)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for inputs, labels in microbatches:
            loss_sum += to_local(self.forward_backward(inputs, labels, scale)).to(torch.float64)
        grad_norm = self.clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        run_after_step(self.transforms, self.model_parts)
        loss = self.global_loss(loss_sum, global_tokens)
        self.lr_schedule.step(loss)
        return loss, grad_norm

    def global_loss(self, loss_sum: torch.Tensor, global_tokens: torch.Tensor) -> float:
        """Mean token loss over the whole global batch (identical on every rank)."""
        pd = self.parallel_dims
        if pd.dp_degree * pd.cp > 1:
            dist.all_reduce(loss_sum, group=pd.submesh("loss").get_group())
        if pd.pp_enabled:  # only the last stage computed losses; the others hold zero
            dist.all_reduce(loss_sum, group=pd.submesh("pp").get_group())
        return (loss_sum / global_tokens).item()

    def clip_gradients(self) -> float:
        from titan_lite.parallel.grad_norm import clip_grad_norm

        params = [p for m in self.model_parts for p in m.parameters() if p.grad is not None]
        pp_mesh = self.parallel_dims.submesh("pp") if self.parallel_dims.pp_enabled else None
        return clip_grad_norm(params, self.cfg.training.max_norm, pp_mesh)

    # -------------------------------------------------------------------------------- validation

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token loss over the held-out split (the same batches every time)."""
        v = self.cfg.validation
        loader = self.build_data(v.dataset, v.dataset_path, v.seq_len, v.local_batch_size, v.dataloader, infinite=False)
        for m in self.model_parts:
            m.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        batches = iter(loader)
        for _ in range(self.validation_batch_count(len_hint=v.steps)):
            inputs, labels = self.context_parallel_shard(*(t.to(self.device) for t in next(batches)))
            totals[0] += self.validation_loss_sum(inputs, labels)
            totals[1] += (labels != IGNORE_INDEX).sum()
        for m in self.model_parts:
            m.train()
        if self.parallel_dims.pp_enabled:  # only the last stage computed losses; the other stages hold zero
            loss_sum = totals[0].clone()
            dist.all_reduce(loss_sum, group=self.parallel_dims.submesh("pp").get_group())
            totals[0] = loss_sum
        if self.parallel_dims.dp_degree * self.parallel_dims.cp > 1:  # CP ranks each counted their own chunks
            dist.all_reduce(totals, group=self.parallel_dims.submesh("loss").get_group())
        return (totals[0] / totals[1]).item()

    def validation_loss_sum(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of one validation batch's token losses (under PP: through the stages, zero off the last stage)."""
        if self.pp_schedule is not None:
            return self.run_pipeline(self.pp_eval_schedule().eval, inputs, labels, torch.ones((), device=self.device))
        with self.train_context():
            return to_local(cross_entropy_sum(self.model_parts[0](inputs), labels)).double()

    def pp_eval_schedule(self):
        """A forward-only twin of the training schedule over the same stage modules, sized for validation batches."""
        if getattr(self, "_pp_eval_schedule", None) is None:
            from titan_lite.parallel.pipeline import eval_schedule

            self._pp_eval_schedule = eval_schedule(self.pp_schedule, self.cfg, self.pp_loss_fn)
        return self._pp_eval_schedule

    def validation_batch_count(self, len_hint: int) -> int:
        """Batches every rank can run: a full pass ends at the shortest rank's split so no collective hangs."""
        v = self.cfg.validation
        loader = self.build_data(v.dataset, v.dataset_path, v.seq_len, v.local_batch_size, v.dataloader, infinite=False)
        count = torch.tensor(sum(1 for _ in loader), device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(count, op=dist.ReduceOp.MIN)
        n = int(count)
        return n if len_hint == -1 else min(n, len_hint)

    # -------------------------------------------------------------------------------- the loop

    def train(self) -> None:
        cfg = self.cfg
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save_seed()
            self.metrics.close()
            return
        self.checkpointer.load()
        data_iter = iter(self.dataloader)
        gc.disable()
        logger.info(f"training {cfg.training.steps} steps from step {self.train_state.step}; "
                    f"global batch {cfg.training.local_batch_size * self.parallel_dims.dp_degree * self.grad_accum} "
                    f"x {cfg.training.seq_len} tokens")
        with maybe_enable_profiling(cfg, self.train_state.step) as profiler, \
                maybe_enable_memory_snapshot(cfg, self.train_state.step) as snapshot:
            while self.train_state.step < cfg.training.steps:
                self.train_state.step += 1
                step = self.train_state.step
                microbatches = self.next_microbatches(data_iter)
                ntokens = sum(inputs.numel() for inputs, _ in microbatches)
                self.train_state.ntokens_seen += ntokens
                self.metrics.add_tokens(ntokens)
                lr = self.lr_schedule.last_lr()  # the LR this step uses; train_step advances the schedule
                loss, grad_norm = self.train_step(microbatches)
                if self.metrics.should_log(step) or step == cfg.training.steps:
                    self.metrics.log(step, loss, grad_norm, lr)
                if cfg.validation.enable and step % cfg.validation.freq == 0:
                    self.metrics.log_validation(step, self.validate())
                self.checkpointer.save(step, last=step == cfg.training.steps)
                if step == 1:
                    self.set_train_timeout()
                self.collect_garbage(step)
                if profiler is not None:
                    profiler.step()
                if snapshot is not None:
                    snapshot.step()
        gc.enable()
        self.checkpointer.finish()
        self.metrics.close()
        logger.info(f"training finished after {self.train_state.step} steps")

    def collect_garbage(self, step: int) -> None:
        if self.cfg.training.gc_debug or step % self.cfg.training.gc_freq == 0:
            gc.collect(1)

    def set_train_timeout(self) -> None:
        """Shorten the collective timeout once the slow first step (compile, warm-up) is done."""
        group = dist.group.WORLD
        if hasattr(group, "_set_default_timeout"):
            from datetime import timedelta

            group._set_default_timeout(timedelta(seconds=self.cfg.comm.train_timeout_seconds))


def mixed_precision_dtype(cfg: JobConfig, device: torch.device) -> torch.dtype:
    """The compute dtype: 'auto' means bfloat16 on accelerators and float32 on CPUs (bf16 matmuls are slow there)."""
    name = cfg.training.mixed_precision_param
    if name == "auto":
        name = "float32" if device.type == "cpu" else "bfloat16"
    return getattr(torch, name)


# ------------------------------------------------------------------------------------------ entry


def check_config(cfg: JobConfig) -> LlamaArgs:
    """Everything that can be checked before a process group or a model exists; returns the model args."""
    validate(cfg)
    check_dataset(cfg.training.dataset, cfg.training.dataset_path, "training")
    if cfg.validation.enable:
        check_dataset(cfg.validation.dataset, cfg.validation.dataset_path, "validation")
    tokenizer = build_tokenizer(tokenizer_path(cfg))
    args = build_model_args(cfg, tokenizer.vocab_size)
    check_tp_divisibility(args, cfg.parallelism.tensor_parallel_degree)
    if cfg.parallelism.pipeline_parallel_degree > 1:
        from titan_lite.parallel.pipeline import check_pipeline_config

        check_pipeline_config(cfg, args.n_layers, args.tie_word_embeddings)
    build_transforms(cfg.model.converters, cfg)
    return args


def check_launch(cfg: JobConfig, model_args: LlamaArgs) -> int:
    """run_train.sh calls this before torchrun, so user errors print one line instead of torchrun's traceback."""
    from titan_lite.parallel.dry_run import planned_world_size

    dims = ParallelDims.from_config(cfg.parallelism, planned_world_size())
    gradient_accumulation_steps(cfg, dims.dp_degree)
    from titan_lite.parallel.fsdp import check_cpu_offload

    check_cpu_offload(cfg, dims)
    from titan_lite.checkpoint.manager import check_source_before_launch

    check_source_before_launch(cfg, model_args)
    return 0


def save_config(cfg: JobConfig) -> None:
    if cfg.job.print_config:
        logger.info("resolved config:\n" + to_toml(cfg))
    if cfg.job.save_config_file:
        out = Path(cfg.job.dump_folder) / cfg.job.save_config_file
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(to_toml(cfg))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    init_logger()
    try:
        cfg = parse_args(argv)
        model_args = check_config(cfg)
        if os.environ.get("TITAN_LITE_CHECK_ONLY") == "1":
            return check_launch(cfg, model_args)
        if cfg.comm.mode != "default" or os.environ.get("DRY_RUN") == "1":
            from titan_lite.parallel.dry_run import dry_run

            return dry_run(cfg)
        save_config(cfg)
        trainer = Trainer(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        tl_dist.shutdown_quietly()
        return 2
    try:
        trainer.train()
    except ConfigError as exc:  # found at load time, e.g. a checkpoint that does not fit the model
        print(f"error: {exc}", file=sys.stderr, flush=True)
        tl_dist.shutdown_quietly()
        return 2
    finally:
        tl_dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
