"""Config loading: precedence, CLI forms, torchtitan TOMLs, and one-line errors for bad input."""

import subprocess
from pathlib import Path

import pytest

from tests.warm_python import python_command
from titan_lite.config import parse_args, to_toml, validate
from titan_lite.config.manager import help_text, iter_options
from titan_lite.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

APPENDIX = """
[job]
dump_folder = "./outputs"
description = "Llama 3.1 8B training"
[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100
[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"
[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8
[lr_scheduler]
warmup_steps = 50
[training]
local_batch_size = 2
seq_len = 512
max_norm = 1.0
steps = 200
dataset = "c4"
mixed_precision_param = "float32"
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1
[checkpoint]
enable = true
folder = "checkpoint"
interval = 100
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled"
[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
[compile]
enable = true
components = ["model", "loss"]
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_appendix_torchtitan_config_loads(tmp_path):
    cfg = parse_args(["--job.config_file", write(tmp_path, APPENDIX)])
    validate(cfg)
    assert (cfg.model.flavor, cfg.training.steps, cfg.optimizer.lr) == ("8B", 200, 3e-4)
    assert cfg.compile.components == ["model", "loss"] and cfg.activation_checkpoint.selective_ac_option == "op"
    assert cfg.parallelism.data_parallel_shard_degree == -1 and cfg.checkpoint.interval == 100


def test_precedence_cli_over_toml_over_default(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n")
    cfg = parse_args(["--job.config_file", path, "--training.steps", "9"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.training.local_batch_size == 8  # default


@pytest.mark.parametrize("argv, expected", [
    (["--compile.enable"], True),
    (["--compile.enable=false"], False),
    (["--compile.enable", "true"], True),
    (["--no-compile.enable"], False),
])
def test_boolean_forms(argv, expected):
    assert parse_args(argv).compile.enable is expected


def test_value_forms_and_lists():
    cfg = parse_args(["--training.steps=12", "--model.converters", "lora,prune",
                      "--checkpoint.initial_load_path", "none", "--optimizer.lr", "1e-3",
                      "--training.global_batch_size", "-1"])
    assert cfg.training.steps == 12 and cfg.model.converters == ["lora", "prune"]
    assert cfg.checkpoint.initial_load_path is None and cfg.optimizer.lr == 1e-3
    assert cfg.training.global_batch_size == -1


def test_toml_ints_accepted_for_floats(tmp_path):
    cfg = parse_args(["--job.config_file", write(tmp_path, "[optimizer]\nlr = 1\n")])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


@pytest.mark.parametrize("toml, message", [
    ("[training]\nstepz = 3\n", "unknown key 'training.stepz' (did you mean 'training.steps'?)"),
    ("[trainin]\nsteps = 3\n", "unknown key 'trainin'"),
    ("[training]\nsteps = \"ten\"\n", "'training.steps' expects an integer, got 'ten'"),
    ("[compile]\nenable = 1\n", "'compile.enable' expects true or false, got 1"),
])
def test_toml_errors_name_the_key(tmp_path, toml, message):
    with pytest.raises(ConfigError) as exc:
        parse_args(["--job.config_file", write(tmp_path, toml)])
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("argv, message", [
    (["--training.stpes", "3"], "unknown option '--training.stpes' (did you mean 'training.steps'?)"),
    (["--training.steps", "abc"], "--training.steps: expected an integer, got 'abc'"),
    (["--training.steps"], "--training.steps: expects an integer after it"),
    (["training.steps"], "unexpected argument 'training.steps'"),
])
def test_cli_errors_name_the_key(argv, message):
    with pytest.raises(ConfigError) as exc:
        parse_args(argv)
    assert message in str(exc.value)


@pytest.mark.parametrize("argv, message", [
    (["--training.steps", "-5"], "'training.steps' must be at least 1, got -5"),
    (["--optimizer.lr", "0"], "'optimizer.lr' must be positive, got 0.0"),
    (["--parallelism.tensor_parallel_degree", "0"], "'parallelism.tensor_parallel_degree' must be at least 1, got 0"),
    (["--lr_scheduler.decay_type", "cubic"], "'lr_scheduler.decay_type' = 'cubic' is not one of: linear, sqrt, cosine"),
    (["--optimizer.early_step_in_backward"],
     "'optimizer.early_step_in_backward' = True is not supported: early_step_in_backward is not implemented"),
    (["--parallelism.enable_async_tensor_parallel"], "not supported: async tensor parallel"),
    (["--fault_tolerance.enable"], "not supported: fault tolerance"),
    (["--activation_checkpoint.selective_ac_option", "x"], "must be 'op' or a positive integer"),
    (["--training.local_batch_size", "0"], "'training.local_batch_size' must be at least 1, got 0"),
    (["--training.dataloader.num_workers", "-1"], "'training.dataloader.num_workers' must be at least 0, got -1"),
    (["--training.dataloader.prefetch_factor", "2"],
     "'training.dataloader.prefetch_factor' = 2 needs 'training.dataloader.num_workers' > 0"),
    (["--validation.enable", "--validation.dataloader.persistent_workers"],
     "'validation.dataloader.persistent_workers' = true needs 'validation.dataloader.num_workers' > 0"),
    (["--parallelism.data_parallel_shard_degree", "0"],
     "'parallelism.data_parallel_shard_degree' must be -1 or positive, got 0"),
    (["--training.dataset_path", "/no/such/shards"], "'training.dataset_path' = '/no/such/shards' does not exist"),
])
def test_impossible_values_rejected(argv, message):
    with pytest.raises(ConfigError) as exc:
        validate(parse_args(argv))
    assert message in str(exc.value)


def test_literal_field_from_cli():
    assert parse_args(["--optimizer.name", "Adam"]).optimizer.name == "Adam"
    cfg = parse_args(["--parallelism.context_parallel_load_balancer", "none"])
    assert cfg.parallelism.context_parallel_load_balancer == "none"  # a value, so it survives to_toml
    cfg = parse_args(["--parallelism.context_parallel_load_balancer", "null"])
    assert cfg.parallelism.context_parallel_load_balancer is None
    with pytest.raises(ConfigError) as exc:
        parse_args(["--optimizer.name", "SGD"])
    assert str(exc.value) == "'optimizer.name' = 'SGD' is not one of: AdamW, Adam"
    with pytest.raises(ConfigError) as exc:
        parse_args(["--optimizer.name"])
    assert str(exc.value) == "--optimizer.name: expects AdamW | Adam after it"


@pytest.mark.parametrize("value, message", [
    ('"cubic"', "'lr_scheduler.decay_type' = 'cubic' is not one of: linear, sqrt, cosine"),
    ("3", "'lr_scheduler.decay_type' = 3 is not one of: linear, sqrt, cosine"),
])
def test_literal_field_from_toml(tmp_path, value, message):
    cfg = parse_args(["--job.config_file", write(tmp_path, '[lr_scheduler]\ndecay_type = "cosine"\n')])
    assert cfg.lr_scheduler.decay_type == "cosine"
    path = write(tmp_path, f"[lr_scheduler]\ndecay_type = {value}\n")
    with pytest.raises(ConfigError) as exc:
        parse_args(["--job.config_file", path])
    assert str(exc.value) == f"{path}: {message}"


def test_validate_checks_literal_values_set_in_code():
    cfg = parse_args([])
    cfg.checkpoint.async_mode = "threads"
    with pytest.raises(ConfigError) as exc:
        validate(cfg)
    assert str(exc.value) == "'checkpoint.async_mode' = 'threads' is not one of: disabled, async, async_with_pinned_mem"


def test_help_lists_literal_choices():
    assert "--optimizer.name (AdamW | Adam, default 'AdamW'): Optimizer." in help_text()


def test_inert_torchtitan_keys_load_while_off(tmp_path):
    toml = ("[metrics]\nenable_wandb = false\n[fault_tolerance]\nenable = false\n"
            "[quantize.linear.float8]\nenable_fsdp_float8_all_gather = true\nrecipe_name = \"rowwise\"\n"
            "[parallelism]\nenable_async_tensor_parallel = false\nexpert_parallel_degree = 1\n")
    cfg = parse_args(["--job.config_file", write(tmp_path, toml)])
    validate(cfg)
    assert cfg.quantize.linear.float8.recipe_name == "rowwise"


def test_every_option_is_documented_in_help():
    text = help_text()
    for key, f, _ in iter_options():
        assert f.metadata["help"], key
        assert f"--{key} (" in text


def test_to_toml_round_trips(tmp_path):
    cfg = parse_args(["--training.steps", "3", "--model.converters", "a,b", "--compile.enable"])
    again = parse_args(["--job.config_file", write(tmp_path, to_toml(cfg))])
    again.job.config_file = cfg.job.config_file
    assert again == cfg


def test_help_command_lists_options():
    out = subprocess.run([*python_command(), "-m", "titan_lite.train", "--help"], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 0
    assert "--training.steps (an integer, default 10000): Optimizer steps to train." in out.stdout
    assert "--parallelism.data_parallel_shard_degree" in out.stdout
