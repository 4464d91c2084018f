"""Files the checkpoint writers leave for other people to read: safetensors written with the user's umask."""

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def umask_mode(mode: int = 0o666) -> int:
    """`mode` less the process's umask (0o644 under the usual 022), as open() would create a file."""
    current = os.umask(0)
    os.umask(current)
    return mode & ~current


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path) -> None:
    """safetensors' save_file, then the permissions of a file created with open(): save_file writes through a
    private temporary file (mode 0600), which would leave a shared model readable by its owner only."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, umask_mode())
