"""Packing without cross-talk, exactly: the first training step of the trainer on packed conversations
(attn_mask_type block_causal) has the loss and gradients of the same conversations run one at a time (the
token-weighted mean of their losses), within 1e-5 in float32, on 1 process and under FSDP 2, TP 2, PP 2 and CP 2;
and so do pre-training documents packed into windows."""

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import spawn_gloo
from titan_lite.config import parse_args
from titan_lite.dtensor import full_tensor
from titan_lite.loss import IGNORE_INDEX, cross_entropy_sum
from titan_lite.models.decoder import Llama
from titan_lite.models.parameters import canonical_name

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, GLOBAL_BATCH = 64, 4
ATOL = 1e-5
LAYOUTS = {  # name: (local batch, overrides), a global batch of 4 windows each
    "fsdp2": (2, []),
    "tp2": (4, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (4, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2"]),
    "cp2": (4, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"]),
}


def write_chat_data(folder: Path) -> tuple[Path, Path]:
    """Short conversations of one to three exchanges (a few of them fit a 65-token window) and the ChatML
    tokenizer folder of the CPU chat example."""
    from tests.test_chat_workflow import chat_script

    tokenizer = chat_script().chat_tokenizer_folder(folder / "tokenizer")
    rng = random.Random(0)
    rows = []
    for _ in range(40):
        messages = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            messages += [{"role": "user", "content": f"{a} + {b}?"}, {"role": "assistant", "content": f"{a + b}"}]
        rows.append({"messages": messages})
    data = folder / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data, tokenizer


def config(dump: Path, data: Path, tokenizer: Path, local_batch: int, *extra: str):
    return parse_args(["--job.config_file", str(ROOT / "tests/integration/base.toml"), "--job.dump_folder", str(dump),
                       "--model.hf_assets_path", str(tokenizer), "--model.attn_mask_type", "block_causal",
                       "--training.dataset", "instruct", "--training.dataset_path", str(data),
                       "--instruct.chat_template", "tokenizer", "--instruct.packing",
                       "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(local_batch),
                       "--training.global_batch_size", str(GLOBAL_BATCH), "--training.max_norm", "0",
                       "--training.shuffle", "false",  # records in file order, as first_step_conversations reads
                       "--metrics.enable_tensorboard=false", *extra])


def trainer_first_step(cfg) -> tuple[float, dict[str, torch.Tensor], object]:
    """The trainer's first step: its global loss and every gradient this rank holds (whole tensors)."""
    from titan_lite.train import Trainer

    trainer = Trainer(cfg)
    grads: dict[str, torch.Tensor] = {}

    def capture(*args, **kwargs):
        for part in trainer.model_parts:
            grads.update({canonical_name(n): full_tensor(p.grad) for n, p in part.named_parameters()})

    trainer.optimizer.step = capture
    loss, _ = trainer.train_step(trainer.next_microbatches(iter(trainer.dataloader)), step=1)
    return loss, grads, trainer


def one_at_a_time(trainer, sequences: list[tuple[list[int], list[bool]]]) -> tuple[float, dict[str, torch.Tensor]]:
    """The token-weighted mean loss of each sequence run alone, from position 0, through a plain model with the
    trainer's initial weights, and its gradients."""
    model = Llama(trainer.plan.model_args)
    model.init_weights(seed=0)
    total, count = 0.0, 0
    for ids, trained in sequences:
        tokens = torch.tensor(ids)
        labels = torch.where(torch.tensor(trained[1:]), tokens[1:], IGNORE_INDEX)
        total = total + cross_entropy_sum(model(tokens[None, :-1]), labels[None])
        count += int((labels != IGNORE_INDEX).sum())
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def first_step_conversations(trainer) -> list[tuple[list[int], list[bool]]]:
    """The conversations of the first global batch, encoded alone: whole records in file order, as many as the
    first GLOBAL_BATCH windows hold."""
    source = trainer.dataloader.source
    windows = [sample for (sample, _), _ in zip(source.samples(), range(GLOBAL_BATCH), strict=False)]
    count = sum(len(set(documents.tolist()) - {-1}) for _, _, documents in windows)
    return [source.encode(record) for _, (_, record) in zip(range(count), source.examples(), strict=False)]


def assert_matches(layout: str, loss: float, grads: dict[str, torch.Tensor], reference: tuple[float, dict]) -> None:
    ref_loss, ref_grads = reference
    assert abs(loss - ref_loss) <= ATOL, f"{layout}: loss {loss} vs one at a time {ref_loss}"
    assert grads, f"{layout}: no gradients"
    worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
    assert worst <= ATOL, f"{layout}: gradients differ by up to {worst:.2e}"


def _layouts_worker(rank: int, dump: str, data: str, tokenizer: str) -> None:
    for name, (local_batch, overrides) in LAYOUTS.items():
        cfg = config(Path(dump) / name, Path(data), Path(tokenizer), local_batch, *overrides)
        loss, grads, trainer = trainer_first_step(cfg)
        assert trainer.parallel_dims.world_size == 2 and trainer.plan.block_causal
        assert_matches(name, loss, grads, one_at_a_time(trainer, first_step_conversations(trainer)))
        dist.barrier()


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow  # four trainers on 2 processes: about 40 s on 2 busy cores
def test_packed_conversations_equal_one_at_a_time_on_fsdp_tp_pp_cp(tmp_path):
    data, tokenizer = write_chat_data(tmp_path)
    spawn_gloo(_layouts_worker, 2, str(tmp_path / "runs"), str(data), str(tokenizer))


def test_packed_conversations_and_documents_equal_one_at_a_time_on_one_process(tmp_path):
    data, tokenizer = write_chat_data(tmp_path)
    loss, grads, trainer = trainer_first_step(config(tmp_path / "one", data, tokenizer, GLOBAL_BATCH))
    sequences = first_step_conversations(trainer)
    assert len(sequences) >= 2 * GLOBAL_BATCH  # several conversations share each window
    assert_matches("one process", loss, grads, one_at_a_time(trainer, sequences))

    # pre-training documents: each window's pieces of documents are the sequences run alone
    texts = (ROOT / "titan_lite/data/corpus/shakespeare/train/lear.txt").read_text().split("\n\n")[:60]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts if t.strip()))
    cfg = parse_args(["--job.config_file", str(ROOT / "tests/integration/base.toml"), "--job.dump_folder",
                      str(tmp_path / "docs"), "--model.attn_mask_type", "block_causal", "--training.dataset", "jsonl",
                      "--training.dataset_path", str(corpus), "--training.seq_len", str(SEQ_LEN),
                      "--training.local_batch_size", str(GLOBAL_BATCH), "--training.max_norm", "0",
                      "--metrics.enable_tensorboard=false"])
    loss, grads, trainer = trainer_first_step(cfg)
    pieces = []
    windows = zip(trainer.dataloader.source.samples(), range(GLOBAL_BATCH), strict=False)
    for ((inputs, labels, documents), _), _ in windows:
        # the window's last token is its last label, unless it starts a document (which then trains nothing here)
        tokens, docs = inputs.tolist(), documents.tolist()
        if labels[-1] != IGNORE_INDEX:
            tokens, docs = tokens + [int(labels[-1])], docs + docs[-1:]
        for doc in sorted(set(docs)):
            piece = [t for t, d in zip(tokens, docs, strict=True) if d == doc]
            if len(piece) > 1:
                pieces.append((piece, [True] * len(piece)))
    assert len(pieces) > GLOBAL_BATCH
    assert_matches("pre-training documents", loss, grads, one_at_a_time(trainer, pieces))
