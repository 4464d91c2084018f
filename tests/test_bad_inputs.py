"""The bad-input table: every case is the pre-launch check run_train.sh does (titan_lite.train.main in one process with
TITAN_LITE_CHECK_ONLY=1), which must exit 2 with exactly one line naming the key, file or value, no traceback, and
leave any existing checkpoint as it was. Cases that need a real launch (a rank's error, a full disk, permissions,
the launcher's own checks) are in tests/integration/test_faults.py."""

import base64
import hashlib
import json
import shutil
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_lite.checkpoint import dcp as ckpt
from titan_lite.launcher import LAUNCH_DIR_ENV
from titan_lite.models.flavors import flavor_args
from titan_lite.models.hf.config import args_to_hf_config
from titan_lite.train import main

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "tests" / "integration" / "base.toml"
TOKENIZER = REPO / "assets" / "tokenizer" / "tokenizer.model"


@dataclass
class Case:
    """argv after the base config (or `build(tmp)` for cases that need files); `expected` must be in the one line
    ({tmp} is the case's folder); `env` holds NGPU, COMM_BACKEND..."""

    name: str
    expected: str
    argv: list[str] = field(default_factory=list)
    build: Callable[[Path], list[str]] | None = None
    env: dict[str, str] = field(default_factory=dict)
    base: bool = True  # start from tests/integration/base.toml


# ------------------------------------------------------------------------------------------ file builders


def toml(text: str) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        path = tmp / "job.toml"
        path.write_text(text)
        return ["--job.config_file", str(path)]
    return build


def jsonl(lines: list[str], name: str = "d.jsonl") -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        path = tmp / name
        path.write_text("".join(line + "\n" for line in lines))
        return ["--training.dataset", "jsonl", "--training.dataset_path", str(path)]
    return build


def text_file(text: str, name: str = "d.txt") -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        path = tmp / name
        path.write_text(text)
        return ["--training.dataset", "text", "--training.dataset_path", str(path)]
    return build


def instruct_file(lines: list[str]) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        path = tmp / "i.jsonl"
        path.write_text("".join(line + "\n" for line in lines))
        return ["--training.dataset", "instruct", "--training.dataset_path", str(path)]
    return build


def hf_folder(tmp: Path, config: dict | None = None, weights: bytes | None = None) -> Path:
    folder = tmp / "hf"
    folder.mkdir(exist_ok=True)
    shutil.copy(TOKENIZER, folder / "tokenizer.model")
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


def tiny_config(**changes) -> dict:
    config = args_to_hf_config(flavor_args("tiny"), torch.float32)
    config.update(changes)
    return config


def hf(config: dict | None = None, weights: bytes | None = None, extra: tuple[str, ...] = ()) -> Callable:
    def build(tmp: Path) -> list[str]:
        return ["--model.hf_assets_path", str(hf_folder(tmp, config, weights)), *extra]
    return build


def hf_index_with_missing_shard(tmp: Path) -> list[str]:
    folder = hf_folder(tmp)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1-of-2.safetensors"}}))
    return ["--model.hf_assets_path", str(folder), "--checkpoint.initial_load_in_hf"]


def big_vocabulary_tokenizer(tmp: Path) -> list[str]:
    """A valid tiktoken file with 2,000 base tokens: 2,256 with Llama 3's specials, more than tiny's 2,048."""
    pairs = [bytes([a, b]) for a in range(32, 127) for b in range(32, 127)]
    tokens = [bytes([i]) for i in range(256)] + pairs[:2000 - 256]
    path = tmp / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))
    return ["--model.hf_assets_path", str(tmp)]


def file_in_case(name: str, content: bytes, argv: Callable[[Path], list[str]]) -> Callable[[Path], list[str]]:
    """Writes {tmp}/name, then gives the arguments that point at it."""
    def build(tmp: Path) -> list[str]:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(content)
        return argv(tmp)
    return build


def save_dcp(folder: Path, state: dict) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder))


def training_state() -> bytes:
    return ckpt.pack({"step": 3, "ntokens_seen": 0})


def checkpoint_of_another_shape(tmp: Path) -> list[str]:
    save_dcp(tmp / "out" / "checkpoint" / "step-3",
             {"model": {"tok_embeddings.weight": torch.zeros(2048, 32)}, "train_state": training_state()})
    return ["--checkpoint.enable"]


def model_only_newest(tmp: Path) -> list[str]:
    save_dcp(tmp / "out" / "checkpoint" / "step-10", {"model": {"tok_embeddings.weight": torch.zeros(2048, 64)}})
    return ["--checkpoint.enable"]


