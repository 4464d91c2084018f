"""Hugging Face safetensors folders: reading them into (possibly sharded) model parts, writing them from the model."""

import json
import logging
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from titan_lite.checkpoint.files import copy_file, save_safetensors
from titan_lite.dtensor import copy_into_shard, full_tensor
from titan_lite.errors import ConfigError
from titan_lite.folders import ANOTHER, output_folder
from titan_lite.models.args import LlamaArgs
from titan_lite.models.decoder import Llama
from titan_lite.models.hf import mxfp4
from titan_lite.models.hf.config import args_to_hf_config, check_args_against_hf_config, read_hf_config
from titan_lite.models.hf.names import (
    LLAMA_NAMES,
    HFNames,
    hf_name,
    hf_source_names,
    multimodal_names,
    skipped_tensor,
)
from titan_lite.models.hf.rope import rope_form_of
from titan_lite.models.hf.state_dict import tensor_from_hf, to_hf_state_dict
from titan_lite.models.parameters import canonical_name

logger = logging.getLogger("titan_lite")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
# Token ids carried over from the assets' config.json into an exported one.
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

# ------------------------------------------------------------------------------------------ reading


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def weight_files(folder: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it, from the index or the single model.safetensors."""
    folder = Path(folder)
    index_path = folder / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(f"{index_path}: not a valid safetensors index ({_one_line(exc)})") from None
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).exists():
                raise ConfigError(f"{index_path} lists shard '{shard}' but {folder / shard} does not exist")
        return {name: folder / shard for name, shard in weight_map.items()}
    single = folder / SINGLE_FILE
    if not single.exists():
        raise ConfigError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}; expected a Hugging Face safetensors folder")
    with open_safetensors(single) as reader:
        return {name: single for name in reader.keys()}


class SafetensorsReader:
    """Open safetensors files on demand, turning corrupt or truncated files into one-line ConfigErrors."""

    def __init__(self):
        self._stack = ExitStack()
        self._open: dict[Path, object] = {}

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _handle(self, path: Path):
        if path not in self._open:
            self._open[path] = self._stack.enter_context(open_safetensors(path))
        return self._open[path]

    def shape(self, path: Path, name: str) -> list[int]:
        try:
            return list(self._handle(path).get_slice(name).get_shape())
        except SafetensorError as exc:
            raise ConfigError(f"{path}: corrupt or truncated safetensors file ({_one_line(exc)})") from None

    def tensor(self, path: Path, name: str) -> Tensor:
        try:
            return self._handle(path).get_tensor(name)
        except SafetensorError as exc:
            raise ConfigError(f"{path}: corrupt or truncated safetensors file ({_one_line(exc)})") from None


def open_safetensors(path: Path):
    """safe_open that names the file when it is not a valid safetensors file."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{path}: corrupt or truncated safetensors file ({_one_line(exc)})") from None


def _locate(name: str, args: LlamaArgs, files: dict[str, Path], folder: str | Path,
            names: HFNames = LLAMA_NAMES) -> tuple[str, Path]:
    """(HF name, file) of a titan_lite parameter, or ConfigError when the checkpoint lacks it."""
    sources = hf_source_names(name, args, names)
    for source in sources:
        if source in files:
            return source, files[source]
    raise ConfigError(f"{folder}: tensor '{sources[0]}' (titan_lite '{name}') is missing from the checkpoint")


def _locate_checked(name: str, args: LlamaArgs, files: dict[str, Path], reader: SafetensorsReader,
                    folder: str | Path, expected_shape: torch.Size | list[int],
                    names: HFNames = LLAMA_NAMES) -> tuple[str, Path]:
    """(HF name, file) of a parameter whose header says it has the expected shape; reads no tensor data."""
    source, path = _locate(name, args, files, folder, names)
    shape = reader.shape(path, source)
    if list(shape) != list(expected_shape):
        raise ConfigError(f"{path}: tensor '{source}' has shape {list(shape)}, expected {list(expected_shape)} "
                          f"(titan_lite '{name}')")
    return source, path


def _held_as(hf: str, files: dict[str, Path], family: str) -> str | None:
    """The name a folder holds an HF layer tensor under: its own or the family's multimodal spelling; None: absent."""
    return next((name for name in [hf, *multimodal_names([hf], family)] if name in files), None)


def _holds(hf: str, files: dict[str, Path], family: str) -> bool:
    """Whether the folder holds HF tensor `hf`: plainly, under its multimodal name, or as an MXFP4 pair."""
    return _held_as(hf, files, family) is not None or all(q in files for q in mxfp4.quantized_names(hf))


