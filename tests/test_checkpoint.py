"""Unit tests of CheckpointManager on a stand-in trainer: retention, load_step, exclusions, errors, resharding."""

import contextlib
import json
import logging
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from tests.helpers import free_port, spawn_on_free_port
from titan_lite.checkpoint import dcp as ckpt
from titan_lite.checkpoint.manager import CheckpointManager, RankLocal
from titan_lite.checkpoint.resume import choose_resume
from titan_lite.config import JobConfig
from titan_lite.errors import ConfigError, TrainingFault
from titan_lite.models.decoder import Llama
from titan_lite.models.flavors import flavor_args
from titan_lite.optim.lr_scheduler import LRSchedule
from titan_lite.parallel.parallel_dims import ParallelDims
from titan_lite.train import TrainState

SEQ = 16


class CountingLoader:
    """Stands in for the StatefulDataLoader: its whole state is how many batches it yielded."""

    def __init__(self):
        self.batches = 0

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]


def make_cfg(folder: Path, **checkpoint) -> JobConfig:
    cfg = JobConfig()
    cfg.job.dump_folder = str(folder)
    cfg.training.steps = 100
    cfg.lr_scheduler.warmup_steps = 2
    cfg.checkpoint.enable = True
    cfg.checkpoint.interval = 1
    cfg.checkpoint.last_save_model_only = False
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    return cfg


