"""float8 training of linears with torchao (torchtitan's 'quantize.linear.float8' converter)."""

import logging

from titan_lite.transforms.float8.transform import Float8Transform


def _drop(logger: str, text: str) -> None:
    logging.getLogger(logger).addFilter(lambda record: text not in record.getMessage())


# torchao's import on a CPU-only torch warns that its GPU-only extensions (_C_cutlass_90a, _C_mxfp8) failed to load,
# and torch that torchao registers an Enum with pytree: harmless, and noise before a one-line error.
_drop("torchao", "Failed to load")
_drop("torch.utils._pytree", "KernelPreference")

__all__ = ["Float8Transform"]
