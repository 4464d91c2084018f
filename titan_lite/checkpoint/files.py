"""Files the checkpoint writers leave for other people to read: safetensors written, and files copied, with the
user's umask (as a file created with open() gets it)."""

import os
import shutil
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


def copy_file(source: str | Path, target: str | Path) -> None:
    """The file's bytes, with the permissions of a new file under the umask (shutil.copy would keep the source's
    mode: a 0644 tokenizer.model stays 0644 under umask 077, a 0600 one unreadable to the group under 022)."""
    shutil.copyfile(source, target)
    os.chmod(target, umask_mode())


def copy_tree(source: str | Path, target: str | Path) -> None:
    """A folder copied (files and sub-folders) with umask permissions, like copy_file; `target` is new or empty."""
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")):
        if path.is_dir():
            (target / path.relative_to(source)).mkdir(exist_ok=True)
        else:
            copy_file(path, target / path.relative_to(source))
