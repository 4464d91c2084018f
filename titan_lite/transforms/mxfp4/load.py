"""Filling the packed experts from the base's Hugging Face folder: the release's `*_blocks` / `*_scales` copied as
they are (gate_up_proj's rows interleave gate and up, so w1 takes the even rows, w3 the odd), or, from a folder with
unquantized experts, each weight quantized to the same format; every rank keeps only its own shard."""

from pathlib import Path

import torch
from torch import nn

from titan_lite.checkpoint.hf import SafetensorsReader, read_titan_tensor, weight_files
from titan_lite.dtensor import copy_into_shard
from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.hf import mxfp4
from titan_lite.models.hf.names import LLAMA_NAMES
from titan_lite.models.parameters import canonical_name
from titan_lite.transforms.mxfp4.experts import WEIGHTS, is_packed_experts, packed_names

# A layer's released MXFP4 tensor -> the packed weights it holds, as slices of its rows (out-major).
RELEASED = {"mlp.experts.gate_up_proj": (("w1", slice(0, None, 2)), ("w3", slice(1, None, 2))),
            "mlp.experts.down_proj": (("w2", slice(None)),)}


def packed_modules(model_parts: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """(canonical name, module) of every packed experts module the parts hold."""
    return [(canonical_name(n), m) for part in model_parts for n, m in part.named_modules() if is_packed_experts(m)]


def _released(layer: str, files: dict[str, Path], reader: SafetensorsReader,
              params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor] | None:
    """The packed tensors of one layer as the folder stores them (None: its experts are unquantized there)."""
    out = {}
    for hf, held in RELEASED.items():
        names = mxfp4.quantized_names(f"model.layers.{layer}.{hf}")
        if not all(n in files for n in names):
            return None
        blocks, scales = (reader.tensor(files[n], n) for n in names)
        for weight, rows in held:
            for name, tensor, source in zip(packed_names(weight), (blocks, scales), names, strict=True):
                part = tensor[:, rows]
                if list(part.shape) != list(params[name].shape) or tensor.dtype != torch.uint8:
                    raise ConfigError(f"{files[source]}: MXFP4 tensor '{source}' {list(tensor.shape)} "
                                      f"({tensor.dtype}) does not hold the uint8 {name} {list(params[name].shape)} "
                                      f"of layer {layer}'s experts; is the model config the checkpoint's?")
                out[name] = part
    return out


def _quantized(layer: str, args: LlamaArgs, files: dict[str, Path], reader: SafetensorsReader, folder: str,
               params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """One layer's packed tensors quantized from the folder's unquantized experts, as the release quantizes them."""
    out = {}
    for weight in WEIGHTS:
        blocks = params[packed_names(weight)[0]]
        n_experts, rows, groups, _ = blocks.shape
        dense = read_titan_tensor(f"layers.{layer}.moe.experts.{weight}", args, files, reader, folder,
                                  [n_experts, rows, groups * mxfp4.BLOCK], LLAMA_NAMES)
        out.update(zip(packed_names(weight), mxfp4.quantize(dense.transpose(1, 2)), strict=True))
    return out


@torch.no_grad()
def load_packed_experts(model_parts: list[nn.Module], folder: str, args: LlamaArgs) -> tuple[int, int]:
    """Fill every packed experts module of the parts from the folder; (layers copied as released, layers
    quantized from unquantized experts)."""
    files, kept, quantized = weight_files(folder), 0, 0
    with SafetensorsReader() as reader:
        for name, module in packed_modules(model_parts):
            layer = name.split(".")[1]
            params = dict(module.named_parameters(recurse=False))
            tensors = _released(layer, files, reader, params)
            if tensors is None:
                tensors = _quantized(layer, args, files, reader, folder, params)
                quantized += 1
            else:
                kept += 1
            for param_name, full in tensors.items():
                param = params[param_name]
                copy_into_shard(param, full.to(param.device).contiguous())
    return kept, quantized
