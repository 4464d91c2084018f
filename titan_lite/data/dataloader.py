"""The checkpointable data loader: a StatefulDataLoader over the packed, rank-split dataset."""

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from titan_lite.data.datasets import TokenizerLike, build_packed_dataset, check_dataset

__all__ = ["build_dataloader", "check_dataset", "collate_pairs"]


def collate_pairs(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack (input_ids, labels) samples into ([B, S], [B, S])."""
    inputs, labels = zip(*samples, strict=True)
    return torch.stack(inputs), torch.stack(labels)


def build_dataloader(dataset: str, dataset_path: str | None, tokenizer: TokenizerLike, seq_len: int,
                     local_batch_size: int, dp_rank: int, dp_world_size: int, infinite: bool = True,
                     num_workers: int = 0, pin_memory: bool = False, persistent_workers: bool = False,
                     prefetch_factor: int | None = None, key_prefix: str = "training") -> StatefulDataLoader:
    """A loader yielding (input_ids, labels), both LongTensor[local_batch_size, seq_len], for one dp rank.

    Its state_dict()/load_state_dict() resume exactly after the last batch it yielded.
    key_prefix names the config section ('training' or 'validation') in error messages. The loader options are
    not checked here: titan_lite.config.validate owns those checks.
    """
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
