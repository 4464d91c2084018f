"""Preference tuning's speed on the trainer's own steps (debugmodel, LoRA, DPO with the policy's base as reference,
pairs of a realistic length mix in windows of 1024 tokens), three measurements:

  packing    useful (trained answer) tokens per second of packed pairs (each window holds whole pairs) against one
             pair per padded sequence;
  prompt     the same pairs with each answer's own copy of the prompt (what titan_lite packs: block-causal documents)
             against the prompt once with both answers attending to it (a tree mask the benchmark builds): the
             forward/backward of policy and reference per pair, and the log-probabilities of both (they must agree);
  reference  the reference's cost in a DPO step (the step against the same step given the reference's
             log-probabilities) against the reference's forward alone, alternating in one process; and what the
             process holds with reference = "base" (no second copy) against a reference folder.

Run by benchmarks/run.py (the `preference_packing`, `preference_prompt` and `preference_reference` cases); by hand:

    .venv/bin/python -m benchmarks.preference --mode packing --layout packed --steps 6 --warmup 2

The pairs are Shakespeare's words under the bundled tokenizer (about 2.5 tokens a word): prompt and answer word
counts log-uniform (prompts 8-120, answers 8-200: answers longer than prompts, as in UltraFeedback), a seeded file so
every variant reads the same pairs. The result line is benchmarks.worker's."""

import argparse
import json
import logging
import math
import random
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.cli import parser
from benchmarks.worker import RESULT_PREFIX, alternate, measure, peak_rss_bytes
from titan_lite.checkpoint.hf import write_hf_folder
from titan_lite.config import parse_args
from titan_lite.data.datasets import document_positions
from titan_lite.loss import IGNORE_INDEX
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.objective.logps import token_logps
from titan_lite.objective.preference import PreferenceObjective, ReferenceTable, answer_sums, pair_batch
from titan_lite.train import Trainer

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 1024
# layout: (local batch, overrides). Packed windows hold whole pairs; the padded batch holds as many pairs as two
# windows do on average with the mix below (~2.4 per window), each padded to the batch's longest.
LAYOUTS = {"packed": (2, ["--preference.packing"]), "padded": (5, ["--preference.packing=false"])}


def length_mix(count: int, seed: int, low: int, high: int) -> list[int]:
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(count)]


def write_pairs(path: Path, count: int = 400, seed: int = 0) -> Path:
    words = (REPO / "titan_lite/data/corpus/shakespeare/train/lear.txt").read_text().split()
    rng = random.Random(seed)

    def text(n: int) -> str:
        start = rng.randrange(len(words) - n)
        return " ".join(words[start:start + n])
    prompts, chosen, rejected = (length_mix(count, seed + k, *span) for k, span in enumerate([(8, 120), (8, 200),
                                                                                              (8, 200)]))
    with open(path, "w") as f:
        for p, c, r in zip(prompts, chosen, rejected, strict=True):
            f.write(json.dumps({"prompt": text(p), "chosen": " " + text(c), "rejected": " " + text(r)}) + "\n")
    return path


def trainer_for(folder: Path, local_batch: int, *overrides: str) -> Trainer:
    data = write_pairs(folder / "pairs.jsonl")
    cfg = parse_args(["--job.config_file", str(REPO / "train_configs/debug_model.toml"), "--model.flavor",
                      "debugmodel", "--model.hf_assets_path", str(REPO / "assets/tokenizer"),
                      "--training.dataset", "preference", "--training.dataset_path", str(data),
                      "--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", str(local_batch),
                      "--model.converters", "lora", "--lora.rank", "16", "--validation.enable=false",
                      "--metrics.enable_tensorboard=false", "--job.dump_folder", str(folder / "out"),
                      "--lr_scheduler.warmup_steps", "0", "--optimizer.lr", "1e-4", *overrides])
    return Trainer(cfg)


def prefetch(trainer: Trainer, batches: int) -> list:
    data_iter = iter(trainer.dataloader)
    return [trainer.next_microbatches(data_iter) for _ in range(batches)]


# ------------------------------------------------------------------------------------------ packing


