"""Perplexity by the protocol of the pruning papers (Wanda, SparseGPT): the text tokenized once (documents joined by
a blank line, one BOS at the start), cut into non-overlapping windows of seq_len tokens (a partial last window is
dropped), each window predicting its tokens 2..seq_len from their prefix; perplexity = exp(mean token NLL)."""

import logging
import math
from dataclasses import dataclass

import torch

from titan_lite.data.batch import Batch
from titan_lite.data.datasets import DocumentStream, StreamPosition, resolve_shards
from titan_lite.errors import ConfigError
from titan_lite.loss import IGNORE_INDEX
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.parallel.runner import ModelRunner

logger = logging.getLogger("titan_lite")
DOCUMENT_SEPARATOR = "\n\n"


def read_text(path: str) -> str:
    """Every document of a .txt/.jsonl/.json.gz/.parquet file or folder, joined by a blank line."""
    stream = DocumentStream(resolve_shards("text", path, key_prefix="eval"))
    return DOCUMENT_SEPARATOR.join(text for text, _ in stream.read(StreamPosition()))


def text_windows(token_ids: list[int], seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """[windows, seq_len] non-overlapping windows from the start of the token stream."""
    count = len(token_ids) // seq_len
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise ConfigError(f"the text has {len(token_ids)} tokens: not one window of seq_len {seq_len}")
    return torch.tensor(token_ids[:count * seq_len], dtype=torch.long).view(count, seq_len)


def window_labels(windows: torch.Tensor) -> torch.Tensor:
    """Each position's next token; the last position of a window predicts nothing."""
    labels = windows.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    return labels


@dataclass
class Perplexity:
    nll_sum: float
    tokens: int
    windows: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens

    @property
    def value(self) -> float:
        return math.exp(self.mean_nll)


def rank_share(windows: torch.Tensor, dims: ParallelDims) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of this data-parallel rank's windows (dealt round-robin), padded to the largest share with
    windows that predict nothing, so every rank runs the same number of forwards (collectives line up)."""
    labels = window_labels(windows)
    if dims.dp_degree == 1:
        return windows, labels
    mesh = dims.submesh("batch")
    rank, size = mesh.get_local_rank(), mesh.size()
    mine, my_labels = windows[rank::size], labels[rank::size]
    missing = -(-windows.shape[0] // size) - mine.shape[0]
    if missing:
        mine = torch.cat([mine, windows[:missing]])
        my_labels = torch.cat([my_labels, torch.full_like(labels[:missing], IGNORE_INDEX)])
    return mine, my_labels


@torch.no_grad()
def evaluate_perplexity(runner: ModelRunner, windows: torch.Tensor, dims: ParallelDims, device: torch.device,
                        batch_size: int = 1) -> Perplexity:
    """The perplexity of the model behind `runner` over `windows` [n, seq_len], on any layout."""
    for part in runner.model_parts:
        part.eval()
    inputs, labels = rank_share(windows, dims)
    nll = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    batches = range(0, inputs.shape[0], batch_size)
    for done, start in enumerate(batches, start=1):
        batch = Batch(inputs[start:start + batch_size], labels[start:start + batch_size]).to(device)
        batch_nll, batch_tokens = runner.loss_sum(batch)
        nll += batch_nll
        tokens += batch_tokens
        if done % max(1, len(batches) // 10) == 0 or done == len(batches):
            logger.info(f"eval: batch {done}/{len(batches)} on this rank")
    nll = runner.global_sum(nll, loss_values=True)
    tokens = runner.global_sum(tokens, loss_values=False)
    return Perplexity(nll.item(), int(tokens.item()), windows.shape[0])
