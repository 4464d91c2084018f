"""The 'quantize.linear.float8' transform: torchao float8 training of the model's linears (torchtitan's converter),
under FSDP/HSDP (float8 all-gather, scale precompute), TP (float8 styles), PP, CP, AC and compile."""

import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from titan_lite.config.schema import JobConfig
from titan_lite.distributed import device_type
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.decoder import Llama
from titan_lite.models.parameters import canonical_name
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms.base import PlanContext, PlanItem, Transform, TransformContext, register_transform
from titan_lite.transforms.float8.adapters import Float8BaseLinear, takes_base_linear
from titan_lite.transforms.float8.comms import install_byte_all_gather
from titan_lite.transforms.float8.options import NAME, Float8Options, check_filter_fqns, check_options
from titan_lite.transforms.float8.plan import plan_items
from titan_lite.transforms.float8.tp import float8_block_plan

logger = logging.getLogger("titan_lite")


@register_transform(NAME)
class Float8Transform(Transform):
    """Swaps nn.Linear for torchao's Float8Linear (weights stay in high precision; the matmuls run in float8)."""

    name = NAME

    def __init__(self, cfg: JobConfig):
        super().__init__(cfg)
        self.options = Float8Options.from_config(cfg)
        self.device_type = device_type()
        self.model: nn.Module | None = None  # the converted meta model, for the TP plan
        self.kept: dict[str, str] = {}  # linears left in high precision -> why
        self.weights: set[str] = set()  # canonical names of the Float8Linear weights
        self.converted = 0
        self.config = None  # torchao's Float8LinearConfig, built at convert

    # ------------------------------------------------------------------------------ hooks

    def convert(self, model: nn.Module) -> None:
        # lazy: torchao loads only when float8 is used
        from torchao.float8 import convert_to_float8_training

        self.config = self.options.torchao_config(self.device_type)
        kept: dict[str, str] = {}

        def serves(module: nn.Module, fqn: str) -> bool:
            if type(module) is not nn.Linear:
                return False
            reason = self.reason_kept(canonical_name(fqn), module.out_features, module.in_features)
            if reason is not None:
                kept[canonical_name(fqn)] = reason
            return reason is None

        convert_to_float8_training(model, module_filter_fn=serves, config=self.config)
        bases = self.wire_adapter_bases(model, kept)
        self.model, self.kept = model, kept
        self.weights = {canonical_name(f"{fqn}.weight") for fqn, m in model.named_modules() if is_float8(m)}
        self.converted = len(self.weights) + bases

    def reason_kept(self, name: str, out_features: int, in_features: int) -> str | None:
        """Why a linear stays in high precision (filter_fqns, or shapes float8 cannot serve), or None."""
        return "filter_fqns" if self.options.filtered(name) else self.options.unservable(out_features, in_features)

    def wire_adapter_bases(self, model: nn.Module, kept: dict[str, str]) -> int:
        """Modules that keep a frozen base weight of their own (LoRA's) get a float8 base product. Runs at convert
        (adapters listed before this transform) and after parallelism (adapters listed after it)."""
        count = 0
        for fqn, module in model.named_modules():
            if not takes_base_linear(module) or module.base_linear is not None:
                continue
            name, (out_f, in_f) = canonical_name(fqn), module.weight.shape
            reason = self.reason_kept(name, out_f, in_f)
            if reason is None:
                module.base_linear = Float8BaseLinear(in_f, out_f, self.config)
                count += 1
            else:
                kept[name] = reason
        return count

    def summary(self) -> list[str]:
        """What runs in float8, and the linears left in high precision with why."""
        lines = [f"{NAME}: {self.converted} linear(s) in float8 ({self.options.describe(self.device_type)})"]
        if self.kept:
            listed = "; ".join(f"{name} ({why})" for name, why in self.kept.items())
            lines.append(f"{NAME}: {len(self.kept)} linear(s) left in high precision: {listed}")
        return lines

    def after_load(self, ctx: TransformContext) -> None:
        for line in self.summary():
            logger.info(line)
        if self.device_type == "cpu":
            logger.info(f"{NAME}: on CPU the float8 matmul is emulated (float8 casts, high-precision matmul) "
                        "whatever 'emulate' says: the real one is a reference kernel ~1,000x slower; float8 on CPU "
                        "is for correctness, not speed")

    def check(self, model_args: LlamaArgs, parallel_dims: ParallelDims) -> None:
        check_options(self.cfg, self.options, parallel_dims, self.device_type)
        if model_args.is_latent and parallel_dims is not None and parallel_dims.tp_enabled:
            raise ConfigError("'model.converters' has 'quantize.linear.float8' with tensor parallelism, which is not "
                              "checked yet on DeepSeek-V3's latent attention; use FSDP, EP, CP or PP")
        with torch.device("meta"):
            linears = [name for name, m in Llama(model_args).named_modules() if isinstance(m, nn.Linear)]
        check_filter_fqns(self.options, linears)

    def tp_plan(self, plan: dict[str, ParallelStyle], scope: str) -> dict[str, ParallelStyle]:
        """tensorwise: torchao's float8 TP styles (float8 activations in the sequence all-gathers); the rowwise
        recipes keep the plain styles, which shard Float8Linear's high-precision weight like nn.Linear's. So does
        a backend without float8 dtypes (gloo): there each Float8Linear casts its gathered input with the same
        global scale the float8 styles compute before the gather, so only the bytes moved differ."""
        if scope != "block" or not self.options.tensorwise or self.model is None or self.device_type == "cpu":
            return plan
        return float8_block_plan(plan, self.model)

    def after_parallelize(self, model: nn.Module, parallel_dims: ParallelDims) -> None:
        self.wire_adapter_bases(model, {})
        if self.options.all_gather:
            install_byte_all_gather(model)
            model.register_state_dict_post_hook(plain_state_dict)

    def after_optimizer_step(self, model_parts: list[nn.Module], step: int) -> None:
        if not self.options.precompute:
            return
        # lazy: torchao loads only when float8 is used
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    def export_state_dict(self, state_dict: dict[str, torch.Tensor],
                          model_args: LlamaArgs) -> tuple[dict[str, torch.Tensor], LlamaArgs]:
        """Plain tensors: under the float8 all-gather torchao wraps each weight in a subclass (same values)."""
        return {name: high_precision(t) for name, t in state_dict.items()}, model_args

    # ------------------------------------------------------------------------------ plan hooks

    def plan_lines(self, model_args: LlamaArgs) -> list[str]:
        planned = self.options.describe("cuda")
        return [line.replace(self.options.describe(self.device_type), planned) for line in self.summary()]

    def gathered_bytes(self, name: str, param: torch.Tensor) -> float | None:
        """The float8 all-gather moves and holds float8 weights: 1 byte per element."""
        return 1.0 if self.options.all_gather and name in self.weights else None

    def plan_memory(self, ctx: PlanContext) -> list[PlanItem]:
        modules = [(canonical_name(n), m) for part in ctx.model_parts for n, m in part.named_modules()
                   if is_float8(m) or getattr(m, "base_linear", None) is not None]
        return plan_items(ctx, modules)


def is_float8(module: nn.Module) -> bool:
    # lazy: torchao loads only when float8 is used
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def high_precision(tensor: torch.Tensor) -> torch.Tensor:
    """The weight itself: under the float8 all-gather torchao wraps each weight (or a DTensor's local shard) in a
    subclass that casts before the all-gather; the wrapped tensor shares its storage."""
    # lazy: torchao loads only when float8 is used
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    if isinstance(tensor, DTensor) and isinstance(tensor._local_tensor, WeightWithDynamicFloat8CastTensor):
        return DTensor.from_local(tensor._local_tensor._tensor.detach(), tensor.device_mesh, tensor.placements,
                                  run_check=False, shape=tensor.shape, stride=tensor.stride())
    return tensor._tensor.detach() if isinstance(tensor, WeightWithDynamicFloat8CastTensor) else tensor


def plain_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: checkpoints (and anything else reading the state dict) get plain high-precision
    tensors, which load back in place into the wrapped weights."""
    for name, tensor in state_dict.items():
        state_dict[name] = high_precision(tensor)
