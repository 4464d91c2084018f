"""No silent no-op: a setting that would have no effect in the configuration it is given in is refused with one
line (or warned about, where torchtitan accepts it inert). The schema says which switch each setting is behind (a
converter, a section's enable, an enable_<name> key, a condition such as an instruct dataset); the walk over every
section checks each key behind each switch."""

import dataclasses
import logging
import types
import typing

import pytest

from titan_lite.config import parse_args, schema, validate
from titan_lite.config.gates import switched_off_settings
from titan_lite.config.manager import choices_of, iter_options, iter_sections
from titan_lite.config.schema import JobConfig, Metrics, opt
from titan_lite.errors import ConfigError
from titan_lite.models.flavors import flavor_args
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.transforms import build_transforms, registered_transforms

F8 = "quantize.linear.float8"


def refusal(*argv: str) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(parse_args(list(argv)))
    return str(caught.value)


def test_lora_settings_without_the_lora_converter_are_refused():
    assert refusal("--lora.base_dtype", "nf4") == (
        "'lora.base_dtype' = 'nf4' has no effect: [lora] is read only by the 'lora' converter, which "
        "'model.converters' = [] does not list; add it (--model.converters lora) or drop the setting")
    assert refusal("--model.converters", "prune", "--lora.rank", "16", "--lora.alpha", "32").startswith(
        "'lora.rank' = 16 (and 1 more [lora] setting) has no effect: [lora] is read only by the 'lora' converter, "
        "which 'model.converters' = ['prune'] does not list; add it (--model.converters prune,lora)")
    validate(parse_args(["--model.converters", "lora", "--lora.base_dtype", "nf4"]))  # with the converter: fine


def test_every_converter_section_is_checked_and_names_a_registered_converter():
    owned = {key: f.metadata["converter"] for key, f, _ in iter_sections() if f.metadata.get("converter")}
    assert owned == {"lora": "lora", "pruning": "prune", "sheared": "sheared", F8: F8}
    assert set(owned.values()) <= set(registered_transforms())
    assert refusal("--pruning.sparsity", "0.7").startswith("'pruning.sparsity' = 0.7 has no effect: [pruning] is "
                                                            "read only by the 'prune' converter")
    assert refusal("--sheared.target_layers", "4").startswith("'sheared.target_layers' = 4 has no effect")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_torchtitans_float8_section_without_its_converter_is_a_warning():
    """torchtitan TOMLs set [quantize.linear.float8] whether or not the converter is on: they keep loading."""
    # A handler on titan_lite's own logger: init_logger (another test's run) stops its propagation to pytest's.
    logger, records = logging.getLogger("titan_lite"), _Records()
    logger.addHandler(records)
    try:
        validate(parse_args([f"--{F8}.recipe_name", "rowwise"]))
    finally:
        logger.removeHandler(records)
    assert [r.getMessage() for r in records.records] == [
        f"'{F8}.recipe_name' = 'rowwise' has no effect: [{F8}] is read only by the '{F8}' converter, which "
        f"'model.converters' = [] does not list; add it (--model.converters {F8}) or drop the setting"]


@pytest.mark.parametrize("entry, hint", [("outptu", "did you mean 'output'? "), ("nothing_like_it", "")])
def test_a_float8_filter_entry_that_matches_no_linear_is_refused(entry, hint):
    """A typo in filter_fqns would put the head meant for high precision into float8."""
    cfg = parse_args(["--model.converters", F8, f"--{F8}.filter_fqns", f"layers.1.attention.wo,{entry}"])
    (transform,) = build_transforms(cfg)
    with pytest.raises(ConfigError) as caught:
        transform.check(flavor_args("tiny"), ParallelDims.from_config(cfg.parallelism, 1))
    assert str(caught.value) == (
        f"'{F8}.filter_fqns' entry '{entry}' matches no linear of the model, so it keeps none in high precision "
        f"({hint}the linears are named like 'layers.0.attention.wq' and 'output'; an entry matches every name "
        "containing it)")


# ------------------------------------------------------------------------------------------ switches that are off

# What a setting behind each section's `enable` gets while it is off: a warning (True) on torchtitan's sections,
# whose published TOMLs set such keys with enable = false, a refusal (False) on titan_lite's own. A new section
# with an `enable` key must be added here, with its choice.
ENABLE_SECTIONS = {"checkpoint": True, "compile": True, "validation": True, "memory_estimation": True,
                   "fault_tolerance": True, "data_mixture": False, "distill": False}
# Keys read whatever their section's `enable` says (a run that does not checkpoint still starts from these weights).
READ_WHILE_OFF = {"checkpoint.initial_load_path", "checkpoint.initial_load_model_only", "checkpoint.initial_load_in_hf",
                  "checkpoint.initial_load_in_hf_quantized"}