def _fused_source(name: str, args: LlamaArgs, files: dict[str, Path], names: HFNames) -> tuple | None:
    """names.fused_of(name) for the family, unless the folder lacks the fused tensor and the family reads its
    experts one tensor each too (Qwen3.5-MoE as transformers saves it): then None, to be read per expert."""
    family_names = names.for_family(args.family)
    held = family_names.fused_of(name)
    if held is not None and family_names.is_grouped(name) and not _holds(held[0], files, args.family):
        return None
    return held


def _expert_sources(name: str, args: LlamaArgs, files: dict[str, Path], reader: SafetensorsReader, folder: str | Path,
                    expected_shape: torch.Size | list[int], names: HFNames) -> list[tuple[str, Path]]:
    """(HF name, file) of each expert's tensor of a grouped weight [E, ...], checked for presence and shape."""
    out = []
    for expert in names.for_family(args.family).to_hf_experts(name, expected_shape[0]):
        source = _held_as(expert, files, args.family) or expert
        if source not in files:
            raise ConfigError(f"{folder}: tensor '{source}' (expert of titan_lite '{name}') is missing from the "
                              "checkpoint")
        shape = reader.shape(files[source], source)
        if list(shape) != list(expected_shape[1:]):
            raise ConfigError(f"{files[source]}: tensor '{source}' has shape {list(shape)}, expected "
                              f"{list(expected_shape[1:])} (an expert of titan_lite '{name}')")
        out.append((source, files[source]))
    return out


def _held_shape(source: str, files: dict[str, Path], reader: SafetensorsReader) -> list[int] | None:
    """The shape of HF tensor `source`, stored plainly or as gpt-oss's MXFP4 pair (the dequantized shape); None when
    the folder holds neither."""
    if source in files:
        return list(reader.shape(files[source], source))
    blocks, scales = mxfp4.quantized_names(source)
    if blocks not in files or scales not in files:
        return None
    blocks_shape = reader.shape(files[blocks], blocks)
    if len(blocks_shape) != 4 or list(reader.shape(files[scales], scales)) != blocks_shape[:-1]:
        raise ConfigError(f"{files[scales]}: MXFP4 tensors '{blocks}' {blocks_shape} and '{scales}' "
                          f"{reader.shape(files[scales], scales)} do not pair; expected blocks [E, out, in/32, 16] and "
                          "scales [E, out, in/32]")
    return mxfp4.dequantized_shape(blocks_shape)


def _held_tensor(source: str, files: dict[str, Path], reader: SafetensorsReader) -> Tensor:
    """HF tensor `source`, dequantized when the folder stores it as an MXFP4 pair."""
    if source in files:
        return reader.tensor(files[source], source)
    blocks, scales = mxfp4.quantized_names(source)
    return mxfp4.dequantize(reader.tensor(files[blocks], blocks), reader.tensor(files[scales], scales))


def _reads_quantized(name: str, args: LlamaArgs, files: dict[str, Path], names: HFNames) -> bool:
    """Whether parameter `name` is read from an MXFP4 pair of the folder (dequantized)."""
    held = names.for_family(args.family).fused_of(name)
    return held is not None and all(q in files for q in mxfp4.quantized_names(held[0]))


def _locate_fused(name: str, held: tuple, files: dict[str, Path], reader: SafetensorsReader, folder: str | Path,
                  expected_shape: torch.Size | list[int], family: str) -> str:
    """The fused HF tensor holding a parameter (gpt-oss's gate_up_proj, plain or MXFP4; under its multimodal name
    where the folder holds that), checked for presence and for the shape the parameter's part implies; reads no
    tensor data."""
    source, index, fused = held
    source = _held_as(source, files, family) or source
    shape = _held_shape(source, files, reader)
    if shape is None:
        raise ConfigError(f"{folder}: tensor '{source}' (titan_lite '{name}') is missing from the checkpoint")
    parts = [torch.empty(expected_shape, device="meta") for _ in fused.parts]
    expected = list(fused.join(parts).shape)
    if shape != expected:
        raise ConfigError(f"{files.get(source, folder)}: tensor '{source}' has shape {shape}, expected {expected} "
                          f"(holding titan_lite '{name}')")
    return source