def corrupt_metadata(tmp: Path) -> list[str]:
    folder = tmp / "out" / "checkpoint" / "step-4"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"not a pickle")
    return ["--checkpoint.enable"]


def truncated_shard(tmp: Path) -> list[str]:
    folder = tmp / "out" / "checkpoint" / "step-3"
    save_dcp(folder, {"model": {"tok_embeddings.weight": torch.zeros(2048, 64)}, "train_state": training_state()})
    shard = folder / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(1000)
    return ["--checkpoint.enable"]


def seed_over_checkpoints(tmp: Path) -> list[str]:
    save_dcp(tmp / "out" / "checkpoint" / "step-3", {"model": {"x": torch.zeros(1)}, "train_state": training_state()})
    return ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]


def not_a_checkpoint(tmp: Path) -> list[str]:
    (tmp / "weights").mkdir()
    return ["--checkpoint.initial_load_path", str(tmp / "weights")]


def dump_folder_under_a_file(tmp: Path) -> list[str]:
    (tmp / "a_file").write_text("x")
    return ["--job.dump_folder", str(tmp / "a_file" / "out")]


def truncated_safetensors(tmp: Path) -> list[str]:
    header = b'{"model.embed_tokens.weight":{"dtype":"F32","shape":[2048,64],"data_offsets":[0,524288]}}'
    return hf(weights=struct.pack("<Q", len(header)) + header + b"\0" * 100,
              extra=("--checkpoint.initial_load_in_hf",))(tmp)


# ------------------------------------------------------------------------------------------ the table


