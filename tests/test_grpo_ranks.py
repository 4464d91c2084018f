"""GRPO's rollouts decoded by the engine on 2 gloo ranks, through the trainer: FSDP gathering layer by layer (in
lockstep), FSDP with the weights gathered once (each rank on its own) and TP 2 (in lockstep, TP-wide steps), with
completion lengths deliberately unequal across the ranks (a base whose end token is likely, so completions end at
varied lengths, one rank's well before the other's); each gives one process's completions, sampled
log-probabilities and losses within 1e-5 over two steps. One launch runs the three layouts."""

import faulthandler
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import gloo_results
from tests.test_grpo_runs import config, steps_of, write_prompts

EOS = 1793  # the bundled tokenizer's
LAYOUTS = {
    "fsdp2_per_layer": ["--grpo.gather_once", "never"],
    "fsdp2_gathered_once": ["--grpo.gather_once", "always"],
    "tp2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
}


def eos_biased_base(folder: Path, scale: float = 11.25) -> Path:
    """The tiny flavor (seed 5) whose head's end-token row points along its mean final hidden state: the end token
    is likely, more after some contexts than others."""
    from titan_lite.checkpoint.hf import write_hf_folder
    from titan_lite.models.decoder import Llama
    from titan_lite.models.flavors import flavor_args

    if folder.exists():
        return folder
    args = flavor_args("tiny")
    model = Llama(args)
    model.init_weights(seed=5)
    seen = []
    handle = model.output.register_forward_pre_hook(lambda _, inputs: seen.append(inputs[0]))
    with torch.no_grad():
        model(torch.randint(0, args.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0)))
        handle.remove()
        direction = seen[0].flatten(0, 1).mean(0)
        model.output.weight[EOS] = scale * direction / direction.norm() ** 2
    write_hf_folder(dict(model.named_parameters()), args, str(folder), torch.float32,
                    str(Path(__file__).resolve().parents[1] / "assets/tokenizer"))
    return folder


def flags(base: Path) -> list[str]:
    return ["--checkpoint.initial_load_path", str(base), "--checkpoint.initial_load_in_hf",
            "--grpo.num_generations", "2", "--grpo.max_completion_length", "10", "--grpo.generation_batch_size", "2",
            "--grpo.stop_check_interval", "2", "--optimizer.lr", "0.05"]


def run(cfg) -> list[dict]:
    from titan_lite.train import Trainer

    trainer = Trainer(cfg)
    out = []
    for loss, _, rollout, _ in steps_of(trainer, 2):
        current = trainer.dataloader.current
        out.append({"loss": loss, "reward": rollout["reward"], "completions": current.completions,
                    "logps": current.logps})
    return out


def _layouts_worker(rank: int, dump: str, data: str, base: str) -> dict:
    faulthandler.dump_traceback_later(400, exit=True)  # a hang fails the test instead of stalling the suite
    results = {}
    for name, overrides in LAYOUTS.items():
        results[name] = run(config(Path(dump) / name, Path(data), *flags(Path(base)), *overrides))
        dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    return results


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow  # three trainers on 2 processes and one alone (~90 s on a busy 2-core machine)
def test_the_engine_on_fsdp_per_layer_gathered_once_and_tp_samples_as_one_process(tmp_path):
    data, base = write_prompts(tmp_path), eos_biased_base(tmp_path / "base")
    alone = run(config(tmp_path / "one", data, *flags(base)))
    for step in alone:  # rank 0 samples completions 0-3, rank 1 completions 4-7
        lengths = [len(c) for c in step["completions"]]
        assert any(c[-1] == EOS for c in step["completions"]) and max(lengths[:4]) != max(lengths[4:]), lengths
    for name, steps in gloo_results(_layouts_worker, 2, tmp_path, str(tmp_path / "runs"), str(data),
                                    str(base))[0].items():
        for got, want in zip(steps, alone, strict=True):
            assert got["completions"] == want["completions"], name
            for a, b in zip(got["logps"], want["logps"], strict=True):
                assert a == pytest.approx(b, abs=1e-5), name
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-5) and got["reward"] == want["reward"], name
