"""Data mixtures: Sheared-LLaMA's weight update, seeded per-sample domain draws, exact restarts of the loader,
per-sample losses, config errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from titan_lite.config import parse_args, validate
from titan_lite.config.schema import DataMixture
from titan_lite.data.batch import Batch
from titan_lite.data.dataloader import BatchLayout, DataLoader, LoaderOptions
from titan_lite.data.mixture import DomainWeights, MixtureSource, sheared_update
from titan_lite.errors import ConfigError
from titan_lite.loss import cross_entropy_per_sample, cross_entropy_sum


class CountingSource:
    """Endless samples ([d, i], [d, i]) of domain d: i counts the domain's samples, so a stream shows its position."""

    def __init__(self, domain: int):
        self.domain = domain
        self.name = f"d{domain}"

    def samples(self, state=None):
        i = 0 if state is None else state["i"]
        while True:
            tokens = torch.tensor([self.domain, i])
            i += 1
            yield (tokens, tokens.clone()), {"i": i}


def mixture(weights: list[float], seed: int = 0) -> MixtureSource:
    return MixtureSource([f"d{i}" for i in range(len(weights))], [CountingSource(i) for i in range(len(weights))],
                         weights, seed)


# ------------------------------------------------------------------------------ the update rule


def test_update_matches_a_hand_computation():
    # alpha ~ w x exp(loss - ref): 0.5 e^0.5 = 0.824361, 0.3 e^-0.5 = 0.181959, 0.2 e^1 = 0.543656 (sum 1.549976)
    # -> alpha = 0.531851, 0.117395, 0.350751; w = 0.9999 alpha + 1e-4 / 3.
    new = sheared_update([0.5, 0.3, 0.2], [2.5, 1.0, 3.0], [2.0, 1.5, 2.0], eta=1.0, smoothing=1e-4)
    assert new == pytest.approx([0.531834, 0.117416, 0.350750], abs=2e-6)
    # The paper's clipped gap: the domain below its reference counts as gap 0 (0.3 e^0 = 0.3).
    clipped = sheared_update([0.5, 0.3, 0.2], [2.5, 1.0, 3.0], [2.0, 1.5, 2.0], clip=True)
    assert clipped == pytest.approx([0.494200, 0.179870, 0.325930], abs=2e-6)
    # eta scales the gap: eta 2 on gaps (0.5, -0.5, 1) equals eta 1 on (1, -1, 2).
    assert sheared_update([0.5, 0.3, 0.2], [2.5, 1.0, 3.0], [2.0, 1.5, 2.0], eta=2.0) == pytest.approx(
        sheared_update([0.5, 0.3, 0.2], [3.0, 0.5, 4.0], [2.0, 1.5, 2.0]), abs=1e-12)


def test_domain_with_no_tokens_keeps_its_weight():
    new = sheared_update([0.5, 0.3, 0.2], [2.5, math.nan, 3.0], [2.0, 1.5, 2.0])
    assert new[1] == 0.3 and sum(new) == pytest.approx(1.0, abs=1e-12)
    assert new[0] / new[2] == pytest.approx(0.5 * math.exp(0.5) / (0.2 * math.exp(1.0)), rel=1e-3)
    assert sheared_update([0.6, 0.4], [math.nan, math.nan], [1.0, 1.0]) == [0.6, 0.4]
    # Through the controller: domain 1 had no tokens in the window (count 0): no NaN anywhere.
    weights = DomainWeights(DataMixture(reference_losses=[2.0, 2.0], update_freq=2), mixture([0.5, 0.5]))
    weights.observe(torch.tensor([[30.0, 0.0], [10.0, 0.0]], dtype=torch.float64), step=1)
    weights.observe(torch.tensor([[10.0, 0.0], [10.0, 0.0]], dtype=torch.float64), step=2)
    assert weights.weights[1] == 0.5 and not any(math.isnan(w) for w in weights.weights)
    assert weights.last_losses[0] == 2.0 and math.isnan(weights.last_losses[1])
    assert set(weights.metrics()) == {"mixture_weight/d0", "mixture_weight/d1", "mixture_loss/d0"}


def test_weights_move_towards_the_domain_furthest_above_its_reference():
    weights = DomainWeights(DataMixture(reference_losses=[1.0, 1.0], update_freq=1), mixture([0.5, 0.5]))
    for step in range(1, 4):  # domain 0: loss 3 (gap 2), domain 1: loss 1.5 (gap 0.5)
        weights.observe(torch.tensor([[30.0, 15.0], [10.0, 10.0]], dtype=torch.float64), step)
    assert weights.weights[0] == pytest.approx(1 / (1 + math.exp(-1.5 * 3)), abs=1e-3)


# ------------------------------------------------------------------------------ drawing samples


def domains_of(source: MixtureSource, n: int, state=None) -> list[int]:
    it = source.samples(state)
    return [next(it)[0].domain for _ in range(n)]


def test_sampled_proportions_follow_the_weights():
    drawn = domains_of(mixture([6.0, 3.0, 1.0], seed=7), 10000)
    shares = [drawn.count(d) / len(drawn) for d in range(3)]
    assert shares == pytest.approx([0.6, 0.3, 0.1], abs=0.015)  # 3 standard errors
    assert domains_of(mixture([6.0, 3.0, 1.0], seed=7), 200) == drawn[:200]  # seeded: the same draws
    assert domains_of(mixture([6.0, 3.0, 1.0], seed=8), 200) != drawn[:200]
    assert set(domains_of(mixture([1.0, 0.0, 1.0]), 500)) == {0, 2}  # a zero weight is never drawn