# Every `enable_<name>` key that switches other keys of its section, with those keys.
NAMED_SWITCHES = {
    "profiling.enable_profiling": {"profiling.save_traces_folder", "profiling.profile_freq",
                                   "profiling.profiler_active", "profiling.profiler_warmup"},
    "profiling.enable_memory_snapshot": {"profiling.save_memory_snapshot_folder"},
    "metrics.enable_tensorboard": {"metrics.save_tb_folder", "metrics.save_for_all_ranks"},
    "metrics.enable_wandb": {"metrics.save_for_all_ranks"},  # either switch will do for it
}


def another_value(tp, default):
    """A value of the field's type that is not its default."""
    choices = choices_of(tp)
    if choices:
        return next(c for c in choices if c != default)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType)
    base = next(a for a in typing.get_args(tp) if a is not type(None)) if optional else tp  # X | None -> X
    if typing.get_origin(base) is list:
        return [1.5] if typing.get_args(base)[0] is float else ["x"]
    return {bool: lambda: not default, int: lambda: (default or 0) + 1, float: lambda: (default or 0.0) + 0.5,
            str: lambda: (default or "") + "x"}[base]()


def default_of(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def set_key(cfg, key: str, value) -> None:
    *path, leaf = key.split(".")
    holder = cfg
    for part in path:
        holder = getattr(holder, part)
    setattr(holder, leaf, value)


def lines_for(key: str, value, schema=JobConfig, **switches) -> list[tuple[str, bool]]:
    cfg = schema()
    for name, on in switches.items():
        set_key(cfg, name.replace("__", "."), on)
    set_key(cfg, key, value)
    return switched_off_settings(cfg)


def test_every_setting_behind_an_enable_switch_is_one_line_while_it_is_off():
    """The walk over every section of the schema: each key of a section with `enable` (its sub-sections' too), set
    away from its default while the section is off, is exactly one line naming the key and the switch (a refusal or
    a warning, as ENABLE_SECTIONS says); with the switch on it is none."""
    walked = set()
    for section, f, cls in iter_sections():
        if "enable" not in {g.name for g in dataclasses.fields(cls)}:
            continue
        walked.add(section)
        assert bool(f.metadata.get("inert")) is ENABLE_SECTIONS[section], section
        for leaf, g, tp in iter_options(cls):
            key = f"{section}.{leaf}"
            if leaf == "enable":
                continue
            value = another_value(tp, default_of(g))
            if key in READ_WHILE_OFF:
                assert lines_for(key, value) == [], key
                continue
            assert lines_for(key, value) == [(
                f"'{key}' = {value!r} has no effect: it takes effect only with '{section}.enable' = true, and that "
                f"is false; set --{section}.enable or drop the setting", ENABLE_SECTIONS[section])], key
            assert lines_for(key, value, **{f"{section}__enable": True}) == [], key
    assert walked == set(ENABLE_SECTIONS)


def test_every_enable_name_switch_covers_the_keys_that_name_it():
    found: dict[str, set[str]] = {}
    for section, _, cls in iter_sections():
        switches = [g.name for g in dataclasses.fields(cls) if g.name.startswith("enable_") and g.type is bool]
        for leaf, g, tp in iter_options(cls):
            key = f"{section}.{leaf}"
            lines = lines_for(key, another_value(tp, default_of(g)))
            for name in switches:
                if any(f"effect only with '{section}.{name}'" in line or f" or '{section}.{name}' = true" in line
                       for line, _ in lines):
                    found.setdefault(f"{section}.{name}", set()).add(key)
    assert found == NAMED_SWITCHES


def test_torchtitans_own_tomls_load_with_their_checkpoint_and_validation_keys_while_off(tmp_path):
    """torchtitan v0.2.2's llama3_8b.toml and qwen3_0.6b.toml set [checkpoint] and [validation] keys with
    enable = false: they load, with one warning per section naming the keys and the switch."""
    toml = ('[profiling]\nenable_profiling = false\nsave_traces_folder = "profile_trace"\nprofile_freq = 100\n'
            '[checkpoint]\nenable = false\nfolder = "checkpoint"\ninterval = 500\nlast_save_model_only = true\n'
            'export_dtype = "float16"\nasync_mode = "disabled"\n'
            '[compile]\nenable = false\ncomponents = ["model", "loss"]\n'
            '[validation]\nenable = false\ndataset = "c4_validation"\nfreq = 500\nsteps = 1200\n')
    (tmp_path / "llama3_8b.toml").write_text(toml)
    cfg = parse_args(["--job.config_file", str(tmp_path / "llama3_8b.toml")])
    assert switched_off_settings(cfg) == [
        ("'checkpoint.last_save_model_only' = True (and 1 more [checkpoint] setting) has no effect: they take effect "
         "only with 'checkpoint.enable' = true, and that is false; set --checkpoint.enable or drop the setting", True),
        ("'validation.dataset' = 'c4_validation' (and 2 more [validation] settings) has no effect: they take effect "
         "only with 'validation.enable' = true, and that is false; set --validation.enable or drop the setting",
         True),
        ("'profiling.profile_freq' = 100 has no effect: it takes effect only with 'profiling.enable_profiling' = "
         "true, and that is false; set --profiling.enable_profiling or drop the setting", True)]
    validate(cfg)  # warnings only


def test_sections_and_keys_added_later_are_covered_without_a_change_to_the_rule():
    """A [preference] section with `enable`, a W&B key beside metrics.enable_wandb, an MoE section switched by a
    boolean `enable_<name>`: declared as usual, each is one line while its switch is off."""
    @dataclasses.dataclass
    class Preference:
        enable: bool = opt(False, "Preference tuning.")
        beta: float = opt(0.1, "DPO beta.")

    @dataclasses.dataclass
    class Moe:
        num_experts: int = opt(8, "Experts per layer.")
        enable_load_balance: bool = opt(False, "Auxiliary load-balancing loss.")
        load_balance_coeff: float = opt(0.01, "Weight of the load-balancing loss.")

    @dataclasses.dataclass
    class MetricsWithWandb(Metrics):
        wandb_project: str = opt("", "W&B project.")

    @dataclasses.dataclass
    class Later(JobConfig):
        metrics: MetricsWithWandb = schema.section(MetricsWithWandb, "Metrics.", inert=True)
        preference: Preference = schema.section(Preference, "Preference tuning.")
        moe: Moe = schema.section(Moe, "MoE.")

    assert lines_for("preference.beta", 0.2, Later) == [(
        "'preference.beta' = 0.2 has no effect: it takes effect only with 'preference.enable' = true, and that is "
        "false; set --preference.enable or drop the setting", False)]
    assert lines_for("moe.load_balance_coeff", 0.1, Later) == [(
        "'moe.load_balance_coeff' = 0.1 has no effect: it takes effect only with 'moe.enable_load_balance' = true, "
        "and that is false; set --moe.enable_load_balance or drop the setting", False)]
    assert lines_for("moe.num_experts", 4, Later) == []  # no switch: always read
    assert lines_for("metrics.wandb_project", "p", Later) == [(
        "'metrics.wandb_project' = 'p' has no effect: it takes effect only with 'metrics.enable_wandb' = true, and "
        "that is false; set --metrics.enable_wandb or drop the setting", True)]
    assert lines_for("preference.beta", 0.2, Later, preference__enable=True) == []


def test_a_section_switched_off_in_so_many_words_keeps_its_settings_with_a_warning(tmp_path):
    """docs/distillation.md's control run takes the distillation TOML with --distill.enable=false: the section is off
    on purpose, so its teacher is a warning; the same teacher without the switch ever named is refused."""
    line = ("'distill.teacher_path' = '/t' has no effect: it takes effect only with 'distill.enable' = true, and that "
            "is false; set --distill.enable or drop the setting")
    assert switched_off_settings(parse_args(["--distill.teacher_path", "/t"])) == [(line, False)]
    assert switched_off_settings(parse_args(["--distill.teacher_path", "/t", "--distill.enable=false"])) == [
        (line, True)]
    (tmp_path / "job.toml").write_text('[distill]\nenable = true\nteacher_path = "/t"\n')
    assert switched_off_settings(parse_args(["--job.config_file", str(tmp_path / "job.toml"),
                                             "--no-distill.enable"])) == [(line, True)]
    with pytest.raises(ConfigError, match="'distill.teacher_path' = '/t' has no effect"):
        validate(parse_args(["--distill.teacher_path", "/t"]))


def test_preference_settings_their_loss_does_not_read_are_refused():
    """Settings a preference loss does not read (schema.When: a condition on another key's value) are one line each,
    before any path they name is looked at."""
    dpo = ("--training.dataset", "preference")
    assert refusal(*dpo, "--preference.loss", "simpo", "--preference.reference", "/no/such/folder") == (
        "'preference.reference' = '/no/such/folder' has no effect: it takes effect only when 'preference.loss' is one "
        "that compares with a reference (sigmoid, hinge or ipo), and it is 'simpo'; set --preference.loss sigmoid or "
        "drop the setting")
    assert refusal(*dpo, "--preference.loss", "orpo", "--preference.reference_flavor", "1B").startswith(
        "'preference.reference_flavor' = '1B' has no effect: it takes effect only when 'preference.loss' is one that "
        "compares with a reference")
    assert refusal(*dpo, "--preference.robust") == (
        "'preference.robust' = True has no effect: it takes effect only when 'preference.label_smoothing' is above 0 "
        "(the share of flipped labels it corrects for), and it is 0.0; set --preference.label_smoothing 0.1 or drop "
        "the setting")
    assert refusal(*dpo, "--preference.loss", "hinge", "--preference.simpo_gamma", "1.0") == (
        "'preference.simpo_gamma' = 1.0 has no effect: it takes effect only when 'preference.loss' is 'simpo', and it "
        "is 'hinge'; set --preference.loss simpo or drop the setting")
    validate(parse_args([*dpo, "--preference.loss", "simpo", "--preference.simpo_gamma", "1.0"]))
    validate(parse_args([*dpo, "--preference.robust", "--preference.label_smoothing", "0.1"]))
