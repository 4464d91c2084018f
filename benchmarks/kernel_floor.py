"""The kernel floor of a training step: the step's own matmul and attention kernels replayed alone, back to back.

A step can be no faster than the GEMMs and attention kernels it has to run; everything else (elementwise ops, the
optimizer, autograd's bookkeeping) is what an implementation can still cut. Recording one real step at the aten
level and replaying exactly those calls (same shapes, strides and arguments, on copies of the recorded inputs)
measures that floor on this machine, for any implementation, without knowing its code.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default, aten.addmm_.default, aten.bmm.default, aten.baddbmm.default}


def _is_attention(func: torch._ops.OpOverload) -> bool:
    return "scaled_dot_product" in func.name()


def matmul_flops(func: torch._ops.OpOverload, args: tuple) -> int:
    """2*M*N*K (times the batch for bmm/baddbmm) of one recorded matmul call."""
    a, b = (args[0], args[1]) if func in (aten.mm.default, aten.bmm.default) else (args[1], args[2])
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


@dataclass
class KernelCalls:
    """The matmul and attention calls of one recorded step, with copies of their inputs."""
    calls: list[tuple[torch._ops.OpOverload, tuple, dict]] = field(default_factory=list)

    @property
    def matmul_flops(self) -> int:
        return sum(matmul_flops(f, a) for f, a, _ in self.calls if f in _MATMULS)

    def of_kind(self, kind: str) -> list[tuple[torch._ops.OpOverload, tuple, dict]]:
        """The "matmul" calls, or the "attention" ones."""
        return [c for c in self.calls if (c[0] in _MATMULS) == (kind == "matmul")]

    def count(self, kind: str) -> int:
        return len(self.of_kind(kind))

    def replay_seconds(self, kind: str) -> float:
        """Wall time of one pass over the recorded calls of one kind."""
        chosen = self.of_kind(kind)
        start = time.perf_counter()
        for func, args, kwargs in chosen:
            func(*args, **kwargs)
        return time.perf_counter() - start


class _Recorder(TorchDispatchMode):
    def __init__(self, into: KernelCalls):
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MATMULS or _is_attention(func):
            # Copies taken before the call: an in-place matmul (addmm_) must replay on its input, not its result.
            def copy(x):
                return x.detach().clone(memory_format=torch.preserve_format) if isinstance(x, torch.Tensor) else x
            self.into.calls.append((func, tree_map(copy, args), tree_map(copy, kwargs)))
        return func(*args, **kwargs)


def record_step(step: Callable[[], object]) -> KernelCalls:
    """Run one step, keeping its matmul and attention calls (forward and backward)."""
    calls = KernelCalls()
    with _Recorder(calls):
        step()
    return calls


def floor_summary(calls: KernelCalls, matmul_s: list[float], attention_s: list[float]) -> dict:
    """The kernel floor from timed replays of one recorded step: median matmul + median attention seconds."""
    matmul, attention = statistics.median(matmul_s), statistics.median(attention_s)
    return {"matmul_s": matmul, "attention_s": attention, "floor_s": matmul + attention,
            "matmul_calls": calls.count("matmul"), "attention_calls": calls.count("attention"),
            "matmul_gflops": calls.matmul_flops / 1e9}