def read_titan_tensor(name: str, args: LlamaArgs, files: dict[str, Path], reader: SafetensorsReader,
                      folder: str | Path, expected_shape: torch.Size | list[int],
                      names: HFNames = LLAMA_NAMES) -> Tensor:
    """One parameter in titan_lite layout, read from the HF folder and checked for presence and shape (a grouped
    expert weight stacked from its experts' tensors, a fused one split out of its HF tensor)."""
    held = _fused_source(name, args, files, names)
    if held is not None:
        source = _locate_fused(name, held, files, reader, folder, expected_shape, args.family)
        return held[2].split(_held_tensor(source, files, reader))[held[1]]
    if names.is_grouped(name):
        sources = _expert_sources(name, args, files, reader, folder, expected_shape, names)
        return torch.stack([reader.tensor(path, source) for source, path in sources])
    source, path = _locate_checked(name, args, files, reader, folder, expected_shape, names)
    return tensor_from_hf(name, reader.tensor(path, source), args)


def check_no_unexpected_tensors(files: dict[str, Path], args: LlamaArgs, folder: str | Path,
                                dequantizes: bool = True) -> None:
    """ConfigError when the checkpoint holds a tensor the model has no place for (e.g. more layers or experts).
    `dequantizes`: whether the load reads the folder's MXFP4 pairs dequantized (the log says so), rather than leaving
    them to a transform that keeps them as they are."""
    names = LLAMA_NAMES.for_family(args.family)
    known = {hf for name in expected_shapes(args) for hf in names.readable_names(name, args.n_experts)}
    known.add(hf_name("output.weight"))
    known.update(multimodal_names(sorted(known), args.family))
    quantized = {q: hf for hf in known if names.fused_parts_of_hf(hf) for q in mxfp4.quantized_names(hf)}
    skipped: dict[str, int] = {}
    for name in sorted(files):
        what = skipped_tensor(name, args.family, args.n_layers, args.n_mtp_layers)
        if what is not None:
            skipped[what] = skipped.get(what, 0) + 1
        elif name not in known and name not in quantized and not name.endswith("rotary_emb.inv_freq"):
            raise ConfigError(f"{files[name]}: tensor '{name}' has no counterpart in the model "
                              f"({args.n_layers} layers); is the model config the checkpoint's?")
    for what, count in skipped.items():
        logger.info(f"{folder}: skipping {count} tensors of the {what}, which titan_lite does not build")
    held = sorted({quantized[name] for name in files if name in quantized})
    if held and dequantizes:
        logger.info(f"{folder}: {len(held)} expert tensors are MXFP4 (*_blocks / *_scales): dequantized on load; "
                    "an export writes them unquantized, in checkpoint.export_dtype (e.g. bfloat16), without "
                    "a quantization_config")


@torch.no_grad()
def load_hf_weights(model_parts: list[nn.Module], folder: str, model_args: LlamaArgs,
                    names: HFNames = LLAMA_NAMES) -> None:
    """Load every parameter the parts hold from an HF folder (except those `names` says no HF folder holds);
    DTensor parameters keep only their own shard."""
    files = weight_files(folder)
    read = [canonical_name(n) for part in model_parts for n, _ in part.named_parameters()]
    check_no_unexpected_tensors(files, model_args, folder, any(_reads_quantized(n, model_args, files, names)
                                                              for n in read if names.in_hf(n)))
    with SafetensorsReader() as reader:
        for part in model_parts:
            for name, param in part.named_parameters():
                name = canonical_name(name)
                if not names.in_hf(name):
                    continue
                full = read_titan_tensor(name, model_args, files, reader, folder, param.shape, names)
                copy_into_shard(param, full.to(device=param.device, dtype=param.dtype))


def check_hf_folder(folder: str, args: LlamaArgs) -> None:
    """Every tensor of the model is in the folder's safetensors with the right shape; reads headers only."""
    files = weight_files(folder)
    check_no_unexpected_tensors(files, args, folder)
    with SafetensorsReader() as reader:
        for name, shape in expected_shapes(args).items():
            held = _fused_source(name, args, files, LLAMA_NAMES)
            if held is not None:
                _locate_fused(name, held, files, reader, folder, shape, args.family)
            elif LLAMA_NAMES.for_family(args.family).is_grouped(name):
                _expert_sources(name, args, files, reader, folder, shape, LLAMA_NAMES)
            else:
                _locate_checked(name, args, files, reader, folder, shape)


def read_hf_folder(folder: str, args: LlamaArgs) -> dict[str, Tensor]:
    """The full titan_lite state dict (names and layout) of an HF folder, checked against the args' shapes."""
    files = weight_files(folder)
    check_no_unexpected_tensors(files, args, folder)
    with SafetensorsReader() as reader:
        return {name: read_titan_tensor(name, args, files, reader, folder, shape).clone()
                for name, shape in expected_shapes(args).items()}