def make_trainer(cfg: JobConfig, flavor_changes: dict | None = None, fsdp: bool = False) -> SimpleNamespace:
    """The attributes CheckpointManager reads, with a real tiny Llama (FSDP-sharded over the world if asked)."""
    world = dist.get_world_size()
    pd = ParallelDims.from_config(cfg.parallelism, world)
    pd.build_mesh("cpu")
    args = flavor_args("tiny")
    args.max_seq_len = SEQ
    for k, v in (flavor_changes or {}).items():
        setattr(args, k, v)
    with torch.device("meta"):
        model = Llama(args)
    if fsdp:
        for block in model.layers.values():
            fully_shard(block, mesh=pd.submesh("fsdp"))
        fully_shard(model, mesh=pd.submesh("fsdp"))
    model.to_empty(device="cpu")
    model.init_weights(seed=0, buffer_device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    return SimpleNamespace(model_parts=[model], optimizer=optimizer, model_args=args, parallel_dims=pd,
                           lr_schedule=LRSchedule([optimizer], cfg.lr_scheduler, cfg.training.steps),
                           dataloader=CountingLoader(), train_state=TrainState(), device=torch.device("cpu"))


def manager_of(cfg: JobConfig, t: SimpleNamespace) -> CheckpointManager:
    """The manager from components, as the trainer builds it (a per-data-parallel-rank data position)."""
    states = {"lr_scheduler": t.lr_schedule, "train_state": t.train_state,
              "dataloader": RankLocal(t.dataloader, f"dp{dist.get_rank()}_of_{dist.get_world_size()}",
                                        lambda saved: "restarts the data")}
    return CheckpointManager(cfg.checkpoint, tmp_root(cfg), t.model_parts, t.optimizer, states)


def tmp_root(cfg: JobConfig) -> Path:
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder


def train_one_step(t: SimpleNamespace, seed: int) -> None:
    """One deterministic step on the same global batch everywhere (the inputs do not depend on the rank)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 2048, (2, SEQ + 1), generator=g)
    logits = t.model_parts[0](tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    t.lr_schedule.step()
    t.train_state.step += 1
    t.train_state.ntokens_seen += tokens[:, :-1].numel()
    t.dataloader.batches += 1


def full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def snapshot(t: SimpleNamespace) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters and AdamW moments, keyed by parameter name."""
    model = t.model_parts[0]
    out = {}
    for name, p in model.named_parameters():
        out[f"param.{name}"] = full(p.detach()).clone()
        state = t.optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[f"{key}.{name}"] = full(state[key]).clone()
    return out


@pytest.fixture(scope="module")
def single_process_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


def steps_on_disk(root: Path) -> list[int]:
    return sorted(ckpt.complete_steps(root))


# ---------------------------------------------------------------- single process


def test_keep_latest_k_keeps_the_newest(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path, keep_latest_k=2)
    t = make_trainer(cfg)
    manager = manager_of(cfg, t)
    for step in range(1, 6):
        train_one_step(t, step)
        manager.save(step)
    manager.finish()
    assert steps_on_disk(tmp_path / "checkpoint") == [4, 5]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-4", "step-5"]


def test_load_step_resumes_that_step_and_newest_is_default(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path, keep_latest_k=0)
    t = make_trainer(cfg)
    manager = manager_of(cfg, t)
    saved = {}
    for step in range(1, 4):
        train_one_step(t, step)
        manager.save(step)
        saved[step] = snapshot(t)

    for load_step, expected in ((2, 2), (-1, 3)):
        cfg2 = make_cfg(tmp_path, load_step=load_step)
        t2 = make_trainer(cfg2)
        manager_of(cfg2, t2).load()
        assert t2.train_state.step == expected
        assert t2.train_state.ntokens_seen == expected * 2 * SEQ
        assert t2.dataloader.batches == expected
        assert t2.lr_schedule.step_count == expected
        got = snapshot(t2)
        assert got.keys() == saved[expected].keys()
        for k, v in saved[expected].items():
            assert torch.equal(got[k], v), k


def test_load_step_that_does_not_exist_names_the_folder(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path, load_step=7)
    with pytest.raises(ConfigError) as err:
        manager_of(cfg, make_trainer(cfg)).load()
    assert str(err.value) == (f"'checkpoint.load_step' = 7: checkpoint folder '{tmp_path / 'checkpoint' / 'step-7'}' "
                              f"does not exist")


def test_exclude_from_loading_leaves_those_parts_fresh(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path)
    t = make_trainer(cfg)
    manager = manager_of(cfg, t)
    train_one_step(t, 1)
    train_one_step(t, 2)
    manager.save(2)
    saved = snapshot(t)

    cfg2 = make_cfg(tmp_path, exclude_from_loading=["optimizer", "train_state", "dataloader"])
    t2 = make_trainer(cfg2)
    fresh_params = {k: v for k, v in snapshot(t2).items() if k.startswith("param.")}
    manager_of(cfg2, t2).load()
    got = snapshot(t2)
    params = [k for k in saved if k.startswith("param.")]
    assert all(torch.equal(got[k], saved[k]) for k in params)
    assert not all(torch.equal(fresh_params[k], saved[k]) for k in params)
    assert not t2.optimizer.state  # no optimizer state was loaded
    assert (t2.train_state.step, t2.dataloader.batches, t2.lr_schedule.step_count) == (0, 0, 2)


def test_shape_mismatch_is_one_line_naming_tensor_and_shapes(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path)
    t = make_trainer(cfg)
    train_one_step(t, 1)
    manager_of(cfg, t).save(1)
    wider = make_trainer(cfg, {"ffn_dim": 256})
    with pytest.raises(ConfigError) as err:
        manager_of(cfg, wider).load()
    folder = tmp_path / "checkpoint" / "step-1"
    assert str(err.value) == (f"checkpoint '{folder}': tensor 'model.layers.0.feed_forward.w1.weight' has shape "
                              f"[192, 64] in the checkpoint but [256, 64] in this model")


def test_incomplete_folders_are_skipped_with_a_warning(single_process_group, tmp_path, caplog):
    cfg = make_cfg(tmp_path)
    t = make_trainer(cfg)
    manager = manager_of(cfg, t)
    for step in (1, 2):
        train_one_step(t, step)
        manager.save(step)
    root = tmp_path / "checkpoint"
    (root / "step-3.tmp").mkdir()
    (root / "step-3.tmp" / "__0_0.distcp").write_bytes(b"half")
    (root / "step-4").mkdir()  # renamed by hand, never finished: no .metadata
    t2 = make_trainer(cfg)
    with caplog.at_level(logging.WARNING, logger="titan_lite"):
        manager_of(cfg, t2).load()
    assert t2.train_state.step == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"skipping incomplete checkpoint '{root / 'step-3.tmp'}': its save never finished",
                        f"skipping incomplete checkpoint '{root / 'step-4'}': its save never finished"]
    # The next complete save removes the older unfinished .tmp (a folder without metadata is left to the user).
    train_one_step(t2, 3)
    manager_of(cfg, t2).save(5)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2", "step-4", "step-5"]


