"""Data mixtures: samples drawn from several domains by weight, and Sheared-LLaMA's per-domain weight update."""

import bisect
import hashlib
import itertools
import logging
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from titan_lite.config.schema import DataMixture
from titan_lite.data.batch import Drawn
from titan_lite.data.datasets import (
    DocumentStream,
    PackedSource,
    TokenizerLike,
    check_has_documents,
    shards_at,
)
from titan_lite.data.indexed import IndexedSource, TokenWindows, token_windows
from titan_lite.data.token_files import TokenTable, is_token_folder, open_token_folder, quote_path
from titan_lite.errors import ConfigError

logger = logging.getLogger(__name__)


def normalised(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def uniform_draw(seed: int, index: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, index): a counter-based generator (a hash of both),
    so its whole state is the index, and a resume, a worker or another rank draws exactly the same numbers."""
    digest = hashlib.blake2b(struct.pack("<qq", seed, index), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / (1 << 53)


def draw_domain(seed: int, index: int, cumulative: list[float]) -> int:
    """The domain of sample `index` of the stream, given the cumulative weights."""
    return min(bisect.bisect_right(cumulative, uniform_draw(seed, index)), len(cumulative) - 1)


class MixtureSource:
    """A SampleSource over several PackedSources: each sample comes from domain d with probability weights[d] and
    comes as Drawn(sample, d). Every rank draws the same domains (same seed, same sample index).

    Its state is every domain's state plus the count of samples drawn. The weights are not part of it: they are
    set between steps by DomainWeights (which checkpoints them); `version` counts the changes, so that the data
    loader restarts its reading (its workers hold a copy of this object) from the last global batch it consumed.
    """

    def __init__(self, names: list[str], sources: list[PackedSource | TokenWindows], weights: list[float], seed: int):
        self.names = names
        self.sources = sources
        self.weights = normalised(weights)
        self.seed = seed
        self.version = 0
        self.name = "mixture(" + ",".join(names) + ")"

    def set_weights(self, weights: list[float], normalise: bool = True) -> None:
        """New weights for the next global batch on; a checkpoint's are restored as saved (normalise=False), so a
        resumed run holds the very floats of an uninterrupted one."""
        self.weights = normalised(weights) if normalise else list(weights)
        self.version += 1

    def samples(self, state: dict[str, Any] | None = None) -> Iterator[tuple[Drawn, dict[str, Any]]]:
        state = self._checked(state) if state is not None else {"domains": [None] * len(self.sources), "drawn": 0}
        domain_states, drawn = list(state["domains"]), state["drawn"]
        streams = [source.refs(s) if isinstance(source, IndexedSource) else source.samples(s)
                   for source, s in zip(self.sources, domain_states, strict=True)]
        cumulative = list(itertools.accumulate(self.weights))
        while True:
            domain = draw_domain(self.seed, drawn, cumulative)
            drawn += 1
            sample, domain_states[domain] = next(streams[domain])
            yield Drawn(sample, domain), {"domains": list(domain_states), "drawn": drawn, "names": self.names}

    def _checked(self, state: dict[str, Any]) -> dict[str, Any]:
        if "names" not in state:
            raise ConfigError("the checkpoint's data position is for a single dataset, this run draws from "
                              "'data_mixture' domains; start a new run (job.dump_folder) or disable data_mixture")
        if state["names"] != self.names:
            raise ConfigError(f"the checkpoint's data position is for the domains {state['names']}, this run has "
                              f"{self.names} ('data_mixture.domains'); the data changed")
        return state


def sheared_update(weights: list[float], losses: list[float], references: list[float], eta: float = 1.0,
                   smoothing: float = 1e-4, clip: bool = False) -> list[float]:
    """Sheared-LLaMA's dynamic batch loading step: alpha = softmax(log w + eta x (loss - reference)), then
    w = (1 - smoothing) x alpha + smoothing / K. Domains whose loss is NaN (no tokens measured) keep their weight;
    the others share the rest of the mass by the same rule (the exact rule when every domain was measured)."""
    seen = [i for i, loss in enumerate(losses) if not math.isnan(loss)]
    if not seen:
        return list(weights)
    mass = sum(weights[i] for i in seen)
    gaps = [losses[i] - references[i] for i in seen]
    if clip:
        gaps = [max(g, 0.0) for g in gaps]
    logits = torch.tensor([math.log(weights[i]) if weights[i] > 0 else -math.inf for i in seen], dtype=torch.float64)
    alpha = torch.softmax(logits + eta * torch.tensor(gaps, dtype=torch.float64), dim=0) * mass
    new = list(weights)
    for i, a in zip(seen, alpha.tolist(), strict=True):
        new[i] = (1 - smoothing) * a + smoothing * mass / len(seen)
    return new


class DomainWeights:
    """Per-domain losses of the training batches and the mixture weights they move (every update_freq steps, when
    reference losses are given). Window sums arrive already summed over the ranks, so every rank holds the same
    state and computes the same weights; the state (weights, window sums) is checkpointed with the run."""

    def __init__(self, cfg: DataMixture, source: MixtureSource):
        self.cfg = cfg
        self.source = source
        self.names = source.names
        self.window = torch.zeros(2, len(self.names), dtype=torch.float64)  # token-loss sums, token counts
        self.last_losses = [math.nan] * len(self.names)

    @property
    def weights(self) -> list[float]:
        return self.source.weights

    def new_sums(self, device: torch.device) -> torch.Tensor:
        """A zero [2, domains] float64 accumulator for one step: row 0 token-loss sums, row 1 token counts."""
        return torch.zeros(2, len(self.names), dtype=torch.float64, device=device)

    def observe(self, step_sums: torch.Tensor, step: int) -> None:
        """Add one step's global per-domain sums; at the end of a window, measure the losses and update."""
        self.window += step_sums.cpu()
        if step % self.cfg.update_freq:
            return
        loss_sums, tokens = self.window.tolist()
        self.last_losses = [s / n if n > 0 else math.nan for s, n in zip(loss_sums, tokens, strict=True)]
        self.window.zero_()
        if self.cfg.reference_losses:
            self.source.set_weights(sheared_update(self.weights, self.last_losses, self.cfg.reference_losses,
                                                   self.cfg.eta, self.cfg.smoothing, self.cfg.clip_excess_loss))
        logger.info(f"data mixture after step {step}: " + ", ".join(
            f"{name} {w:.4f} (loss {loss:.4f})" for name, w, loss in zip(self.names, self.weights, self.last_losses,
                                                                       strict=True)))

    def metrics(self) -> dict[str, float]:
        """Weights and the last measured per-domain losses, for the log line and TensorBoard."""
        out = {f"mixture_weight/{name}": w for name, w in zip(self.names, self.weights, strict=True)}
        out |= {f"mixture_loss/{name}": loss for name, loss in zip(self.names, self.last_losses, strict=True)
                if not math.isnan(loss)}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"names": self.names, "weights": list(self.weights), "window": self.window.tolist(),
                "last_losses": list(self.last_losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["names"] != self.names:
            raise ConfigError(f"the checkpoint's data mixture has the domains {state['names']}, this run has "
                              f"{self.names} ('data_mixture.domains')")
        self.source.set_weights(state["weights"], normalise=False)
        self.window = torch.tensor(state["window"], dtype=torch.float64)
        self.last_losses = list(state["last_losses"])


def domain_names(cfg: DataMixture) -> list[str]:
    names = cfg.domains or [Path(p).name.split(".")[0] or p for p in cfg.dataset_paths]
    if len(set(names)) != len(names):
        raise ConfigError(f"the domain names taken from 'data_mixture.dataset_paths' repeat ({names}); set "
                          f"'data_mixture.domains'")
    return names


def domain_sources(cfg: DataMixture, tokenizer: TokenizerLike | None, seq_len: int, seed: int,
                   shuffle: bool | None = None, documents: bool = False) -> list[PackedSource | TokenWindows]:
    """Each domain's endless windows: packed from its raw text in order, or from its token files (shuffled per epoch
    unless training.shuffle = false; asking raw text to shuffle is refused)."""
    sources = []
    for i, (name, path) in enumerate(zip(domain_names(cfg), cfg.dataset_paths, strict=True)):
        key = f"data_mixture.dataset_paths[{i}]"
        if is_token_folder(path):
            sources.append(token_windows(name, path, tokenizer, seq_len, True, key, documents, seed + i + 1,
                                         shuffle is not False))
            continue
        if shuffle:
            raise ConfigError(f"'training.shuffle' = true, but '{key}' = '{path}' is raw text, read in order as a "
                              "stream; tokenize it once with scripts/tokenize_data.py and name the token folder")
        sources.append(PackedSource(name, DocumentStream(shards_at(Path(path), key)), tokenizer, seq_len,
                                    documents=documents))
    return sources


def check_domain_kind(table: TokenTable, key: str) -> None:
    """A mixture's domains are pre-training text: token files of rows (chat, instruct, preference) are not one."""
    if table.kind != "text":
        dataset = "preference" if table.kind == "preference" else "instruct"
        raise ConfigError(f"'{key}' = {quote_path(table.folder)} holds {table.kind} token files, but a data "
                          "mixture's domains are pre-training text: tokenize that data with --kind text, or train on "
                          f"its rows alone (training.dataset = '{dataset}', no data_mixture)")


def check_mixture_data(cfg: DataMixture, shuffle: bool | None = None) -> None:
    """Every domain path holds shards whose first document reads (as check_dataset for training.dataset_path), or
    checked token files."""
    domain_names(cfg)  # names that repeat are one line
    for i, path in enumerate(cfg.dataset_paths):
        key = f"data_mixture.dataset_paths[{i}]"
        if is_token_folder(path):
            check_domain_kind(open_token_folder(path, key), key)
        else:
            check_has_documents(shards_at(Path(path), key), path, key)
    domain_sources(cfg, None, 1, 0, shuffle)


def build_domain_weights(cfg: DataMixture, tokenizer: TokenizerLike, seq_len: int, default_seed: int,
                         documents: bool = False, shuffle: bool | None = None) -> DomainWeights:
    """The mixture source (packed windows of seq_len tokens per domain, endless, with document ids when
    `documents`) and its weight controller."""
    names = domain_names(cfg)
    seed = cfg.seed if cfg.seed is not None else default_seed
    sources = domain_sources(cfg, tokenizer, seq_len, seed, shuffle, documents)
    weights = cfg.weights or [1.0] * len(names)
    return DomainWeights(cfg, MixtureSource(names, sources, weights, seed))
