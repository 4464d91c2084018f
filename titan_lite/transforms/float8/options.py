"""The float8 options of a run ([quantize.linear.float8]): the recipe, which linears float8 serves, whether the
matmul is emulated, and the combinations refused before launch."""

import dataclasses
import difflib
from dataclasses import dataclass

import torch

from titan_lite.config.schema import JobConfig
from titan_lite.errors import ConfigError
from titan_lite.parallel.parallel_dims import ParallelDims

NAME = "quantize.linear.float8"
KEY = "quantize.linear.float8"
# float8 matmuls (torch._scaled_mm) need both dimensions of every operand divisible by 16.
ALIGNMENT = 16
# Compute capability of the first NVIDIA GPUs with float8 tensor cores (Ada, Hopper).
MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Float8Options:
    recipe: str  # tensorwise | rowwise | rowwise_with_gw_hp
    filter_fqns: tuple[str, ...]
    all_gather: bool  # float8 FSDP all-gather of the weights
    precompute: bool  # one all-reduce for all weight scales after each optimizer step
    emulate: bool  # what the user asked for; the device may force it (see `emulates`)
    tp_degree: int

    @classmethod
    def from_config(cls, cfg: JobConfig) -> "Float8Options":
        c = cfg.quantize.linear.float8
        return cls(recipe=c.recipe_name or "tensorwise", filter_fqns=tuple(c.filter_fqns),
                   all_gather=c.enable_fsdp_float8_all_gather,
                   precompute=c.precompute_float8_dynamic_scale_for_fsdp, emulate=c.emulate,
                   tp_degree=cfg.parallelism.tensor_parallel_degree)

    @property
    def tensorwise(self) -> bool:
        return self.recipe == "tensorwise"

    def emulates(self, device_type: str) -> bool:
        """On CPU always: torch._scaled_mm there is a reference kernel about 1,000x slower than an fp32 matmul."""
        return self.emulate or device_type == "cpu"

    def torchao_config(self, device_type: str):
        # lazy: torchao loads only when float8 is used
        from torchao.float8 import Float8LinearConfig

        base = Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(base, emulate=self.emulates(device_type),
                                   enable_fsdp_float8_all_gather=self.all_gather)

    def filtered(self, fqn: str) -> bool:
        """Left in high precision by filter_fqns (a substring of the module's name, as in torchtitan)."""
        return any(pattern in fqn for pattern in self.filter_fqns)

    def unservable(self, out_features: int, in_features: int) -> str | None:
        """Why float8 cannot serve a linear of this shape (each rank's shard under TP included), or None."""
        shards = [("", out_features, in_features)]
        if self.tp_degree > 1:  # colwise splits the output dim, rowwise the input dim
            shards += [(" per TP shard", out_features // self.tp_degree, in_features),
                       (" per TP shard", out_features, in_features // self.tp_degree)]
        for where, rows, cols in shards:
            if rows % ALIGNMENT or cols % ALIGNMENT:
                return f"{out_features}x{in_features}{where} is not a multiple of {ALIGNMENT}"
        return None

    def describe(self, device_type: str) -> str:
        parts = [self.recipe]
        if self.all_gather:
            parts.append("float8 all-gather" + (" with scale precompute" if self.precompute else ""))
        if self.emulates(device_type):
            parts.append("emulated")
        return ", ".join(parts)


def check_options(cfg: JobConfig, options: Float8Options, dims: ParallelDims, device_type: str) -> None:
    """The combinations torchao or the hardware cannot serve, each refused with one line before launch."""
    if options.all_gather and not options.tensorwise:
        raise ConfigError(f"'{KEY}.enable_fsdp_float8_all_gather' needs recipe_name 'tensorwise' (the weight is "
                          f"cast with one scale before the all-gather), but recipe_name is '{options.recipe}'")
    if options.precompute and not options.all_gather:
        raise ConfigError(f"'{KEY}.precompute_float8_dynamic_scale_for_fsdp' precomputes the scales of the float8 "
                          f"all-gather: set '{KEY}.enable_fsdp_float8_all_gather' too")
    if "lora" in cfg.model.converters and cfg.lora.base_dtype == "nf4":
        raise ConfigError(f"'{NAME}' cannot convert an NF4 base ('lora.base_dtype' = 'nf4', QLoRA): an NF4 weight "
                          "has no float8 path; use one of the two")
    if device_type == "cuda" and not options.emulate:
        capability = torch.cuda.get_device_capability()
        if capability < MIN_CAPABILITY:
            raise ConfigError(f"'{NAME}' needs a GPU with float8 (compute capability 8.9 or above), this one has "
                              f"{capability[0]}.{capability[1]}; set '{KEY}.emulate' to emulate float8 (for "
                              "correctness, not speed)")


def check_filter_fqns(options: Float8Options, linears: list[str]) -> None:
    """Every filter_fqns entry names some linear (a substring of its name): an entry that matches none (a typo such
    as 'outptu') would leave nothing out, and the linear meant for high precision would train in float8."""
    for entry in options.filter_fqns:
        if any(entry in name for name in linears):
            continue
        # every dotted tail of a name (output, wq, attention.wq, ...) is an entry that would match
        tails = sorted({".".join(name.split(".")[i:]) for name in linears for i in range(len(name.split(".")))})
        close = difflib.get_close_matches(entry, tails, n=3, cutoff=0.6)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
        raise ConfigError(f"'{KEY}.filter_fqns' entry {entry!r} matches no linear of the model, so it keeps none in "
                          f"high precision ({hint}the linears are named like '{linears[0]}' and '{linears[-1]}'; "
                          "an entry matches every name containing it)")