def packing(opts: argparse.Namespace, folder: Path) -> dict:
    local_batch, overrides = LAYOUTS[opts.layout]
    trainer = trainer_for(folder, local_batch, *overrides)
    batches = prefetch(trainer, opts.steps + opts.warmup)

    def step(i: int) -> float:
        return trainer.train_step(batches[i % len(batches)], i + 1)[0]

    result = measure(step, opts.steps, opts.warmup)
    timed = range(opts.warmup, opts.warmup + opts.steps)
    trained = [sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in batches[i]) for i in timed]
    total = [sum(mb.inputs.numel() for mb in batches[i]) for i in timed]
    pairs = [sum(len({int(d) // 2 for d in mb.documents.flatten().tolist() if d >= 0}) for mb in batches[i])
             for i in timed]
    return result | {"layout": opts.layout, "trained_per_step": trained, "total_per_step": total,
                     "pairs_per_step": pairs}


# ------------------------------------------------------------------------------------------ prompt copies


def tree_windows(trainer: Trainer, batches: list) -> list[tuple]:
    """The packed batches' pairs laid out with the prompt once: (tokens, labels, positions, additive mask, answer of
    each token, extra first-token predictions, rows) per window. An answer sees its prompt and itself, its positions
    continue after the prompt; the prompt's last token predicts both answers' first tokens (the rejected one's from
    `extra`: (position, token, answer))."""
    encoded = dict(trainer.dataloader.source.encoded())
    out = []
    for mb in batches:
        for row in mb[0].documents:
            rows = sorted({int(d) // 2 for d in row.tolist() if d >= 0})
            tokens, labels, positions, pair_of, answer_of, extra = [], [], [], [], [], []
            for k, r in enumerate(rows):
                pair = encoded[r]
                prompt, (chosen, _), (rejected, _) = pair.prompt, *pair.answers
                tokens += prompt
                labels += [IGNORE_INDEX] * (len(prompt) - 1) + [chosen[0]]
                answer_of += [-1] * (len(prompt) - 1) + [2 * k]
                extra.append((len(tokens) - 1, rejected[0], 2 * k + 1))
                positions += list(range(len(prompt)))
                pair_of += [k] * len(prompt)
                for a, ids in enumerate((chosen, rejected)):
                    tokens += ids
                    labels += ids[1:] + [IGNORE_INDEX]
                    answer_of += [2 * k + a] * (len(ids) - 1) + [-1]
                    positions += list(range(len(prompt), len(prompt) + len(ids)))
                    pair_of += [k] * len(ids)
            pair_t, role = torch.tensor(pair_of), _roles(rows, encoded)
            n = len(tokens)
            allowed = torch.ones(n, n, dtype=torch.bool).tril() & (pair_t[:, None] == pair_t[None, :]) & \
                ((role[None, :] == -1) | (role[None, :] == role[:, None]))
            mask = torch.zeros(n, n).masked_fill_(~allowed, float("-inf"))[None, None]
            out.append((torch.tensor(tokens)[None], torch.tensor(labels)[None], torch.tensor(positions), mask,
                        torch.tensor(answer_of), extra, rows))
    return out


def _roles(rows: list[int], encoded: dict) -> torch.Tensor:
    """Each token's part of its pair: -1 the prompt, 0 the chosen answer, 1 the rejected one."""
    roles = []
    for r in rows:
        pair = encoded[r]
        roles += [-1] * len(pair.prompt) + [0] * len(pair.answers[0][0]) + [1] * len(pair.answers[1][0])
    return torch.tensor(roles)


def prompt_copies(opts: argparse.Namespace, folder: Path) -> dict:
    """Per window: the DPO forward/backward (policy, then the reference under no_grad) of the pairs with their
    prompts copied (titan_lite's block-causal documents) and with one prompt shared (a tree mask)."""
    trainer = trainer_for(folder, 2, "--preference.packing")
    batches = prefetch(trainer, 2)
    model = trainer.model_parts[0]
    base = trainer.plan.transforms.base_function
    duplicated = [(row.inputs, row.labels, row.documents) for mb in batches for row in mb[0].split(1)]
    shared = tree_windows(trainer, batches)

    def dpo_duplicated(i: int) -> float:
        inputs, labels, documents = duplicated[i % len(duplicated)]
        batch = pair_batch(labels, documents, lambda *t: t)
        extra = {"positions": document_positions(documents), "documents": documents}
        with torch.no_grad(), base([model]):
            ref = answer_sums(token_logps(model(inputs, **extra), labels)[0], batch)
        logps = answer_sums(token_logps(model(inputs, **extra), labels)[0], batch)
        loss = -F.logsigmoid(0.1 * ((logps - ref)[:, 0] - (logps - ref)[:, 1])).sum()
        loss.backward()
        return loss.item()

    def tree_forward(window) -> torch.Tensor:
        tokens, _, positions, mask, *_ = window
        original = model.document_mask
        model.document_mask = lambda documents, h: mask.to(h.dtype)  # the tree mask instead of the documents'
        try:
            return model(tokens, positions=positions[None], documents=torch.zeros_like(tokens))
        finally:
            model.document_mask = original

    def tree_logps(window, logits) -> torch.Tensor:
        _, labels, _, _, answer, extra, rows = window
        values = token_logps(logits, labels)[0][0]
        sums = torch.zeros(2 * len(rows) + 1, dtype=torch.float64)
        sums = sums.index_add(0, torch.where(answer >= 0, answer, 2 * len(rows)), values.double())
        at, token, which = (torch.tensor(column) for column in zip(*extra, strict=True))
        firsts = torch.log_softmax(logits[0, at].float(), dim=-1).gather(1, token[:, None]).squeeze(1)
        return sums.index_add(0, which, firsts.double())[:-1].view(-1, 2)

    def dpo_shared(i: int) -> float:
        window = shared[i % len(shared)]
        with torch.no_grad(), base([model]):
            ref = tree_logps(window, tree_forward(window))
        logps = tree_logps(window, tree_forward(window))
        loss = -F.logsigmoid(0.1 * ((logps - ref)[:, 0] - (logps - ref)[:, 1])).sum()
        loss.backward()
        return loss.item()

    agree = check_agreement(duplicated, shared, model, tree_forward, tree_logps)
    work = {"duplicated_s": dpo_duplicated, "shared_s": dpo_shared}
    times = alternate(work, opts.warmup, opts.steps)
    tokens = {"duplicated_tokens": [int((d[2] >= 0).sum()) for d in duplicated],
              "shared_tokens": [int(w[0].numel()) for w in shared], "pairs": [len(w[-1]) for w in shared]}
    return times | tokens | {"logps_max_difference": agree}


def check_agreement(duplicated, shared, model, tree_forward, tree_logps) -> float:
    """The largest difference of an answer's log-probability between the two layouts (they compute the same)."""
    worst = 0.0
    with torch.no_grad():
        for (inputs, labels, documents), window in zip(duplicated, shared, strict=True):
            extra = {"positions": document_positions(documents), "documents": documents}
            ours = answer_sums(token_logps(model(inputs, **extra), labels)[0], pair_batch(labels, documents,
                                                                                          lambda *t: t))
            worst = max(worst, (ours - tree_logps(window, tree_forward(window))).abs().max().item())
    return worst


# ------------------------------------------------------------------------------------------ the reference


def reference_cost(opts: argparse.Namespace, folder: Path) -> dict:
    """A DPO step with the policy's base as reference, the same step given the reference's log-probabilities (as a
    precomputed table gives them), and the reference's forward alone (through the runner, as the step runs it),
    alternating on the same batches; with --reference path the reference is a separate model (a random folder)."""
    overrides = []
    if opts.reference == "path":
        args = flavor_args("debugmodel")
        reference = Llama(args)
        reference.init_weights(seed=1)
        write_hf_folder(dict(reference.named_parameters()), args, str(folder / "reference"), torch.float32,
                        str(REPO / "assets/tokenizer"))
        del reference
        overrides = ["--preference.reference", str(folder / "reference")]
    trainer = trainer_for(folder, 2, "--preference.packing", *overrides)
    runner, online = trainer.model.runner, trainer.objective.objective
    batches = prefetch(trainer, 4)
    table = ReferenceTable("benchmark")
    rows = 1 + max(int(d) // 2 for mb in batches for micro in mb for d in micro.documents.flatten().tolist())
    values = torch.full((rows, 2), float("nan"), dtype=torch.float64)
    for mb in batches:
        for micro in mb:
            batch = pair_batch(micro.labels, micro.documents, runner.shard)
            values[batch.examples] = runner.forward_only(lambda forward, b=batch: online.frozen_logps(forward, b),
                                                         micro)
    table.tables["training"] = values
    given = PreferenceObjective(online.loss_fn, online.spec, None, table, online.cp)

    def with_objective(objective):
        def run(i: int) -> float:
            trainer.objective.objective = objective
            return trainer.train_step(batches[i % len(batches)], i + 1)[0]
        return run

    def forward_alone(i: int) -> float:
        for micro in batches[i % len(batches)]:
            batch = pair_batch(micro.labels, micro.documents, runner.shard)
            runner.forward_only(lambda forward, b=batch: online.frozen_logps(forward, b), micro)
        return 0.0

    times = alternate({"dpo_step_s": with_objective(online), "given_step_s": with_objective(given),
                       "reference_forward_s": forward_alone}, opts.warmup, opts.steps)
    held = sum(p.numel() * p.element_size() for part in trainer.model_parts for p in part.parameters())
    reference_parts = getattr(online.frozen, "parts", [])
    if reference_parts and reference_parts[0] is not trainer.model_parts[0]:
        held += sum(p.numel() * p.element_size() for part in reference_parts for p in part.parameters())
    return times | {"reference": opts.reference, "parameter_bytes_held": held}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser(__doc__, ".venv/bin/python -m benchmarks.preference")
    p.add_argument("--mode", choices=["packing", "prompt", "reference"], required=True)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="packed", help="packing: how pairs are laid out")
    p.add_argument("--reference", choices=["base", "path"], default="base", help="reference: which reference")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    logging.getLogger("titan_lite").setLevel(logging.WARNING)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="titan_lite_preference_bench_") as folder:
        run = {"packing": packing, "prompt": prompt_copies, "reference": reference_cost}[opts.mode]
        result = run(opts, Path(folder))
    result.update(mode=opts.mode, rank=0, world=1, peak_rss_bytes=peak_rss_bytes())
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
