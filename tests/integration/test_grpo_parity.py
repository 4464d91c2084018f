"""GRPO on FSDP 2, TP 2 and CP 2 equals one process: the same prompts, the same samples (each completion drawn from
its own row of uniform numbers, whatever rank decodes it), the same rewards, losses, KL and entropy over two
steps, with a KL term to the policy's own base (LoRA, adapters off)."""

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import gloo_results
from tests.test_grpo_runs import base_folder, config, steps_of, write_prompts

LAYOUTS = {  # a global batch of 8 completions (2 prompts x 4) each
    "fsdp2": [],
    "tp2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"],
    "cp2": ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"],
}
STEPS = 2


def lora(base: Path) -> list[str]:
    return ["--model.converters", "lora", "--checkpoint.initial_load_path", str(base),
            "--checkpoint.initial_load_in_hf", "--grpo.beta", "0.1", "--optimizer.lr", "0.05"]


def run(cfg) -> list[dict]:
    from titan_lite.train import Trainer

    trainer = Trainer(cfg)
    out = []
    for loss, _, rollout, objective in steps_of(trainer, STEPS):
        out.append({"loss": loss, "reward": rollout["reward"], "length": rollout["completions/mean_length"],
                    "kl": objective["kl"], "entropy": objective["entropy"]})
    return out


def _layouts_worker(rank: int, dump: str, data: str, base: str) -> dict:
    results = {}
    for name, overrides in LAYOUTS.items():
        results[name] = run(config(Path(dump) / name, Path(data), *lora(Path(base)), *overrides))
        dist.barrier()
    return results


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow  # three trainers on 2 processes
def test_grpo_on_fsdp_tp_cp_equals_one_process(tmp_path):
    data, base = write_prompts(tmp_path), base_folder(tmp_path)
    alone = run(config(tmp_path / "one", data, *lora(base)))
    assert alone[0]["reward"] > 0 and alone[1]["kl"] > 0
    for rank_results in gloo_results(_layouts_worker, 2, tmp_path, str(tmp_path / "runs"), str(data), str(base)):
        for name, steps in rank_results.items():
            for step, (got, want) in enumerate(zip(steps, alone, strict=True), start=1):
                assert got == pytest.approx(want, abs=1e-5), (name, step, got, want)
