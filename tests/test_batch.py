"""The typed Batch: microbatches keep every field aligned, device moves keep the fields present, and each source's
loader yields its fields by name (packed documents, padded rows, a mixture's domains, RL rollouts' values)."""

import json
from pathlib import Path

import torch

from titan_lite.data.batch import Batch, Drawn, pad_samples, stack_samples
from titan_lite.data.dataloader import BatchLayout, DataLoader, pad_collate
from titan_lite.data.datasets import build_packed_source
from titan_lite.data.mixture import MixtureSource
from titan_lite.loss import IGNORE_INDEX
from titan_lite.rl.rollout import Document, Rollout, microbatch

BOS, EOS, OFFSET = 1, 2, 3


class ByteTokenizer:
    bos_id, eos_id, pad_id, vocab_size = BOS, EOS, -1, 256 + OFFSET

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        return ([BOS] if bos else []) + [b + OFFSET for b in text.encode("utf-8")] + ([EOS] if eos else [])


def full_batch(rows: int = 5, seq: int = 4) -> Batch:
    """Every field's entries name their row: row r holds r * 100 + position."""
    grid = torch.arange(rows)[:, None] * 100 + torch.arange(seq)[None, :]
    return Batch(grid, grid + 1, grid + 2, torch.arange(rows) * 100, torch.stack([grid, -grid], dim=-1).float())


def test_split_into_microbatches_keeps_every_field_aligned():
    batch = full_batch()
    parts = batch.split(2)
    assert [p.rows for p in parts] == [2, 2, 1]
    for k, part in enumerate(parts):
        rows = torch.arange(2 * k, min(2 * k + 2, batch.rows))
        assert torch.equal(part.inputs // 100, rows[:, None].expand_as(part.inputs))
        assert torch.equal(part.labels, part.inputs + 1) and torch.equal(part.documents, part.inputs + 2)
        assert torch.equal(part.domains, rows * 100)
        assert torch.equal(part.values[..., 0], part.inputs.float())
        assert torch.equal(part.values[..., 1], -part.inputs.float())
    assert Batch(batch.inputs, batch.labels).split(3)[1].documents is None  # absent fields stay absent


def test_device_moves_and_maps_keep_the_fields_present():
    plain = Batch(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    moved = plain.to(torch.device("cpu"))
    assert moved.documents is None and moved.domains is None and moved.values is None and moved.equal(plain)
    as_arrays = full_batch().map(torch.Tensor.numpy)
    assert as_arrays.map(torch.from_numpy).equal(full_batch())
    assert not full_batch().equal(plain)


def test_samples_stack_and_pad_into_named_fields():
    samples = [(torch.tensor([5, 6, 7]), torch.tensor([6, 7, 8]), torch.tensor([0, 0, 1])),
               (torch.tensor([9]), torch.tensor([IGNORE_INDEX]), torch.tensor([3]))]
    padded = pad_samples(samples, (0, IGNORE_INDEX, -1), multiple=4)
    assert padded.inputs.tolist() == [[5, 6, 7, 0], [9, 0, 0, 0]]
    assert padded.labels.tolist() == [[6, 7, 8, -100], [-100, -100, -100, -100]]
    assert padded.documents.tolist() == [[0, 0, 1, -1], [3, -1, -1, -1]] and padded.domains is None
    drawn = stack_samples([Drawn(samples[0], 1), Drawn(samples[0], 0)])
    assert drawn.domains.tolist() == [1, 0] and drawn.documents.shape == (2, 3) and drawn.values is None


def test_each_source_yields_its_fields_by_name(tmp_path: Path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * (i % 3 + 1)}) + "\n" for i in range(12)))
    layout = BatchLayout(2, 0, 1)
    packed = next(iter(DataLoader(build_packed_source("jsonl", str(path), ByteTokenizer(), 8, documents=True),
                                  layout)))
    assert packed.inputs.shape == packed.labels.shape == packed.documents.shape == (2, 8)
    assert packed.domains is None and packed.values is None
    plain = next(iter(DataLoader(build_packed_source("jsonl", str(path), ByteTokenizer(), 8), layout)))
    assert plain.inputs.shape == (2, 8) and plain.documents is None
    rows = [(torch.tensor([4, 5, 6]), torch.tensor([5, 6, 7])), (torch.tensor([4]), torch.tensor([5]))]
    padded = pad_collate(0, IGNORE_INDEX)([(r, {}) for r in rows])[0]
    assert padded.inputs.tolist() == [[4, 5, 6], [4, 0, 0]] and padded.documents is None

    class Endless:
        name = "endless"

        def samples(self, state=None):
            while True:
                yield (torch.tensor([7, 8]), torch.tensor([8, 9])), {}
    mixed = next(iter(DataLoader(MixtureSource(["a", "b"], [Endless(), Endless()], [0.5, 0.5], 0), layout)))
    assert mixed.domains.shape == (2,) and mixed.documents is None and mixed.inputs.tolist() == [[7, 8], [7, 8]]
    rollout = Rollout([[1, 40, 41]], [[50, 51, 2]], [[-0.5, -0.25, -1.0]], [0.75])
    rolled = microbatch([Document.of(rollout, 0, 1)], 8, packing=True, pad_id=0)
    assert rolled.values.shape == (*rolled.inputs.shape, 2) and rolled.documents.shape == rolled.inputs.shape
    trained = rolled.labels != IGNORE_INDEX
    assert rolled.labels[trained].tolist() == [50, 51, 2]
    assert rolled.values[..., 0][trained].tolist() == [-0.5, -0.25, -1.0]
    assert rolled.values[..., 1][trained].tolist() == [0.75] * 3
