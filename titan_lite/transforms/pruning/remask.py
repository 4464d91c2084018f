"""Re-applying a pruned model's zeros to another HF folder of the same model (e.g. after a LoRA merge made the
pruned linears dense again), shard by shard, without building a model."""

import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from titan_lite.checkpoint.files import copy_tree, save_safetensors
from titan_lite.checkpoint.hf import SafetensorsReader, weight_files
from titan_lite.errors import ConfigError
from titan_lite.folders import output_folder

# The block linears of an HF Llama (q, k, v, o, gate, up, down): the layers pruning touches.
HF_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def remask_hf_folder(source: str | Path, reference: str | Path, out: str | Path) -> tuple[int, int]:
    """Write `source` to `out` with every block linear zeroed where `reference` holds a zero; returns (linears,
    weights set back to zero). Other files (config, tokenizer, index) are copied as they are."""
    source, reference, out = Path(source), Path(reference), Path(out)
    files, reference_files = weight_files(source), weight_files(reference)
    linears, rezeroed = 0, 0
    with output_folder("the re-masked folder", out) as tmp:
        copy_tree(source, tmp)
        with SafetensorsReader() as reader:
            for shard in sorted(set(files.values())):
                tensors = load_file(str(shard))
                for name, tensor in tensors.items():
                    if not HF_LINEAR.fullmatch(name):
                        continue
                    if name not in reference_files:
                        raise ConfigError(f"{reference}: no tensor '{name}' to take the zeros of")
                    keep = reader.tensor(reference_files[name], name) != 0
                    if keep.shape != tensor.shape:
                        raise ConfigError(f"{reference}: '{name}' has shape {list(keep.shape)}, but "
                                          f"{list(tensor.shape)} in {source}")
                    rezeroed += int(((tensor != 0) & ~keep).sum())
                    tensors[name] = torch.where(keep, tensor, torch.zeros((), dtype=tensor.dtype))
                    linears += 1
                save_safetensors(tensors, tmp / shard.name)
    return linears, rezeroed
