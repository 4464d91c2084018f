"""The "lora" transform: adapters on the chosen projections ([lora]), everything else frozen, through the hooks of
the transform contract only (convert, check, tp_plan, hf_names, after_load, bind_optimizer, saves_parameter,
after_optimizer_step, export_state_dict, export)."""

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from titan_lite.checkpoint.hf import EXPORT_INSTEAD, EXPORT_WHAT, export_hf, gather_full_state_dict
from titan_lite.checkpoint.peft import (
    PREFIX,
    PeftAdapter,
    from_peft_tensors,
    read_peft_adapter,
    record_merge,
    to_peft_tensors,
    write_peft_adapter,
)
from titan_lite.config.schema import JobConfig
from titan_lite.distributed import compute_dtype, local_device
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf.names import HFNames
from titan_lite.models.parameters import canonical_name
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms.base import PlanContext, PlanItem, Transform, TransformContext, register_transform
from titan_lite.transforms.lora.adapters import (
    MLP_AS_PARAMETERS,
    adapter_exported_param,
    check_adapter_matches,
    expected_adapter_shapes,
    merge_adapters,
    module_of,
    peft_config,
    pissa_as_lora,
    without_pissa_init,
)
from titan_lite.transforms.lora.experts import (
    LoRAGroupedExperts,
    adapted_experts,
    check_expert_options,
    expert_adapter_modules,
    family_gate_up,
    fused_expert_weights,
    merge_expert_adapters,
    peft_expert_tensors,
    peft_target_parameters,
)
from titan_lite.transforms.lora.fold import fold_blocker, fold_report, folded
from titan_lite.transforms.lora.module import ADAPTER_PARAMS, PISSA_INIT_PARAMS, LoRALinear, adapters_off
from titan_lite.transforms.lora.mxfp4_base import MXFP4, check_mxfp4, mxfp4_experts
from titan_lite.transforms.lora.options import PROJECTIONS, LoraOptions, projection_parent
from titan_lite.transforms.lora.qlora import (
    NF4,
    NF4LoRALinear,
    block_linear_shapes,
    check_nf4,
    checksum_tensors,
    dense_state_dict,
    dequantize_memory,
    init_dora_magnitudes_nf4,
    nf4_param_bytes,
    plan_line,
    quantize_frozen_linears,
)
from titan_lite.transforms.lora.sparse import (
    check_base_sparsity,
    check_keep_sparsity,
    keep_sparsity_enabled,
    sparsity_marker,
)
from titan_lite.transforms.lora.tp import lora_style
from titan_lite.transforms.lora.weights import (
    bits_checksum,
    init_dora_magnitudes,
    load_adapter_tensors,
    pissa_initialise,
    refactor_adapters,
    restart_optimizer_state,
)
from titan_lite.transforms.mxfp4 import dense_experts, load_packed_experts, packed_hf_tensors
from titan_lite.transforms.mxfp4 import plan as mxfp4_plan
from titan_lite.transforms.mxfp4.experts import NOT_IN_HF as PACKED_NOT_IN_HF

logger = logging.getLogger("titan_lite")
NOT_IN_HF = r"\.(lora_a|lora_b|magnitude|pissa_a0|pissa_b0)$"


def lora_modules(model_parts: list[nn.Module]) -> list[tuple[str, LoRALinear]]:
    """(canonical name, module) of every LoRALinear this rank holds, in a fixed order."""
    return [(canonical_name(n), m) for part in model_parts for n, m in part.named_modules()
            if isinstance(m, LoRALinear)]


def is_main_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