def test_initial_load_path_that_is_not_a_checkpoint_names_the_folder(single_process_group, tmp_path):
    not_a_checkpoint = tmp_path / "weights"
    not_a_checkpoint.mkdir()
    cfg = make_cfg(tmp_path / "run", initial_load_path=str(not_a_checkpoint))
    with pytest.raises(ConfigError) as err:
        manager_of(cfg, make_trainer(cfg)).load()
    assert str(err.value) == (f"checkpoint folder '{not_a_checkpoint}' is incomplete or not a DCP checkpoint "
                              f"(no .metadata file)")
    (not_a_checkpoint / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ConfigError) as err:
        manager_of(cfg, make_trainer(cfg)).load()
    assert str(err.value).startswith(f"checkpoint folder '{not_a_checkpoint}' is corrupt: cannot read its .metadata")


def test_last_save_model_only_is_cast_and_loads_model_only(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path, last_save_model_only=True, export_dtype="bfloat16")
    t = make_trainer(cfg)
    train_one_step(t, 1)
    manager_of(cfg, t).save(1, last=True)
    folder = tmp_path / "checkpoint" / "step-1"
    metadata = ckpt.read_metadata(folder)
    dtypes = {md.properties.dtype for md in metadata.state_dict_metadata.values()}
    assert dtypes == {torch.bfloat16}
    assert all(k.startswith("model.") for k in metadata.state_dict_metadata)

    # It cannot continue the run (that would start again at step 0 over this run's folder): one line says what to do.
    with pytest.raises(ConfigError) as err:
        manager_of(cfg, make_trainer(cfg)).load()
    assert str(err.value) == (
        f"the newest checkpoint '{folder}' holds model weights only ('checkpoint.last_save_model_only' = true) and "
        f"cannot continue a run; to train from these weights without touching the checkpoints in "
        f"'{tmp_path / 'checkpoint'}', set --checkpoint.initial_load_path {folder} and another --job.dump_folder")

    # As the initial weights of another run, it loads (cast back to the model's dtype).
    cfg2 = make_cfg(tmp_path / "new", initial_load_path=str(folder))
    t2 = make_trainer(cfg2)
    manager_of(cfg2, t2).load()
    assert t2.train_state.step == 0 and not t2.optimizer.state
    for (name, p), p2 in zip(t.model_parts[0].named_parameters(), t2.model_parts[0].parameters(), strict=True):
        assert p2.dtype == torch.float32
        assert torch.equal(p2.detach(), p.detach().to(torch.bfloat16).float()), name


def test_model_only_final_save_continues_from_the_newest_full_checkpoint(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path, interval=2, last_save_model_only=True)
    t = make_trainer(cfg)
    manager = manager_of(cfg, t)
    for step in range(1, 4):
        train_one_step(t, step)
        manager.save(step, last=step == 3)
        if step == 2:
            at_2 = snapshot(t)
    root = tmp_path / "checkpoint"
    choice = choose_resume(cfg.checkpoint, root)
    assert choice.folder == root / "step-2"
    assert choice.note == (f"'{root / 'step-3'}' holds model weights only (a final save with "
                           f"'checkpoint.last_save_model_only' = true), so the run continues from '{root / 'step-2'}', "
                           "its newest checkpoint with the training state: steps 3-3 run again")
    t2 = make_trainer(cfg)
    manager_of(cfg, t2).load()
    assert t2.train_state.step == 2
    assert all(torch.equal(v, at_2[k]) for k, v in snapshot(t2).items())


