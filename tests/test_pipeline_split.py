"""Layer split, stage placement and microbatch arithmetic of pipeline parallelism, without processes."""

import pytest
import torch

from titan_lite.errors import ConfigError
from titan_lite.models.args import LlamaArgs
from titan_lite.models.decoder import Llama
from titan_lite.parallel.pipeline import (
    check_pipeline_config,
    microbatch_count,
    prune_to_stage,
    split_layers,
    stage_to_rank,
    stages_of_rank,
    virtual_stage_count,
)


def ranges(*spans: tuple[int, int]) -> list[list[int]]:
    return [list(range(a, b)) for a, b in spans]


@pytest.mark.parametrize("n_layers, stages, first, last, per_stage, expected", [
    # 4 layers + embedding + head = 6 units over 2 stages: 3 each, the ends give one up each.
    (4, 2, 1, 1, None, ranges((0, 2), (2, 4))),
    # 6 units over 4 stages: 1 each plus a remainder of 2 for the inner stages.
    (4, 4, 1, 1, None, ranges((0, 0), (0, 2), (2, 4), (4, 4))),
    # Without the ends counting: an even split.
    (4, 4, 0, 0, None, ranges((0, 1), (1, 2), (2, 3), (3, 4))),
    # 8 layers, 4 stages: 10 units, remainder 2 to stages 1 and 2.
    (8, 4, 1, 1, None, ranges((0, 1), (1, 4), (4, 7), (7, 8))),
    # Remainder 3 over 4 stages: stages 1, 2, then the last.
    (9, 4, 1, 1, None, ranges((0, 1), (1, 4), (4, 7), (7, 9))),
    # 32 layers, 8 stages, layers_per_stage fixed at 4 with no less layers.
    (32, 8, 0, 0, 4, [list(range(4 * i, 4 * i + 4)) for i in range(8)]),
    # 6 layers + 1 + 1 = 8 units, 2 per stage: the ends hold one layer each.
    (6, 4, 1, 1, 2, ranges((0, 1), (1, 3), (3, 5), (5, 6))),
    # Heavier embedding: 13 units = 4 + 5 + 4 (remainder to the middle); the first stage gives up 2 of its 4.
    (10, 3, 2, 1, None, ranges((0, 2), (2, 7), (7, 10))),
    # One stage holds everything.
    (4, 1, 1, 1, None, ranges((0, 4))),
])
def test_split_layers(n_layers, stages, first, last, per_stage, expected):
    got = split_layers(n_layers, stages, first, last, per_stage)
    assert got == expected
    assert sum(got, []) == list(range(n_layers))  # every layer exactly once, in order


@pytest.mark.parametrize("pp, schedule, per_stage, expected", [
    (2, "1F1B", None, 2), (2, "GPipe", None, 2), (2, "Interleaved1F1B", None, 4), (4, "LoopedBFS", None, 8),
    (2, "InterleavedZeroBubble", None, 4), (2, "ZBVZeroBubble", None, 4),
    (2, "Interleaved1F1B", 1, 6),  # 4 layers + 1 + 1 = 6 units of 1 layer -> 6 stages, 3 per rank
    (3, "1F1B", 2, 3),  # 6 units / 2 = 3 stages on 3 ranks
])
def test_virtual_stage_count(pp, schedule, per_stage, expected):
    assert virtual_stage_count(pp, schedule, 4, 1, 1, per_stage) == expected


@pytest.mark.parametrize("pp, schedule, n_layers, per_stage, message", [
    (2, "1F1B", 4, 4, "6 % 4 = 2"),
    (2, "1F1B", 4, 1, "6 stages over pp 2 is 3 per rank"),
    (4, "Interleaved1F1B", 4, 2, "do not divide evenly over 'parallelism.pipeline_parallel_degree' 4"),
    (2, "ZBVZeroBubble", 4, 1, "needs exactly 2 stages per rank"),
])
def test_stage_count_errors_show_the_arithmetic(pp, schedule, n_layers, per_stage, message):
    with pytest.raises(ConfigError, match=message.replace("'", ".")):
        virtual_stage_count(pp, schedule, n_layers, 1, 1, per_stage)


def test_split_refuses_negative_or_empty_stages():
    with pytest.raises(ConfigError, match="stage 0 would hold -1 transformer layers"):
        split_layers(2, 4, 2, 0)  # 4 units, 1 per stage, but the first stage must give up 2
    with pytest.raises(ConfigError, match="= 3 cannot fill 4 pipeline stages"):
        split_layers(1, 4, 1, 1)