# ------------------------------------------------------------------------------------------ writing


def expected_shapes(args: LlamaArgs) -> dict[str, torch.Size]:
    """titan_lite parameter name -> shape for the whole model (the tied head listed once, as the embedding)."""
    with torch.device("meta"):
        model = Llama(args)
    return {name: param.shape for name, param in model.named_parameters()}


def check_state_dict(sd: dict[str, Tensor], args: LlamaArgs, source: str, quantized: set[str] = frozenset()) -> None:
    """ConfigError when a tensor the model needs is missing or has the wrong shape; a tensor held by one of the HF
    tensors in `quantized` (written as an MXFP4 pair) is not looked for."""
    names = LLAMA_NAMES.for_family(args.family)
    for name, shape in expected_shapes(args).items():
        held = names.fused_of(name)
        if held is not None and held[0] in quantized:
            continue
        if name not in sd:
            raise ConfigError(f"{source}: tensor '{name}' is missing")
        if list(sd[name].shape) != list(shape):
            raise ConfigError(f"{source}: tensor '{name}' has shape {list(sd[name].shape)}, expected {list(shape)}")


def _sort_key(name: str) -> tuple:
    """Embeddings first, then layers in numeric order, then the final norm and head."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match:
        return (1, int(match.group(1)), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def plan_shards(sd: dict[str, Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into files of at most max_shard_bytes (a larger tensor gets a file of its own)."""
    shards, current, size = [], [], 0
    for name in sorted(sd, key=_sort_key):
        nbytes = sd[name].numel() * sd[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def write_safetensors(sd: dict[str, Tensor], folder: Path, max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors plus model.safetensors.index.json."""
    shards = plan_shards(sd, max_shard_bytes)
    if len(shards) == 1:
        save_safetensors({n: sd[n].contiguous() for n in shards[0]}, folder / SINGLE_FILE)
        return
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors({n: sd[n].contiguous() for n in names}, folder / filename)
        weight_map.update({n: filename for n in names})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _hf_config(args: LlamaArgs, dtype: torch.dtype, assets_dir: str | None) -> dict:
    """config.json of the export; token ids, and the context length when it describes this same model, come from
    the assets' config.json (training usually runs shorter sequences than the model supports)."""
    assets_config = Path(assets_dir) / "config.json" if assets_dir else None
    if assets_config is None or not assets_config.exists():
        return args_to_hf_config(args, dtype)
    source = read_hf_config(assets_config)
    config = args_to_hf_config(args, dtype, rope_form=rope_form_of(source))  # rope written as it was read
    config.update({k: source[k] for k in _TOKEN_ID_KEYS if k in source})
    try:
        check_args_against_hf_config(args, str(assets_config), rope=False)  # a run may have added YaRN
    except ConfigError:
        return config  # a different (e.g. pruned) model: its context length says nothing about this one
    config["max_position_embeddings"] = max(args.max_seq_len, int(source.get("max_position_embeddings", 0)))
    return config


def _quantization_config(assets_dir: str | None) -> dict:
    """The assets' MXFP4 quantization_config when they have one, else the release's."""
    assets_config = Path(assets_dir) / "config.json" if assets_dir else None
    if assets_config is not None and assets_config.exists():
        source = read_hf_config(assets_config).get("quantization_config") or {}
        if source.get("quant_method") == "mxfp4":
            return source
    return dict(mxfp4.RELEASE_QUANTIZATION)


def _copy_tokenizer_files(assets_dir: str | None, folder: Path) -> None:
    if not assets_dir:
        return
    for filename in TOKENIZER_FILES:
        if (Path(assets_dir) / filename).exists():
            copy_file(Path(assets_dir) / filename, folder / filename)


def write_hf_folder(sd: dict[str, Tensor], args: LlamaArgs, out_dir: str, dtype: torch.dtype,
                    assets_dir: str | None = None, max_shard_bytes: int = 5 * 2**30,
                    what: str = "the Hugging Face folder", instead: str = ANOTHER) -> None:
    """Write a full titan_lite state dict as an HF folder (config, weights, tokenizer files), whole or not at all,
    through titan_lite.folders: a folder holding files titan_lite did not write is refused (one ConfigError line
    naming `what`, the folder and the files, and `instead`) and stays as it is. Entries named as an HF folder's
    MXFP4 pair (model.layers.{i}.mlp.experts.<name>_blocks / _scales, uint8) stand for the tensors they hold and are
    written as they are, with an mxfp4 quantization_config."""
    quantized = {n: t.detach().cpu() for n, t in sd.items() if mxfp4.is_quantized_name(n)}
    sd = {n: t for n, t in sd.items() if n not in quantized}
    check_state_dict(sd, args, "export", {mxfp4.held_name(n) for n in quantized})
    hf_sd = to_hf_state_dict({n: t.detach().to(device="cpu", dtype=dtype) for n, t in sd.items()}, args)
    hf_sd.update(quantized)  # an MXFP4 pair as it was loaded, uint8, whatever the export dtype
    config = _hf_config(args, dtype, assets_dir)
    if quantized:
        config["quantization_config"] = _quantization_config(assets_dir)
        logger.info(f"{out_dir}: {len(quantized) // 2} expert tensors written as MXFP4 (*_blocks / *_scales, as "
                    "loaded) with an mxfp4 quantization_config")
    with output_folder(what, out_dir, instead=instead) as tmp:
        write_safetensors(hf_sd, tmp, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _copy_tokenizer_files(assets_dir, tmp)


def _full_tensors(model_parts: list[nn.Module], dtype: torch.dtype,
                  keep: Callable[[str], bool] | None = None) -> dict[str, Tensor]:
    """Every parameter this rank's parts hold (that `keep` accepts), unsharded (a collective for DTensors), on the
    CPU in `dtype`."""
    out = {}
    for part in model_parts:
        for name, param in part.named_parameters():
            name = canonical_name(name)
            if keep is None or keep(name):
                out[name] = full_tensor(param).detach().to(dtype=dtype).cpu()
    return out


def _gather_pipeline_stages(sd: dict[str, Tensor], parallel_dims) -> dict[str, Tensor] | None:
    """Merge the stages' tensors onto global rank 0; other ranks get None. Only rank 0's pp group communicates."""
    group = parallel_dims.submesh("pp").get_group()
    ranks = dist.get_process_group_ranks(group)
    if 0 not in ranks:
        return None
    gathered = [None] * len(ranks) if dist.get_rank() == 0 else None
    dist.gather_object(sd, gathered, dst=0, group=group)
    if dist.get_rank() != 0:
        return None
    merged = {}
    for stage_sd in gathered:
        merged.update(stage_sd)
    return merged


def gather_full_state_dict(model_parts: list[nn.Module], dtype: torch.dtype, parallel_dims=None,
                           keep: Callable[[str], bool] | None = None) -> dict[str, Tensor] | None:
    """The full (unsharded, every pipeline stage) parameters that `keep` accepts, on the CPU of global rank 0; other
    ranks get None. Collective when distributed: every rank must call it."""
    distributed = dist.is_available() and dist.is_initialized()
    sd = _full_tensors(model_parts, dtype, keep)
    if distributed and parallel_dims is not None and parallel_dims.pp_enabled:
        return _gather_pipeline_stages(sd, parallel_dims)
    return sd if not distributed or dist.get_rank() == 0 else None


ExportConversion = Callable[[dict[str, Tensor], LlamaArgs], tuple[dict[str, Tensor], LlamaArgs]]
# How a refused export of the run names itself and the way out (job.plan checks the folders at launch too).
EXPORT_WHAT, EXPORT_INSTEAD = "the run's export", "set another 'job.dump_folder'"


def export_hf(model_parts: list[nn.Module], model_args: LlamaArgs, out_dir: str, dtype: torch.dtype,
              assets_dir: str | None, parallel_dims=None, max_shard_bytes: int = 5 * 2**30,
              convert: ExportConversion | None = None) -> None:
    """Write the model as an HF folder (the run's export: a folder holding a file titan_lite did not write is one
    ConfigError line and stays as it is). Collective when distributed: every rank must call it; rank 0 writes.

    `convert` turns the full state dict and args into a plain Llama's before writing (transforms merge adapters,
    drop masks or materialise a smaller model there); it runs on rank 0 on fp32 tensors.
    """
    distributed = dist.is_available() and dist.is_initialized()
    sd = gather_full_state_dict(model_parts, torch.float32 if convert else dtype, parallel_dims)
    if sd is not None:
        if model_args.tie_word_embeddings:
            sd.pop("output.weight", None)  # a pipeline's last stage holds its own copy of the tied head
        if convert is not None:
            sd, model_args = convert(sd, model_args)
        write_hf_folder(sd, model_args, out_dir, dtype, assets_dir, max_shard_bytes, EXPORT_WHAT, EXPORT_INSTEAD)
    if distributed:
        dist.barrier()