@register_transform("lora")
class LoraTransform(Transform):
    name = "lora"

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        self.options = LoraOptions.from_section(cfg.lora)
        self.c = cfg.lora
        self.parallel_dims: ParallelDims | None = None
        self.model_args: LlamaArgs | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.frozen_fingerprint: tuple[int, int] | None = None
        self.model_parts: list[nn.Module] = []
        self.keep_sparsity = keep_sparsity_enabled(cfg)
        self.nf4 = cfg.lora.base_dtype == NF4
        self.mxfp4 = cfg.lora.base_dtype == MXFP4
        self._nf4_names: set[str] | None = None
        self._reported: list[str] = []
        self._fold_reported = False

    # ------------------------------------------------------------------------------ which parameters train

    def trains(self, name: str) -> bool:
        """Adapters and the train_modules' parameters train; every other parameter is frozen."""
        module, param = module_of(name)
        return param in ADAPTER_PARAMS or self.options.is_train_module(module)

    def nf4_weights(self, model_args: LlamaArgs) -> set[str]:
        """The frozen block linear weights an NF4 base stores in 4 bits (none unless base_dtype = 'nf4')."""
        if not self.nf4:
            return set()
        return {n for n in block_linear_shapes(model_args) if not self.trains(n)}

    def is_base(self, name: str) -> bool:
        """Frozen weights of the model (held in base_dtype); PiSSA's initial factors are adapter state, not base."""
        return not self.trains(name) and module_of(name)[1] not in PISSA_INIT_PARAMS

    # ------------------------------------------------------------------------------ hooks

    def convert(self, model: nn.Module) -> None:
        for key, block in model.layers.items():
            if block.moe_enabled and self.mxfp4:
                block.moe.experts = mxfp4_experts(block.moe.experts, self.expert_specs(int(key)))
            elif block.moe_enabled and self.options.expert_groups:
                block.moe.experts = adapted_experts(block.moe.experts, self.expert_specs(int(key)))
            for short in self.options.targets_of(model.args, int(key)):
                parent_name = projection_parent(model.args, int(key), short)
                parent, name = block.get_submodule(parent_name), f"layers.{key}.{parent_name}.{short}"
                linear, spec = getattr(parent, short), self.options.spec(name)
                module_class = NF4LoRALinear if self.nf4 else LoRALinear
                with torch.device(linear.weight.device):  # the meta device: nothing is allocated
                    adapted = module_class(linear.in_features, linear.out_features, spec.rank, spec.scale,
                                         self.c.dropout, self.c.use_dora, self.c.init, keep_init=self.options.pissa,
                                         keep_sparsity=self.keep_sparsity, bias=linear.bias is not None)
                setattr(parent, short, adapted)
        self.freeze_and_cast(model)

    def expert_specs(self, layer: int) -> dict[str, tuple[int, float]]:
        """(rank, scale) of each adapted expert group of a layer."""
        specs = {g: self.options.spec(f"layers.{layer}.moe.experts.{g}") for g in self.options.expert_groups}
        return {g: (spec.rank, spec.scale) for g, spec in specs.items()}

    def freeze_and_cast(self, model: nn.Module) -> None:
        """requires_grad from `trains`; frozen base weights in base_dtype (a tied weight is replaced once). An NF4
        base is held in the run's dtype (training.dtype) until after_load quantizes its block linears; an MXFP4
        base's experts are packed already, its other frozen weights in the run's dtype."""
        packed = self.nf4 or self.mxfp4
        dtype = getattr(torch, self.cfg.training.dtype if packed else self.c.base_dtype)
        replaced: dict[int, nn.Parameter] = {}
        for module_name, module in model.named_modules():
            for local, param in list(module.named_parameters(recurse=False)):
                name = f"{module_name}.{local}" if module_name else local
                if id(param) not in replaced:
                    new = param
                    if self.is_base(name) and param.dtype != dtype and param.is_floating_point():
                        new = nn.Parameter(param.detach().to(dtype))
                    replaced[id(param)] = new.requires_grad_(self.trains(name))
                module.register_parameter(local, replaced[id(param)])

    def check(self, model_args: LlamaArgs, parallel_dims: ParallelDims) -> None:
        if self.mxfp4:  # first: the other checks' advice assumes a base this model can have
            check_mxfp4(self.cfg, model_args)
        self.options.check_model(self.cfg, model_args)
        report = self.options.match_report(model_args)  # an entry that matches nothing is refused before launch
        if is_main_rank() and report != self._reported:
            for line in report:
                logger.info(line)
            self._reported = report
        check_expert_options(self.options, model_args, self.keep_sparsity)
        check_keep_sparsity(self.cfg)
        self.check_layout(parallel_dims)
        self.check_peft_form(model_args)
        if model_args.is_latent and parallel_dims is not None and parallel_dims.tp_enabled:
            raise ConfigError("'model.converters' has 'lora' with tensor parallelism, which is not checked yet on "
                              "DeepSeek-V3's latent attention; use FSDP, EP, CP or PP")
        self._nf4_names = self.nf4_weights(model_args)
        if self.nf4:
            check_nf4(self.cfg, model_args, parallel_dims, sorted(self._nf4_names))
        if self.c.adapter_path is not None:
            check_adapter_matches(self.options, model_args, self.c.adapter_path)

    def check_peft_form(self, args: LlamaArgs) -> None:
        """DoRA on the MLPs of a MLP_AS_PARAMETERS family has no PEFT adapter to export."""
        mlp = [m for m in self.options.adapted_modules(args) if m.rsplit(".", 1)[1] in ("w1", "w2", "w3")]
        if self.c.use_dora and mlp and args.family in MLP_AS_PARAMETERS and self.cfg.checkpoint.last_save_in_hf:
            raise ConfigError(f"'lora.use_dora' on {args.family}'s dense and shared-expert MLPs ({mlp[0]}, ...) has "
                              "no PEFT form to export: peft reads gate_proj/up_proj/down_proj there as the routed "
                              "experts', and its target_parameters take no DoRA; adapt the attention only")

    def check_layout(self, dims: ParallelDims) -> None:
        """Gathering full weights needs them on the device; a frozen base in a lower precision than the compute
        dtype needs something that casts every weight to the compute dtype (FSDP's mixed precision, or autocast)."""
        device = local_device().type
        gathers = self.options.pissa or self.c.use_dora or self.c.refactor_freq or self.c.adapter_path
        if self.cfg.training.enable_cpu_offload and device != "cpu" and gathers:
            raise ConfigError("'training.enable_cpu_offload' keeps sharded weights on the host, but PiSSA, DoRA, "
                              "re-factoring and adapter_path gather full weights on the accelerator; turn one off")
        compute = compute_dtype(self.cfg.training.mixed_precision_param, device)
        if self.c.base_dtype in ("float32", NF4, MXFP4) or dims.fsdp_enabled or dims.dp_replicate_enabled:
            return
        if compute == torch.float32:
            raise ConfigError(f"'lora.base_dtype' = '{self.c.base_dtype}' with float32 compute and no data "
                              "parallelism: nothing casts the frozen embeddings, norms and head to the compute "
                              "dtype; use FSDP or HSDP (their mixed precision casts), or 'training."
                              "mixed_precision_param' = 'bfloat16'")

    def tp_plan(self, plan: dict, scope: str) -> dict:
        if scope == "block":
            for short in self.options.targets:
                key = f"{PROJECTIONS[short][0]}.{short}"
                if key in plan:  # an MoE block has no dense feed-forward (its experts are replicated with adapters)
                    plan[key] = lora_style(plan[key])
        return plan

    def hf_names(self, names: HFNames) -> None:
        names.add_not_in_hf(NOT_IN_HF)
        if self.mxfp4:
            names.add_not_in_hf(PACKED_NOT_IN_HF)

    @torch.no_grad()
    def after_load(self, ctx: TransformContext) -> None:
        self.parallel_dims, self.model_args, self.model_parts = ctx.parallel_dims, ctx.model_args, ctx.model_parts
        modules = lora_modules(ctx.model_parts)
        fresh = not ctx.checkpoint_holds_model  # else the checkpoint brings adapters, residual base and magnitude
        if self.c.adapter_path is not None:
            self.load_adapter(ctx)
        elif self.options.pissa and fresh:
            logger.info(f"lora: PiSSA initialisation ({self.c.init}) of {len(modules)} weights on this rank's "
                        "pipeline stage")
            seed = self.cfg.debug.seed if self.cfg.debug.seed is not None else 0
            pissa_initialise(modules, self.options.niter, seed, self.stage_group())
        if self.mxfp4 and fresh:
            self.load_mxfp4_base(ctx)
        if self.nf4:  # after PiSSA's SVD of the full-precision weights (QPiSSA quantizes the residual)
            count = quantize_frozen_linears(ctx.model_parts, self.nf4_weights(ctx.model_args))
            logger.info(f"lora: {count} frozen block linears on this rank quantized to NF4 (QLoRA)")
        if self.c.use_dora and self.c.adapter_path is None and fresh:
            (init_dora_magnitudes_nf4 if self.nf4 else init_dora_magnitudes)(modules)
        if self.keep_sparsity and fresh:
            check_base_sparsity(modules, self.cfg.lora.keep_sparsity)
        self.log_trainable(ctx.model_parts)
        if fresh:
            self.frozen_fingerprint = bits_checksum(checksum_tensors(self.frozen_parameters(ctx.model_parts)))

    def load_mxfp4_base(self, ctx: TransformContext) -> None:
        folder = ctx.initial_hf_folder
        if folder is None:
            raise ConfigError("lora.base_dtype='mxfp4' reads the experts from the initial Hugging Face folder, which "
                              "this run did not load; set 'checkpoint.initial_load_in_hf' = true")
        kept, quantized = load_packed_experts(ctx.model_parts, folder, ctx.model_args)
        if kept:
            logger.info(f"lora: MXFP4 base: the experts of {kept} MoE layers on this rank kept as {folder} holds them "
                        "(*_blocks / *_scales, bit for bit, never dequantized to a stored copy)")
        if quantized:
            logger.info(f"lora: MXFP4 base: the experts of {quantized} MoE layers on this rank quantized to MXFP4 "
                        f"from {folder}'s unquantized experts, as the release stores them")

    def stage_group(self) -> dist.ProcessGroup | None:
        """The ranks holding this rank's pipeline stage (they share PiSSA's SVDs), or None on one process."""
        dims = self.parallel_dims
        if not dist.is_initialized() or dims is None or dims.world_size // dims.pp == 1:
            return None
        return dims.submesh("stage").get_group()

    def load_adapter(self, ctx: TransformContext) -> None:
        path = self.c.adapter_path
        tensors = from_peft_tensors(read_peft_adapter(path).tensors, ctx.model_args, path)
        wanted = expected_adapter_shapes(self.options, ctx.model_args)
        modules = {canonical_name(n): m for part in ctx.model_parts for n, m in part.named_modules()}
        load_adapter_tensors(modules, {n: t for n, t in tensors.items() if n in wanted})
        logger.info(f"lora: adapters loaded from the PEFT folder {path}")

    def frozen_parameters(self, model_parts: list[nn.Module]) -> list[nn.Parameter]:
        return [p for part in model_parts for n, p in part.named_parameters() if self.is_base(canonical_name(n))]

    def log_trainable(self, model_parts: list[nn.Module]) -> None:
        """Check that exactly the adapters and train_modules have requires_grad after every parallelism was
        applied, and say so (a distributed parameter defaults to requires_grad=True)."""
        named = [(canonical_name(n), p) for part in model_parts for n, p in part.named_parameters()]
        wrong = [n for n, p in named if p.requires_grad != self.trains(n)]
        if wrong:
            raise RuntimeError(f"lora: requires_grad is wrong after parallelisation for {wrong[:3]}")
        adapters = [(n, p) for n, p in named if module_of(n)[1] in ADAPTER_PARAMS]
        full = [(n, p) for n, p in named if p.requires_grad and module_of(n)[1] not in ADAPTER_PARAMS]
        frozen = [(n, p) for n, p in named if not p.requires_grad]
        dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for _, p in frozen})) or "none"
        logger.info(f"lora: trainable = {len(adapters)} adapter tensors ({_numel(adapters):,} parameters) + "
                    f"{len(full)} train_modules tensors ({_numel(full):,}); frozen = {len(frozen)} tensors "
                    f"({_numel(frozen):,} parameters, {dtypes})")

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep the optimizer (re-factoring restarts adapters' state) and check it holds exactly the trainable set."""
        self.optimizer = optimizer
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        trainable = {id(p) for m in self.model_parts for p in m.parameters() if p.requires_grad}
        if held != trainable:
            raise RuntimeError(f"lora: the optimizer holds {len(held)} tensors but {len(trainable)} are trainable")
        logger.info(f"lora: the optimizer holds {len(held)} tensors, exactly the trainable ones")

    def saves_parameter(self, name: str) -> bool:
        """Adapter-only checkpoints hold the adapters; an NF4 weight is never saved (DCP has no NF4 support): a
        resume quantizes it again from the initial weights, deterministically. Nor is an MXFP4 base: a resume reads
        it again from the base's folder."""
        if name in self.nf4_names() or (self.mxfp4 and mxfp4_plan.is_packed(name)):
            return False
        return not self.c.save_adapter_only or adapter_exported_param(self.options, name)

    def nf4_names(self) -> set[str]:
        """The NF4 weights' canonical names (known once `check` has seen the model args)."""
        return self._nf4_names or set()

    def after_optimizer_step(self, model_parts: list[nn.Module], step: int) -> None:
        if self.c.refactor_freq and step % self.c.refactor_freq == 0:
            changed = refactor_adapters(lora_modules(model_parts), self.c.max_spectral_norm)
            if self.optimizer is not None:
                restart_optimizer_state(self.optimizer, changed)
            logger.info(f"lora: re-factored {len(changed) // 2} adapters at step {step} (optimizer state restarted)")

    def export_state_dict(self, state_dict: dict[str, torch.Tensor],
                          model_args: LlamaArgs) -> tuple[dict[str, torch.Tensor], LlamaArgs]:
        """The merged model: W + scale B A (DoRA: rescaled rows) for every adapter; PiSSA's W is the residual, so
        the merge equals the original weight plus the learnt update."""
        state_dict = dense_state_dict(state_dict)  # the NF4 base merges as it was trained: dequantized
        packed: dict[str, torch.Tensor] = {}
        if self.mxfp4:
            state_dict, packed = self.mxfp4_export(state_dict)
        state_dict = merge_expert_adapters(state_dict, {m: self.options.spec(m).scale
                                                        for m in expert_adapter_modules(state_dict)})
        specs = {m: self.options.spec(m) for m in {module_of(n)[0] for n in state_dict if n.endswith(".lora_a")}}
        return {**merge_adapters(state_dict, specs, self.keep_sparsity), **packed}, model_args

    def mxfp4_export(self, state_dict: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        """(the state dict, the release's MXFP4 tensors) of an export: experts without adapters written back as
        they were loaded; adapted ones dequantized (then merged, and written unquantized)."""
        if expert_adapter_modules(state_dict):
            logger.info("lora: the MXFP4 experts are merged with their adapters: the export writes them "
                        "dequantized, unquantized in checkpoint.export_dtype, without a quantization_config")
            return dense_experts(state_dict), {}
        logger.info("lora: the MXFP4 experts have no adapters: the export writes them back as MXFP4 (*_blocks / "
                    "*_scales), bit for bit as loaded")
        return packed_hf_tensors(state_dict)

    def frozen_base(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The frozen base of a state dict for an HF export (an MXFP4 base's experts as loaded)."""
        base = without_adapters(dense_state_dict(state_dict))
        if not self.mxfp4:
            return base
        rest, packed = packed_hf_tensors(base)
        return {**rest, **packed}

    def base_folder(self, folder: Path, step: int) -> Path | None:
        """Where the base the adapters apply to is written as an HF folder: when it is not loaded from one (a seeded
        initialisation or a DCP checkpoint), the adapter alone could not be merged, served or loaded by PEFT."""
        if self.cfg.checkpoint.initial_load_in_hf or self.options.pissa:
            return None  # the HF base folder exists already; PiSSA writes its residual base instead
        return folder / f"step-{step}-base-hf"

    def exports_full_model(self) -> bool:
        return self.cfg.lora.export_merged

    def export_folders(self, folder: Path, step: int) -> list[Path]:
        if not self.cfg.checkpoint.last_save_in_hf:
            return []
        pissa = [folder / f"step-{step}-pissa-adapter", folder / f"step-{step}-pissa-residual-base"]
        return [folder / f"step-{step}-adapter", *filter(None, [self.base_folder(folder, step)]),
                *(pissa if self.options.pissa else [])]

    def export(self, model_parts: list[nn.Module], folder: Path, step: int) -> None:
        """With checkpoint.last_save_in_hf (the run's Hugging Face export): the PEFT adapter, and the base it applies
        to where that is not an HF folder already; nothing without it."""
        self.check_frozen_unchanged(model_parts)
        if not self.cfg.checkpoint.last_save_in_hf:
            return
        base = self.base_folder(folder, step)
        if base is not None:
            export_hf(model_parts, self.model_args, str(base), getattr(torch, self.cfg.checkpoint.export_dtype),
                      self.cfg.model.hf_assets_path, self.parallel_dims,
                      convert=lambda sd, args: (self.frozen_base(sd), args))
            logger.info(f"lora: the frozen base (not loaded from a Hugging Face folder) written to {base}; "
                        f"step-{step}-adapter applies to it")
        state = gather_full_state_dict(model_parts, torch.float32, self.parallel_dims,
                                       keep=lambda n: adapter_exported_param(self.options, n))
        if state is not None:
            self.write_adapters(state, folder, step, base)
            merged = folder / f"step-{step}-hf"  # the run's merged export, written just before
            if self.cfg.checkpoint.last_save_in_hf and merged.is_dir():
                record_merge(merged, folder / f"step-{step}-adapter")
        if self.options.pissa:
            out = folder / f"step-{step}-pissa-residual-base"
            export_hf(model_parts, self.model_args, str(out), getattr(torch, self.cfg.checkpoint.export_dtype),
                      self.cfg.model.hf_assets_path, self.parallel_dims,
                      convert=lambda sd, args: (self.frozen_base(sd), args))
            logger.info(f"lora: PiSSA's residual base (the frozen weights W - s B0 A0) written to {out}; "
                        f"step-{step}-pissa-adapter applies to it")

    def check_frozen_unchanged(self, model_parts: list[nn.Module]) -> None:
        if self.frozen_fingerprint is None:
            return
        frozen = self.frozen_parameters(model_parts)
        if bits_checksum(checksum_tensors(frozen)) != self.frozen_fingerprint:
            logger.error("lora: the frozen weights on this rank CHANGED during training (a bug: please report it)")
        else:
            logger.info(f"lora: the {len(frozen)} frozen tensors on this rank are bitwise unchanged since loading")

    def write_adapters(self, state: dict[str, torch.Tensor], folder: Path, step: int,
                       base_folder: Path | None = None) -> None:
        base = str(base_folder or self.cfg.checkpoint.initial_load_path or self.cfg.model.hf_assets_path)
        experts = expert_adapter_modules(state)
        modules = sorted({module_of(n)[0] for n in state if n.endswith(".lora_a")} - set(experts), key=_layer_order)
        args = self.model_args
        out = folder / f"step-{step}-adapter"
        if not self.options.pissa:
            config = peft_config(self.options, modules, base, mlp_as_parameters=args.family in MLP_AS_PARAMETERS)
            linear = {n: t for n, t in state.items() if module_of(n)[0] not in experts and ".moe.experts.w" not in n}
            tensors = {**to_peft_tensors(linear, args), **peft_expert_tensors(state, PREFIX, family_gate_up(args)),
                       **fused_expert_weights(state, PREFIX)}
            if experts:
                config["target_parameters"] = [*config.get("target_parameters", []), *peft_target_parameters(state)]
            write_peft_adapter(out, PeftAdapter(config, tensors), readme(self.c, "original", sparse=self.keep_sparsity),
                               sparsity_marker() if self.keep_sparsity else None, EXPORT_WHAT, EXPORT_INSTEAD)
            logger.info(f"lora: PEFT adapter of step {step} written to {out}")
            return
        as_parameters = args.family in MLP_AS_PARAMETERS
        write_peft_adapter(out, PeftAdapter(peft_config(self.options, modules, base, True, as_parameters),
                                            to_peft_tensors(pissa_as_lora(state), args)), readme(self.c, "converted"),
                           what=EXPORT_WHAT, instead=EXPORT_INSTEAD)
        residual = folder / f"step-{step}-pissa-adapter"
        write_peft_adapter(residual, PeftAdapter(peft_config(self.options, modules, None, False, as_parameters),
                                                 to_peft_tensors(without_pissa_init(state), args)),
                           readme(self.c, "residual", f"step-{step}-pissa-residual-base"), what=EXPORT_WHAT,
                           instead=EXPORT_INSTEAD)
        logger.info(f"lora: PiSSA adapters of step {step}: {out} is a plain LoRA of rank {2 * self.c.rank} for the "
                    f"ORIGINAL base; {residual} (rank {self.c.rank}) applies to the residual base")

    def base_function(self, model_parts: list[nn.Module]):
        """The frozen base alone: every adapter switched off (PiSSA's initial factors added back)."""
        experts = [m for part in model_parts for m in part.modules() if isinstance(m, LoRAGroupedExperts)]
        return adapters_off([m for _, m in lora_modules(model_parts)] + experts)

    def folded_for_decoding(self, model_parts: list[nn.Module]):
        """The adapters that fold exactly (float32 weights and compute) folded into their base weights; the line
        saying which, at the first rollout."""
        compute = compute_dtype(self.cfg.training.mixed_precision_param, local_device().type)
        if self.cfg.training.enable_cpu_offload and local_device().type != "cpu":
            blocked = {"training.enable_cpu_offload keeps the weights on the host": lora_modules(model_parts)}
            foldable = []
        else:
            blocked, foldable = {}, []
            for name, module in lora_modules(model_parts):
                reason = fold_blocker(module, compute)
                (blocked.setdefault(reason, []) if reason else foldable).append((name, module))
        if not self._fold_reported:
            experts = sum(isinstance(m, LoRAGroupedExperts) for part in model_parts for m in part.modules())
            logger.info(fold_report([m for _, m in foldable], blocked, experts))
            self._fold_reported = True
        return folded([m for _, m in foldable]) if foldable else None

    # ------------------------------------------------------------------------------ plan hooks

    def plan_lines(self, model_args: LlamaArgs) -> list[str]:
        if self.mxfp4:
            return [mxfp4_plan.plan_line(model_args)]
        if not self.nf4:
            return []
        return [plan_line(model_args, self.nf4_weights(model_args), getattr(torch, self.cfg.training.dtype).itemsize)]

    def param_bytes(self, name: str, param: torch.Tensor) -> float | None:
        return nf4_param_bytes(name, param, self.nf4_names())

    def gathered_bytes(self, name: str, param: torch.Tensor) -> float | None:
        if self.mxfp4:
            return mxfp4_plan.packed_gathered_bytes(name)
        return nf4_param_bytes(name, param, self.nf4_names())  # FSDP gathers the codes, scales and factors

    def plan_memory(self, ctx: PlanContext) -> list[PlanItem]:
        if self.mxfp4:
            return mxfp4_plan.dequantize_memory(ctx)
        return dequantize_memory(ctx, self.nf4_names())


SPARSE_NOTE = (
    "\n\nTrained with `lora.keep_sparsity`: the update is masked by the base's zeros, W + (s B A) * (W != 0). PEFT "
    "applies this adapter DENSELY (W + s B A), which fills the pruned positions and is not the trained model: ship "
    "the masked merge instead (`scripts/merge_lora.py` applies the mask, as `titan_lite_sparsity.json` here asks, "
    "and the run's `last_save_in_hf` export is already masked).")


def without_adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in state.items() if not n.endswith((".lora_a", ".lora_b", ".magnitude", ".pissa_a0",
                                                                ".pissa_b0"))}


def _numel(named: list[tuple[str, torch.Tensor]]) -> int:
    return sum(p.numel() for _, p in named)


def _layer_order(module: str) -> tuple:
    parts = module.split(".")
    return (int(parts[1]), module) if parts[0] == "layers" else (-1, module)


def readme(c, kind: str, residual_folder: str = "", sparse: bool = False) -> str:
    """What an exported adapter folder is and how to load it."""
    what = {
        "original": "A LoRA adapter for the original base model.",
        "converted": (f"PiSSA, converted: a plain LoRA of rank {2 * c.rank} (the trained adapter and the negated "
                      "initial one, side by side) for the ORIGINAL base model; it reproduces the trained PiSSA model."),
        "residual": (f"PiSSA's trained adapter (rank {c.rank}) for the RESIDUAL base in '{residual_folder}' (the "
                     "original weights minus their top singular directions); it does not apply to the original base."),
    }[kind]
    if sparse:
        what += SPARSE_NOTE
    return (f"# titan_lite LoRA adapter\n\n{what}\n\nLoad it with PEFT:\n\n```python\nfrom peft import PeftModel\n"
            "model = PeftModel.from_pretrained(base_model, this_folder)\n```\n\nor merge it with "
            "`python scripts/merge_lora.py --base <hf folder> --adapter <this folder> --output_dir <dir>`.\n")