def test_stage_to_rank_loop_and_v():
    assert stage_to_rank(4, 2, v_style=False) == [0, 1, 0, 1]
    assert stage_to_rank(8, 4, v_style=False) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert stage_to_rank(4, 2, v_style=True) == [0, 1, 1, 0]
    assert stage_to_rank(8, 4, v_style=True) == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stages_of_rank(0, 8, 4, v_style=True) == [0, 7]
    assert stages_of_rank(3, 8, 4, v_style=True) == [3, 4]
    assert stages_of_rank(1, 6, 2, v_style=False) == [1, 3, 5]


@pytest.mark.parametrize("batch, mbs, schedule, stages, pp, expected", [
    (8, 1, "1F1B", 2, 2, 8), (8, 2, "GPipe", 2, 2, 4), (8, 2, "Interleaved1F1B", 4, 2, 4),
    (8, 4, "GPipe", 2, 2, 2), (4, 1, "ZBVZeroBubble", 4, 2, 4), (2, 1, "Interleaved1F1B", 4, 2, 2),
])
def test_microbatch_count(batch, mbs, schedule, stages, pp, expected):
    assert microbatch_count(batch, mbs, schedule, stages, pp) == expected


@pytest.mark.parametrize("batch, mbs, schedule, stages, pp, message", [
    (8, 3, "GPipe", 2, 2, "'training.local_batch_size' 8 is not a multiple of"),
    (4, 4, "1F1B", 2, 2, r"at least as many microbatches as stages \(2\).* 4 / microbatch_size 4 = 1"),
    (4, 2, "ZBVZeroBubble", 4, 2, r"as stages \(4\)"),
    (5, 1, "Interleaved1F1B", 4, 2, "must be at most 2 or a multiple of 2 rounds"),
])
def test_microbatch_count_errors(batch, mbs, schedule, stages, pp, message):
    with pytest.raises(ConfigError, match=message):
        microbatch_count(batch, mbs, schedule, stages, pp)


def test_prune_to_stage_keeps_names_and_initialises_like_the_full_model():
    args = LlamaArgs(dim=16, n_layers=4, n_heads=2, vocab_size=32, ffn_dim=32, max_seq_len=8)
    with torch.device("meta"):
        full = Llama(args)
    middle = prune_to_stage(full, [1, 2], is_first=False, is_last=False)
    last = prune_to_stage(full, [3], is_first=False, is_last=True)
    assert list(middle.layers.keys()) == ["1", "2"] and middle.tok_embeddings is None and middle.output is None
    assert list(last.layers.keys()) == ["3"] and last.output is not None and last.norm is not None
    assert len(full.layers) == 4  # the meta model itself is untouched
    full.to_empty(device="cpu")
    full.init_weights(seed=3)
    for part in (middle, last):
        part.to_empty(device="cpu")
        part.init_weights(seed=3)
    reference = dict(full.named_parameters())
    for part in (middle, last):
        for name, p in part.named_parameters():
            torch.testing.assert_close(p, reference[name], rtol=0, atol=0)
    # Running the stages in a row is the full model's forward.
    tokens = torch.randint(0, 32, (2, 8))
    first = prune_to_stage(full, [0], is_first=True, is_last=False)  # a copy of the materialised model
    torch.testing.assert_close(last(middle(first(tokens))), full(tokens), rtol=0, atol=0)


def pipeline_cfg(*overrides: str):
    from titan_lite.config import parse_args

    return parse_args(["--job.config_file", "tests/integration/base.toml",
                       "--parallelism.pipeline_parallel_degree", "2", *overrides])


def test_check_pipeline_config_for_a_whole_job():
    num_stages, layers, n_micro = check_pipeline_config(
        pipeline_cfg("--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                     "--parallelism.pipeline_parallel_microbatch_size", "2"), n_layers=4, tied_embeddings=False)
    assert (num_stages, layers, n_micro) == (4, ranges((0, 0), (0, 2), (2, 4), (4, 4)), 4)


def test_tied_embeddings_are_refused_with_pp():
    with pytest.raises(ConfigError, match="ties its input embedding to the output head"):
        check_pipeline_config(pipeline_cfg("--model.flavor", "smollm2_135M"), n_layers=30, tied_embeddings=True)


def test_validation_batches_must_suit_the_schedule():
    cfg = pipeline_cfg("--validation.enable", "--validation.local_batch_size", "1")
    with pytest.raises(ConfigError, match=r"'validation.local_batch_size' 1 / microbatch_size 1 = 1"):
        check_pipeline_config(cfg, n_layers=4, tied_embeddings=False)
