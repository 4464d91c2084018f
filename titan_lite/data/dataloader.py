"""The checkpointable data loader: a StatefulDataLoader over the packed, rank-split dataset."""

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_lite.errors import ConfigError
from titan_lite.data.datasets import TokenizerLike, build_packed_dataset, check_dataset

__all__ = ["build_dataloader", "check_dataset", "collate_pairs"]


def collate_pairs(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack (input_ids, labels) samples into ([B, S], [B, S])."""
    inputs, labels = zip(*samples)
    return torch.stack(inputs), torch.stack(labels)


def _check_loader_options(key_prefix: str, local_batch_size: int, num_workers: int,
                          persistent_workers: bool, prefetch_factor: int | None) -> None:
    if local_batch_size < 1:
        raise ConfigError(f"'{key_prefix}.local_batch_size' must be at least 1, got {local_batch_size}")
    if num_workers < 0:
        raise ConfigError(f"'{key_prefix}.dataloader.num_workers' must be 0 or more, got {num_workers}")
    if num_workers == 0 and prefetch_factor is not None:
        raise ConfigError(f"'{key_prefix}.dataloader.prefetch_factor' = {prefetch_factor} needs "
                          f"'{key_prefix}.dataloader.num_workers' > 0 (leave it unset with 0 workers)")
    if num_workers == 0 and persistent_workers:
        raise ConfigError(f"'{key_prefix}.dataloader.persistent_workers' = true needs "
                          f"'{key_prefix}.dataloader.num_workers' > 0")


def build_dataloader(dataset: str, dataset_path: str | None, tokenizer: TokenizerLike, seq_len: int,
                     local_batch_size: int, dp_rank: int, dp_world_size: int, infinite: bool = True,
                     num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = False,
                     prefetch_factor: int | None = None, key_prefix: str = "training") -> StatefulDataLoader:
    """A loader yielding (input_ids, labels), both LongTensor[local_batch_size, seq_len], for one dp rank.

    Its state_dict()/load_state_dict() resume exactly after the last batch it yielded.
    key_prefix names the config section ('training' or 'validation') in error messages.
    """
    _check_loader_options(key_prefix, local_batch_size, num_workers, persistent_workers, prefetch_factor)
    packed = build_packed_dataset(dataset, dataset_path, tokenizer, seq_len, dp_rank, dp_world_size,
                                  infinite=infinite, key_prefix=key_prefix)
    return StatefulDataLoader(
        packed,
        batch_size=local_batch_size,
        collate_fn=collate_pairs,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=persistent_workers,
        prefetch_factor=prefetch_factor,
    )
