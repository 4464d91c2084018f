"""No silent no-op: a setting that would have no effect in the configuration it is given in is refused with one
line (or warned about, where torchtitan accepts it inert). The config knows which converter reads which section."""

import logging

import pytest

from titan_lite.config import parse_args, validate
from titan_lite.config.manager import iter_sections
from titan_lite.errors import ConfigError
from titan_lite.models.llama.args import flavor_args
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