def test_keep_latest_k_never_removes_the_checkpoint_resumed_from(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path, keep_latest_k=0)
    t = make_trainer(cfg)
    manager = manager_of(cfg, t)
    for step in range(1, 5):
        train_one_step(t, step)
        manager.save(step)
    # Rewind to step 2 with keep_latest_k = 1: steps 3 and 4 of the earlier future go, 2 (resumed from) stays.
    cfg2 = make_cfg(tmp_path, keep_latest_k=1, load_step=2)
    t2 = make_trainer(cfg2)
    manager2 = manager_of(cfg2, t2)
    manager2.load()
    for step in (3, 4, 5):
        train_one_step(t2, step)
        manager2.save(step)
    assert steps_on_disk(tmp_path / "checkpoint") == [2, 5]


def test_a_save_is_never_written_with_nan_parameters(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path)
    t = make_trainer(cfg)
    manager = manager_of(cfg, t)
    train_one_step(t, 1)
    manager.save(1)
    with torch.no_grad():
        t.model_parts[0].layers["1"].ffn_norm.weight[3] = float("nan")
    with pytest.raises(TrainingFault) as err:
        manager.save(2)
    newest = tmp_path / "checkpoint" / "step-1"
    assert str(err.value) == ("step 2: parameter 'layers.1.ffn_norm.weight' holds NaN or infinity, so checkpoint "
                              f"step-2 is not saved; the newest complete checkpoint is '{newest}'")
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]


def test_a_save_that_cannot_be_written_is_one_line_and_leaves_earlier_checkpoints(single_process_group, tmp_path,
                                                                                 monkeypatch):
    cfg = make_cfg(tmp_path)
    t = make_trainer(cfg)
    manager = manager_of(cfg, t)
    train_one_step(t, 1)
    manager.save(1)
    before = {p.name: p.stat().st_size for p in (tmp_path / "checkpoint" / "step-1").iterdir()}

    def disk_full(self, path, *args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(torch.distributed.checkpoint.filesystem.FileSystem, "create_stream",
                        contextlib.contextmanager(disk_full))
    train_one_step(t, 2)
    with pytest.raises(TrainingFault) as err:
        manager.save(2)
    tmp = tmp_path / "checkpoint" / "step-2.tmp"
    assert re.fullmatch(
        rf"checkpoint step 2 could not be written to '{tmp}' \([\d.]+ GiB free there\): OSError: \[Errno 28\] No space "
        rf"left on device; the newest complete checkpoint is '{tmp_path / 'checkpoint' / 'step-1'}'", str(err.value))
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]
    assert {p.name: p.stat().st_size for p in (tmp_path / "checkpoint" / "step-1").iterdir()} == before


def test_truncated_or_missing_data_file_is_refused_before_loading(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path)
    t = make_trainer(cfg)
    train_one_step(t, 1)
    manager_of(cfg, t).save(1)
    folder = tmp_path / "checkpoint" / "step-1"
    shard = folder / "__0_0.distcp"
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    with pytest.raises(ConfigError) as err:
        manager_of(cfg, make_trainer(cfg)).load()
    assert str(err.value) == (f"checkpoint '{folder}' is truncated: '__0_0.distcp' has {size // 2:,} bytes, its "
                              f"metadata needs {size:,}")
    shard.unlink()
    with pytest.raises(ConfigError, match="is incomplete: its data file '__0_0.distcp' is missing"):
        manager_of(cfg, make_trainer(cfg)).load()


