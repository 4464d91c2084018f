"""Attention masks: causal within a sliding window, block-causal over packed documents (dense, additive), and the
documents' spans that eager CPU attention runs one at a time."""

from dataclasses import dataclass
from itertools import pairwise

import torch


def within_window(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int) -> torch.Tensor:
    """[..., q, k] bool: the keys inside each query's sliding window, key position > query position - window (a query
    sees itself and the window - 1 positions before it, as transformers' Mistral). Combine it with a causal or padding
    mask by `&`: it says nothing about keys after the query."""
    return k_positions[..., None, :] > q_positions[..., :, None] - window


def windowed_causal_mask(seq: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """[seq, seq] bool causal mask limited to the sliding window, or None when the window covers the sequence (plain
    causal attention, which SDPA runs without a mask)."""
    if window is None or window >= seq:
        return None
    positions = torch.arange(seq, device=device)
    return (positions[None, :] <= positions[:, None]) & within_window(positions, positions, window)


def block_causal_mask(query_documents: torch.Tensor, query_index: torch.Tensor, key_documents: torch.Tensor,
                      dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """The additive SDPA mask of packed documents, [batch, 1, queries, keys]: 0 where a query may attend (a key of its
    own document at or before it), -inf elsewhere. Queries are given by their documents [batch, queries] and global
    indices [queries]; keys are the whole sequence [batch, keys]. Additive in the compute dtype, built once per
    forward: every layer's SDPA then reads (and saves for backward) this one tensor, where a boolean mask would be
    converted again by each call. With a sliding window a query also sees only the window's last keys."""
    keys = torch.arange(key_documents.shape[1], device=key_documents.device)
    allowed = (query_documents[:, :, None] == key_documents[:, None, :]) & (query_index[:, None] >= keys[None, :])
    if window is not None:
        allowed &= within_window(query_index, keys, window)
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))[:, None]


@dataclass(frozen=True)
class DocumentSpans:
    """The documents of a batch as (start, end) runs of every row: eager CPU attention attends within each run alone
    (causal SDPA per document), which skips every query-key pair of two documents, where a dense mask computes them
    all and masks them out (Σ len² instead of seq² per row)."""

    rows: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def of(cls, documents: torch.Tensor) -> "DocumentSpans":
        rows = []
        for row in documents.tolist():
            starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
            rows.append(tuple(pairwise([*starts, len(row)])))
        return cls(tuple(rows))