CASES = [
    # unknown or misspelt keys
    Case("unknown CLI key", "unknown option '--training.stpes' (did you mean 'training.steps'?)",
         ["--training.stpes", "3"]),
    Case("unknown TOML key", "unknown key 'training.stpes' (did you mean 'training.steps'?)",
         build=toml("[training]\nstpes = 3\n")),
    Case("misspelt TOML section", "unknown key 'trainig'", build=toml("[trainig]\nsteps = 3\n")),
    Case("a section given a value", "'training' is a section ([training])", build=toml("training = 3\n")),
    Case("positional argument", "unexpected argument 'steps': options look like --section.key value", ["steps"]),
    # wrong types
    Case("integer expected (CLI)", "--training.steps: expected an integer, got 'ten'", ["--training.steps", "ten"]),
    Case("integer expected (TOML)", "'training.steps' expects an integer, got '10'",
         build=toml('[training]\nsteps = "10"\n')),
    Case("number expected", "--optimizer.lr: expected a number, got 'fast'", ["--optimizer.lr", "fast"]),
    Case("boolean expected", "--checkpoint.enable: expected true or false, got 'maybe'",
         ["--checkpoint.enable", "maybe"]),
    Case("value missing", "--training.steps: expects an integer after it", ["--training.steps"]),
    Case("choice outside a Literal", "'optimizer.name' = 'SGD' is not one of: AdamW, Adam",
         ["--optimizer.name", "SGD"]),
    Case("non-finite policy", "'training.on_nonfinite' = 'ignore' is not one of: stop, skip",
         ["--training.on_nonfinite", "ignore"]),
    # out-of-range values
    Case("negative steps", "'training.steps' must be at least 1, got -3", ["--training.steps", "-3"]),
    Case("zero learning rate", "'optimizer.lr' must be positive, got 0.0", ["--optimizer.lr", "0"]),
    Case("beta outside [0, 1)", "'optimizer.beta1' must be in [0, 1), got 1.5", ["--optimizer.beta1", "1.5"]),
    Case("negative warmup", "'lr_scheduler.warmup_steps' must be at least 0, got -1",
         ["--lr_scheduler.warmup_steps", "-1"]),
    Case("sequence of one token", "'training.seq_len' must be at least 2, got 1", ["--training.seq_len", "1"]),
    Case("checkpoint interval 0", "'checkpoint.interval' must be at least 1, got 0", ["--checkpoint.interval", "0"]),
    Case("negative keep_latest_k", "'checkpoint.keep_latest_k' must be at least 0, got -1",
         ["--checkpoint.keep_latest_k", "-1"]),
    Case("zero collective timeout", "'comm.train_timeout_seconds' must be at least 1, got 0",
         ["--comm.train_timeout_seconds", "0"]),
    Case("unknown exclude_from_loading key", "'checkpoint.exclude_from_loading' has 'weights'",
         ["--checkpoint.exclude_from_loading", "weights"]),
    Case("unsupported feature switched on", "'optimizer.early_step_in_backward' = True is not supported",
         ["--optimizer.early_step_in_backward"]),
    Case("prefetch without workers", "'training.dataloader.prefetch_factor' = 2 needs "
         "'training.dataloader.num_workers' > 0", ["--training.dataloader.prefetch_factor", "2"]),
    Case("unknown flavor", "'model.flavor': unknown model flavor '9B'", ["--model.flavor", "9B"]),
    # degrees and shapes
    Case("degrees do not multiply to the world size", "parallel degrees do not multiply to the world size: "
         "dp_replicate 1 x dp_shard 3 x cp 1 x tp 1 x pp 1 = 3, but the world size is 2 (NGPU x NNODES)",
         ["--parallelism.data_parallel_shard_degree", "3"], env={"NGPU": "2"}),
    Case("TP does not divide the heads", "'parallelism.tensor_parallel_degree' = 8 must divide the model's n_heads (4)",
         ["--parallelism.tensor_parallel_degree", "8"], env={"NGPU": "8"}),
    Case("more pipeline stages than layers", "layers", ["--parallelism.pipeline_parallel_degree", "8"],
         env={"NGPU": "8"}),
    Case("EP does not divide the experts", "'parallelism.expert_parallel_degree' = 3 must divide the model's n_experts "
         "(8)", ["--model.flavor", "tiny_moe", "--parallelism.expert_parallel_degree", "3"], env={"NGPU": "3"}),
    Case("EP does not divide the data ranks", "'parallelism.expert_parallel_degree' = 4 must divide the ranks it is "
         "carved from, dp_shard 2 x cp 1 x tp 1 = 2", ["--model.flavor", "tiny_moe",
                                                      "--parallelism.expert_parallel_degree", "4"], env={"NGPU": "2"}),
    Case("EP on a dense model", "'parallelism.expert_parallel_degree' = 2 needs a mixture-of-experts model",
         ["--parallelism.expert_parallel_degree", "2"], env={"NGPU": "2"}),
    Case("sequence not divisible for CP", "'training.seq_len' = 30 must be divisible by 4",
         ["--parallelism.context_parallel_degree", "2", "--training.seq_len", "30"], env={"NGPU": "2"}),
    Case("global batch not a multiple", "'training.global_batch_size' 12 is not a multiple of local_batch_size 8",
         ["--training.global_batch_size", "12"]),
    Case("pipeline microbatches do not divide the batch", "'training.local_batch_size' 8 is not a multiple of",
         ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"],
         env={"NGPU": "2"}),
    Case("seed checkpoint on two ranks", "'checkpoint.create_seed_checkpoint' needs one process",
         ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"], env={"NGPU": "2"}),
    # communication backends
    Case("backend that does not exist", "COMM_BACKEND=carrier_pigeon is not available", env={
        "COMM_BACKEND": "carrier_pigeon"}),
    Case("nccl on a CPU-only build", "COMM_BACKEND=nccl is not available in this torch build on device 'cpu'; use "
         "gloo", env={"COMM_BACKEND": "nccl"}),
    # config files
    Case("config file that does not exist", "config file '{tmp}/nope.toml' does not exist",
         build=lambda tmp: ["--job.config_file", str(tmp / "nope.toml")], base=False),
    Case("config file that is not TOML", "is not valid TOML", build=toml("[training\nsteps = 3\n")),
    Case("two different config files", "'--job.config_file' is given 2 different files",
         build=lambda tmp: ["--job.config_file", str(BASE), "--job.config_file", str(tmp / "other.toml")]),
    # data
    Case("dataset path that does not exist", "'training.dataset_path' = '{tmp}/no_data' does not exist",
         build=lambda tmp: ["--training.dataset", "jsonl", "--training.dataset_path", str(tmp / "no_data")]),
    Case("dataset folder without shards",
         "'training.dataset_path' = '{tmp}' holds no .txt, .jsonl, .json.gz, .parquet files",
         build=lambda tmp: ["--training.dataset", "jsonl", "--training.dataset_path", str(tmp)]),
    Case("dataset file of another kind", "must end in one of .txt, .jsonl, .json.gz",
         build=file_in_case("d.csv", b"a,b\n", lambda tmp: ["--training.dataset", "text",
                                                            "--training.dataset_path", str(tmp / "d.csv")])),
    Case("unknown dataset", "'training.dataset' = 'c5' is unknown", ["--training.dataset", "c5"]),
    Case("dataset that needs a path", "dataset 'c4' needs 'training.dataset_path'", ["--training.dataset", "c4"]),
    Case("empty dataset", "'training.dataset_path' = '{tmp}/d.jsonl' holds no text", build=jsonl(["", "  "])),
    Case("empty text file", "'training.dataset_path' = '{tmp}/d.txt' holds no text (1 file(s)",
         build=text_file("")),
    Case("only empty text fields", "'training.dataset_path' = '{tmp}/d.jsonl' holds no text",
         build=jsonl(['{"text": ""}', '{"text": " "}'])),
    Case("fewer tokens than one sequence", "'training.dataset_path' = '{tmp}/d.txt' holds 7 tokens: fewer than one "
         "sequence of seq_len + 1 = 65 tokens; add data", build=text_file("To be, or not")),
    Case("fewer tokens than the data-parallel ranks need", "of seq_len + 1 = 17 tokens for each of the 2 "
         "data-parallel ranks (34 in all)", ["--training.seq_len", "16"], build=text_file("word " * 10),
         env={"NGPU": "2"}),
    Case("validation data too short", "'validation.dataset_path' = '{tmp}/d.txt' holds", build=lambda tmp: [
        "--validation.enable", "--validation.dataset", "text", "--validation.dataset_path",
        text_file("A short play.")(tmp)[-1]]),
    Case("instruction data with empty responses only", "'training.dataset_path' = '{tmp}/i.jsonl' holds no examples "
         "with a non-empty response (or assistant turn)",
         build=instruct_file(['{"question": "1 + 1?", "answer": ""}'])),
    Case("chat data with empty assistant turns only", "'training.dataset_path' = '{tmp}/i.jsonl' holds no examples "
         "with a non-empty response (or assistant turn)", ["--instruct.chat_template", str(
             REPO / "tests" / "chat_templates" / "chatml_smollm2.jinja")], build=instruct_file([json.dumps(
                 {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": ""},
                               {"role": "user", "content": "and 2 + 2?"}, {"role": "assistant", "content": " "}]})])),
    Case("a chat template on data that is not instruct", "'instruct.chat_template' = 'tokenizer' has no effect: "
         "[instruct] is read only when 'training.dataset' or 'validation.dataset' is 'instruct', which is not the case "
         "here; set --training.dataset instruct (or --validation.dataset instruct) or drop the setting",
         ["--instruct.chat_template", "tokenizer"]),
    Case("a distillation teacher without distill.enable", "'distill.teacher_path' = '{tmp}' has no effect: it takes "
         "effect only with 'distill.enable' = true, and that is false; set --distill.enable or drop the setting",
         build=lambda tmp: ["--distill.teacher_path", str(tmp), "--distill.alpha", "1.0"]),
    Case("instruction validation smaller than one batch", "has 1 examples: fewer than one batch of "
         "'validation.local_batch_size' = 8 x 1 data-parallel rank(s)",
         ["--validation.enable", "--validation.dataset", "instruct", "--validation.local_batch_size", "8"],
         build=instruct_file(['{"question": "1 + 1?", "answer": "#### 2"}'] * 20)),
    Case("calibration data without text", "'pruning.dataset_path' = '{tmp}/d.txt' holds no text", build=lambda tmp: [
        "--model.converters", "prune", "--pruning.dataset", "text", "--pruning.dataset_path",
        text_file("")(tmp)[-1]]),
    Case("unknown converter", "'model.converters' has unknown transform 'lora_' (did you mean 'lora'?)",
         ["--model.converters", "lora_"]),
    Case("unknown dataset close to a known one", "'training.dataset' = 'shakespear' is unknown (did you mean "
         "'shakespeare'?)", ["--training.dataset", "shakespear"]),
    Case("relative path", "'training.dataset_path' = 'no/such/shards' (relative to the current directory ",
         ["--training.dataset", "text", "--training.dataset_path", "no/such/shards"]),
    Case("malformed JSONL line", "{tmp}/d.jsonl:2: not valid JSON", build=jsonl(["", '{"text": broken'])),
    Case("JSONL line without text", '{tmp}/d.jsonl:1: no "text" string', build=jsonl(['{"content": "x"}'])),
    Case("validation data missing", "'validation.dataset_path' = '{tmp}/val' does not exist",
         build=lambda tmp: ["--validation.enable", "--validation.dataset", "jsonl",
                            "--validation.dataset_path", str(tmp / "val")]),
    # tokenizers
    Case("no tokenizer in the assets folder", "tokenizer folder '{tmp}' holds neither tokenizer.json nor "
         "tokenizer.model", build=lambda tmp: ["--model.hf_assets_path", str(tmp)]),
    Case("tokenizer path that does not exist", "tokenizer path '{tmp}/tok.model' does not exist",
         build=lambda tmp: ["--model.tokenizer_path", str(tmp / "tok.model")]),
    Case("unreadable tokenizer file", "tokenizer file '{tmp}/tokenizer.model' is neither a tiktoken file",
         build=file_in_case("tokenizer.model", b"\x00\xff garbage", lambda tmp: ["--model.hf_assets_path", str(tmp)])),
    Case("tokenizer vocabulary larger than the model's", "has 2256 tokens but flavor 'tiny' has vocab_size 2048",
         build=big_vocabulary_tokenizer),
    # Hugging Face folders
    Case("truncated safetensors", "{tmp}/hf/model.safetensors: corrupt or truncated safetensors file",
         build=truncated_safetensors),
    Case("safetensors index naming a missing shard", "lists shard 'model-1-of-2.safetensors' but",
         build=hf_index_with_missing_shard),
    Case("HF folder without weights", "{tmp}/hf: no model.safetensors or model.safetensors.index.json",
         build=hf(extra=("--checkpoint.initial_load_in_hf",))),
    Case("config.json of another shape", "n_layers is 4 in the model but 8 in config.json",
         build=hf(tiny_config(num_hidden_layers=8))),
    Case("config.json that is not JSON", "{tmp}/hf/config.json: not valid JSON",
         build=lambda tmp: hf(extra=("--model.hf_assets_path", str(tmp / "hf")))(tmp) +
         file_in_case("hf/config.json", b"{", lambda _: [])(tmp)),
    Case("flavor hf without config.json", "'model.flavor' = 'hf' takes the model shape from a Hugging Face "
         "config.json, but '{tmp}/hf/config.json' does not exist",
         build=hf(extra=("--model.flavor", "hf"))),
    # checkpoints
    Case("checkpoint of another shape", "tensor 'model.tok_embeddings.weight' has shape [2048, 32] in the checkpoint "
         "but [2048, 64] in this model", build=checkpoint_of_another_shape),
    Case("checkpoint with corrupt metadata", "checkpoint folder '{tmp}/out/checkpoint/step-4' is corrupt",
         build=corrupt_metadata),
    Case("truncated checkpoint shard", "checkpoint '{tmp}/out/checkpoint/step-3' is truncated: '__0_0.distcp' has "
         "1,000 bytes", build=truncated_shard),
    Case("model-only checkpoint cannot continue a run", "'{tmp}/out/checkpoint/step-10' holds model weights only",
         build=model_only_newest),
    Case("seed checkpoint over existing checkpoints", "'checkpoint.create_seed_checkpoint' = true but "
         "'{tmp}/out/checkpoint' already holds checkpoints (steps 3)", build=seed_over_checkpoints),
    Case("load_step that does not exist", "'checkpoint.load_step' = 7: checkpoint folder '{tmp}/out/checkpoint/step-7' "
         "does not exist", ["--checkpoint.enable", "--checkpoint.load_step", "7"]),
    Case("initial_load_path that does not exist", "'checkpoint.initial_load_path' = '/no/such/ckpt' does not exist",
         ["--checkpoint.initial_load_path", "/no/such/ckpt"]),
    Case("initial_load_path that is not a checkpoint", "'checkpoint.initial_load_path' = '{tmp}/weights' is not a DCP "
         "checkpoint", build=not_a_checkpoint),
    # outputs
    Case("output folder that cannot be created", "'job.dump_folder': cannot write to '{tmp}/a_file/out' (Not a "
         "directory)", build=dump_folder_under_a_file),
    Case("custom import that does not import", "'experimental.custom_import' = 'no_such_module_xyz' cannot be imported",
         ["--experimental.custom_import", "no_such_module_xyz"]),
]


def tree_digest(folder: Path) -> dict[str, str]:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def test_the_table_has_at_least_40_cases():
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_exit_2(case: Case, tmp_path, monkeypatch, capsys):
    for name in ("NGPU", "NNODES", "COMM_BACKEND", LAUNCH_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TITAN_LITE_CHECK_ONLY", "1")
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    extra = case.build(tmp_path) if case.build else []
    argv = (["--job.config_file", str(BASE)] if case.base and "--job.config_file" not in extra else [])
    argv += ["--job.dump_folder", str(tmp_path / "out"), *case.argv, *extra]
    before = tree_digest(tmp_path / "out")

    code = main(argv)

    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert case.expected.format(tmp=tmp_path) in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert tree_digest(tmp_path / "out") == before  # checkpoints (and everything else there) untouched
