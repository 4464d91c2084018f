"""titan_lite: a PyTorch-native distributed trainer for Llama models; refuses a torch older than it needs."""

import importlib.metadata as _metadata
import sys as _sys

# The oldest torch titan_lite runs on: torch.accelerator's device and memory calls and the public FSDP2 API are all
# there from 2.9 (pyproject.toml says the same; scripts/setup_env.sh checks it before installing).
MIN_TORCH = (2, 9)


def _torch_release(version: str) -> tuple[int, ...]:
    """(major, minor) of a torch version string such as '2.11.0+cu130' or '2.12.0a0+git1234'."""
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split("+")[0].split(".")[:2])


try:
    _found = _metadata.version("torch")  # metadata only: importing titan_lite does not import torch
except _metadata.PackageNotFoundError:  # a source build without metadata: no check
    _found = None
if _found is not None and _torch_release(_found) < MIN_TORCH:
    _sys.stderr.write(f"error: titan_lite needs torch >= {'.'.join(map(str, MIN_TORCH))}, found torch {_found}; "
                      f"install a newer torch (your CUDA build, or {_sys.executable} -m pip install 'torch>=2.9')\n")
    raise SystemExit(2)