def test_samples_continue_every_domain_from_a_state():
    source = mixture([0.5, 0.5], seed=3)
    it = source.samples()
    items = [next(it) for _ in range(30)]
    restarted = source.samples(items[9][1])
    for (sample, state), (again, again_state) in zip(items[10:], restarted, strict=False):
        assert sample.domain == again.domain and state == again_state
        assert all(torch.equal(a, b) for a, b in zip(sample.sample, again.sample, strict=True))


def read_global_batches(loader: DataLoader, it, n: int) -> list[Batch]:
    return [next(it) for _ in range(n * loader.layout.accumulation)]


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_restarts_exactly_after_a_weight_change(workers):
    """A weight change between global batches drops what was read ahead (workers, prefetch) with the old weights:
    the batches after it equal those of a loader restarted from the checkpointed position with the new weights."""
    layout = BatchLayout(2, 0, 1, accumulation=2)
    options = LoaderOptions(num_workers=workers, start_method="forkserver")
    loader = DataLoader(mixture([0.9, 0.1], seed=1), layout, options)
    it = iter(loader)
    read_global_batches(loader, it, 2)
    state = loader.state_dict()
    loader.source.set_weights([0.1, 0.9])
    after = read_global_batches(loader, it, 2)
    fresh = DataLoader(mixture([0.1, 0.9], seed=1), layout, options)
    fresh.load_state_dict(state)
    expected = read_global_batches(fresh, iter(fresh), 2)
    assert all(x.equal(y) for x, y in zip(after, expected, strict=True))
    domains = torch.cat([batch.domains for batch in after])
    assert domains.float().mean() > 0.6  # drawn with the new weights, not the 0.9 / 0.1 read ahead
    # Positions continue per domain: every domain's counter rises by one per sample of that domain.
    tokens = torch.cat([batch.inputs for batch in after])
    for d in (0, 1):
        counters = tokens[tokens[:, 0] == d][:, 1]
        assert len(counters) == 0 or torch.equal(counters, torch.arange(counters[0], counters[0] + len(counters)))


# ------------------------------------------------------------------------------ per-sample losses


def test_per_sample_loss_splits_the_sum_with_the_same_gradient():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5))
    labels[1, 2:] = -100
    per_sample = cross_entropy_per_sample(logits, labels)
    expected = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100).sum(dim=1)
    assert torch.allclose(per_sample, expected, atol=1e-6)
    weights = torch.tensor([1.0, 2.0, 3.0])
    (per_sample * weights).sum().backward()
    grad = logits.grad.clone()
    logits.grad = None
    sum(w * cross_entropy_sum(logits[i:i + 1], labels[i:i + 1]) for i, w in enumerate(weights)).backward()
    assert torch.allclose(grad, logits.grad, atol=1e-6)


# ------------------------------------------------------------------------------ config errors


def checked(tmp_path, *overrides: str) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a"}\n')
    cfg = parse_args(["--data_mixture.enable", "--data_mixture.dataset_paths", f"{path},{path}", *overrides])
    validate(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["--data_mixture.weights", "0.5,0.3,0.2"], "'data_mixture.weights' has 3 entries but 'data_mixture.dataset_paths' "
                                                "has 2 domains"),
    (["--data_mixture.reference_losses", "2.0"], "'data_mixture.reference_losses' has 1 entries"),
    (["--data_mixture.weights", "0.5,-0.1"], "'data_mixture.weights[1]' = -0.1 must be a number >= 0"),
    (["--data_mixture.weights", "0,0"], "'data_mixture.weights' are all 0"),
    (["--data_mixture.smoothing", "1.5"], "'data_mixture.smoothing' must be in [0, 1)"),
    (["--data_mixture.weights", "0.5,x"], "--data_mixture.weights: expected a list of numbers"),
    (["--training.epochs", "1"], "'training.epochs' counts passes over 'training.dataset'"),
])
def test_config_errors_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as err:
        checked(tmp_path, *overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_domain_path_is_named(tmp_path):
    cfg = parse_args(["--data_mixture.enable", "--data_mixture.dataset_paths", f"{tmp_path},{tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match=r"'data_mixture.dataset_paths\[1\]' = '.*nope' does not exist"):
        validate(cfg)


def test_a_checkpoint_of_the_other_kind_is_one_line():
    with pytest.raises(ConfigError, match="position is for a single dataset"):
        next(mixture([0.5, 0.5]).samples({"epoch": 0, "position": {}, "buffer": [], "num_shards": 1}))


def test_a_token_folder_of_rows_as_a_domain_says_domains_are_text(tmp_path):
    from tests.test_token_runs import rows_token_folder, write_data
    from titan_lite.job.plan import check_training_data

    text = write_data(tmp_path)[1]
    rows = rows_token_folder(tmp_path)
    cfg = parse_args(["--data_mixture.enable", "--data_mixture.dataset_paths", f"{text},{rows}"])
    with pytest.raises(ConfigError, match=r"^'data_mixture.dataset_paths\[1\]' = '.*rows_tokens' holds instruct token "
                                          r"files, but a data mixture's domains are pre-training text: tokenize that "
                                          r"data with --kind text, or train on its rows alone \(training.dataset = "
                                          r"'instruct', no data_mixture\)$"):
        check_training_data(cfg)