def test_seed_checkpoint_refuses_a_folder_with_checkpoints(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path)
    t = make_trainer(cfg)
    train_one_step(t, 1)
    manager_of(cfg, t).save(1)
    seed = make_cfg(tmp_path, create_seed_checkpoint=True)
    with pytest.raises(ConfigError) as err:
        manager_of(seed, make_trainer(seed)).save_seed()
    assert str(err.value) == (f"'checkpoint.create_seed_checkpoint' = true but '{tmp_path / 'checkpoint'}' already "
                              "holds checkpoints (steps 1); use an empty 'checkpoint.folder' or 'job.dump_folder'")


def test_first_step_interval_and_load_only(single_process_group, tmp_path):
    cfg = make_cfg(tmp_path, interval=3, enable_first_step_checkpoint=True, keep_latest_k=0)
    t = make_trainer(cfg)
    manager = manager_of(cfg, t)
    for step in range(1, 8):
        train_one_step(t, step)
        manager.save(step, last=step == 7)
    assert steps_on_disk(tmp_path / "checkpoint") == [1, 3, 6, 7]

    cfg2 = make_cfg(tmp_path, load_only=True, enable_first_step_checkpoint=True)
    t2 = make_trainer(cfg2)
    manager2 = manager_of(cfg2, t2)
    manager2.load()
    assert t2.train_state.step == 7
    for step in (8, 9):
        train_one_step(t2, step)
        manager2.save(step, last=step == 9)
    assert steps_on_disk(tmp_path / "checkpoint") == [1, 3, 6, 7]


def test_initial_load_path_model_only_and_seed_checkpoint(single_process_group, tmp_path):
    seed_cfg = make_cfg(tmp_path / "seed", create_seed_checkpoint=True)
    seeded = make_trainer(seed_cfg)
    train_one_step(seeded, 1)  # weights that differ from a fresh init
    manager_of(seed_cfg, seeded).save_seed()
    seed_folder = tmp_path / "seed" / "checkpoint" / "step-0"
    metadata = ckpt.read_metadata(seed_folder)
    assert all(k.startswith("model.") for k in metadata.state_dict_metadata)

    # A run with a seed checkpoint in its own folder starts from it at step 0.
    cfg = make_cfg(tmp_path / "seed")
    t = make_trainer(cfg)
    manager_of(cfg, t).load()
    assert t.train_state.step == 0
    got, seed = snapshot(t), snapshot(seeded)
    assert sorted(got) == sorted(k for k in seed if k.startswith("param."))
    assert all(torch.equal(got[k], seed[k]) for k in got)

    # initial_load_path with model_only: weights of a full checkpoint, nothing else.
    full_cfg = make_cfg(tmp_path / "full")
    donor = make_trainer(full_cfg)
    for step in (1, 2):
        train_one_step(donor, step)
    manager_of(full_cfg, donor).save(2)
    cfg2 = make_cfg(tmp_path / "fresh", initial_load_path=str(tmp_path / "full" / "checkpoint" / "step-2"))
    t2 = make_trainer(cfg2)
    manager_of(cfg2, t2).load()
    assert (t2.train_state.step, t2.lr_schedule.step_count, len(t2.optimizer.state)) == (0, 0, 0)
    for (name, p), p2 in zip(donor.model_parts[0].named_parameters(), t2.model_parts[0].parameters(), strict=True):
        assert torch.equal(p.detach(), p2.detach()), name


def two_linear_parts(names: list[list[str]]) -> list[torch.nn.Module]:
    """Model parts holding differently named Linear layers, like pipeline stages of one model."""
    torch.manual_seed(0)
    layers = {name: torch.nn.Linear(4, 4) for name in ("a", "b", "c")}
    return [torch.nn.ModuleDict({n: layers[n] for n in part}) for part in names]


def test_several_model_parts_with_one_optimizer_reshard_to_one_part(single_process_group, tmp_path):
    """Two 'stages' under one optimizer (interleaved pipeline schedules) save and load into one part."""
    def trainer(parts):
        t = make_trainer(make_cfg(tmp_path))
        t.model_parts = parts
        t.optimizer = torch.optim.AdamW([p for m in parts for p in m.parameters()], lr=0.1)
        t.lr_schedule = LRSchedule([t.optimizer], make_cfg(tmp_path).lr_scheduler, 100)
        return t

    src = trainer(two_linear_parts([["a"], ["b", "c"]]))
    x = torch.ones(2, 4)
    src.model_parts[1]["c"](src.model_parts[1]["b"](src.model_parts[0]["a"](x))).sum().backward()
    src.optimizer.step()
    manager_of(make_cfg(tmp_path), src).save(1)
    expected = {n: (p.detach().clone(), src.optimizer.state[p]["exp_avg"].clone())
                for m in src.model_parts for n, p in m.named_parameters()}

    dst = trainer(two_linear_parts([["a", "b", "c"]]))
    manager_of(make_cfg(tmp_path), dst).load()
    got = {n: (p.detach(), dst.optimizer.state[p]["exp_avg"]) for n, p in dst.model_parts[0].named_parameters()}
    assert got.keys() == expected.keys() and len(got) == 6
    for n, (param, exp_avg) in expected.items():
        assert torch.equal(got[n][0], param) and torch.equal(got[n][1], exp_avg), n
    assert all(float(dst.optimizer.state[p]["step"]) == 1.0 for p in dst.model_parts[0].parameters())


# ---------------------------------------------------------------- resharding across processes


def load_and_compare(folder: Path) -> dict:
    """Load the newest checkpoint of `folder` into a fresh stand-in trainer; differences to the saved reference."""
    cfg = make_cfg(folder)
    t = make_trainer(cfg, fsdp=dist.get_world_size() > 1)
    manager_of(cfg, t).load()
    reference = torch.load(folder / "reference.pt")
    got = snapshot(t)
    diffs = {k: (got[k] - v).abs().max().item() if k in got else None for k, v in reference.items()}
    return {"step": t.train_state.step, "diffs": diffs, "extra": sorted(set(got) - set(reference)),
            "batches": t.dataloader.batches}


def _reshard_worker(rank: int, port: int, world: int, folder: str, phase: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if phase == "save":
            cfg = make_cfg(Path(folder), async_mode="async")
            t = make_trainer(cfg, fsdp=True)
            manager = manager_of(cfg, t)
            for step in (1, 2):
                train_one_step(t, step)
                manager.save(step)
            manager.finish()
            snap = snapshot(t)
            if rank == 0:
                torch.save(snap, Path(folder) / "reference.pt")
        else:
            result = load_and_compare(Path(folder))
            (Path(folder) / f"result_{phase}_rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world: int, folder: Path, phase: str) -> None:
    spawn_on_free_port(_reshard_worker, world, world, str(folder), phase)


def check_result(result: dict) -> None:
    assert result["step"] == 2
    assert result["extra"] == []
    assert len(result["diffs"]) == 3 * 39  # 39 parameters of the tiny flavor, each with two moments
    assert all(d == 0.0 for d in result["diffs"].values()), result["diffs"]
    assert result["batches"] == 0  # the data position is per dp degree: it restarts on 1 or 4 ranks


def test_fsdp_checkpoint_of_two_ranks_loads_on_one_and_four(single_process_group, tmp_path):
    """Saved (asynchronously) by 2 FSDP ranks after 2 AdamW steps; loaded on 1 rank (this process) and on
    4 ranks, the full parameters and both Adam moments equal the saved ones exactly."""
    _spawn(2, tmp_path, "save")
    assert steps_on_disk(tmp_path / "checkpoint") == [1, 2]
    check_result(load_and_compare(tmp_path))
    _spawn(4, tmp_path, "load4")
    for rank in range(4):
        check_result(json.loads((tmp_path / f"result_load4_rank{rank}.json").read_text()))
