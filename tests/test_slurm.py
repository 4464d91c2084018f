"""scripts/slurm/multinode_trainer.slurm under stand-in `scontrol` and `srun` executables: the commands and environment
it hands them, its one-line errors, and (slow) two "nodes" on this machine training like one process."""

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.integration.harness import BASE_TOML, REPO, Run, assert_losses_close, one_window_dataset, run_train

SCRIPT = REPO / "scripts" / "slurm" / "multinode_trainer.slurm"
PASSED_ON = ("NNODES", "NGPU", "RDZV_ENDPOINT", "RDZV_ID", "MAX_RESTARTS", "CONFIG_FILE")

# scontrol: logs its arguments; `show hostnames` names the hosts of FAKE_HOSTS, one a line, like SLURM.
SCONTROL = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$FAKE_LOG/scontrol"
[ "$1 $2" = "show hostnames" ] && tr ',' '\\n' <<< "$FAKE_HOSTS"
"""
# srun: records its arguments and the environment it was given, then exits with FAKE_SRUN_EXIT.
SRUN_RECORD = """#!/usr/bin/env python3
import json, os, sys
keys = KEYS
with open(os.path.join(os.environ["FAKE_LOG"], "srun.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}, f)
sys.exit(int(os.environ.get("FAKE_SRUN_EXIT", "0")))
""".replace("KEYS", repr(PASSED_ON))
# srun: starts the command once per node (--nodes=N), as SLURM does on N machines, and returns the worst exit code.
SRUN_NODES = """#!/usr/bin/env bash
nodes=1
while [ "${1#--}" != "$1" ]; do case "$1" in --nodes=*) nodes="${1#--nodes=}" ;; esac; shift; done
pids=()
for ((i = 0; i < nodes; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" > "$FAKE_LOG/node$i.log" 2>&1 & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def stand_ins(folder: Path, srun: str) -> Path:
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("scontrol", SCONTROL), ("srun", srun)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IXUSR)
    return bin_dir


def slurm_env(bin_dir: Path, log: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in PASSED_ON}
    env.update({"PATH": f"{bin_dir}:{env['PATH']}", "FAKE_LOG": str(log), "FAKE_HOSTS": "gpu-node-017,gpu-node-018",
                "SLURM_JOB_NODELIST": "gpu-node-[017-018]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242",
                "SLURM_SUBMIT_DIR": str(REPO), **extra})
    return env


def submit(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict | None, list[str]]:
    """Run the script as sbatch would (from a spool copy); (its result, what srun got, scontrol's calls)."""
    log = tmp_path / "log"
    log.mkdir(exist_ok=True)
    bin_dir = tmp_path / "bin" if (tmp_path / "bin").exists() else stand_ins(tmp_path, SRUN_RECORD)
    spool = tmp_path / "slurm_script"
    spool.write_text(SCRIPT.read_text())
    proc = subprocess.run(["bash", str(spool), *args], cwd=REPO, env=slurm_env(bin_dir, log, **env),
                          capture_output=True, text=True, timeout=60)
    srun = json.loads((log / "srun.json").read_text()) if (log / "srun.json").exists() else None
    scontrol = (log / "scontrol").read_text().splitlines() if (log / "scontrol").exists() else []
    return proc, srun, scontrol


def test_one_task_per_node_rendezvous_on_the_first_host_config_and_overrides_passed(tmp_path):
    proc, srun, scontrol = submit(tmp_path, "--training.steps", "7", "--job.description", "two words",
                                  SLURM_GPUS_ON_NODE="4", CONFIG_FILE="train_configs/llama3_8b.toml",
                                  MAX_RESTARTS="2")
    assert proc.returncode == 0, proc.stderr
    assert scontrol == ["show hostnames gpu-node-[017-018]"]
    assert srun["argv"] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                            str(REPO / "run_train.sh"), "--training.steps", "7", "--job.description", "two words"]
    assert srun["env"] == {"NNODES": "2", "NGPU": "4", "RDZV_ENDPOINT": "gpu-node-017:29500", "RDZV_ID": "4242",
                           "MAX_RESTARTS": "2", "CONFIG_FILE": "train_configs/llama3_8b.toml"}
    lines = proc.stdout.splitlines()
    assert lines[0] == ("multinode_trainer: job 4242: 2 nodes x 4 ranks, rendezvous at gpu-node-017:29500, max "
                        "restarts 2, config train_configs/llama3_8b.toml")
    assert lines[-1] == "multinode_trainer: job 4242 ended with exit code 0"


def test_gpus_per_node_port_and_exit_code(tmp_path):
    proc, srun, _ = submit(tmp_path, SLURM_GPUS_PER_NODE="h100:8", RDZV_PORT="29611", FAKE_SRUN_EXIT="3")
    assert proc.returncode == 3
    assert (srun["env"]["NGPU"], srun["env"]["RDZV_ENDPOINT"], srun["env"]["MAX_RESTARTS"]) == \
        ("8", "gpu-node-017:29611", "0")
    assert srun["env"]["CONFIG_FILE"] is None  # run_train.sh's default
    assert proc.stdout.splitlines()[-1] == "multinode_trainer: job 4242 ended with exit code 3"
    explicit, srun, _ = submit(tmp_path, NGPU="2", SLURM_GPUS_ON_NODE="8")
    assert explicit.returncode == 0 and srun["env"]["NGPU"] == "2"


@pytest.mark.parametrize("env, message", [
    ({}, "error: cannot tell the ranks per node: set NGPU or #SBATCH --gpus-per-node (got '')"),
    ({"SLURM_JOB_NODELIST": ""},
     "error: SLURM_JOB_NODELIST is not set: submit this script with sbatch (or run it in an salloc allocation)"),
    ({"SLURM_GPUS_ON_NODE": "1", "SLURM_SUBMIT_DIR": "/nonexistent"},
     "error: no run_train.sh in '/nonexistent': submit from the titan_lite checkout or set TITAN_LITE_ROOT"),
    ({"SLURM_GPUS_ON_NODE": "1", "SLURM_JOB_NUM_NODES": ""},
     "error: SLURM_JOB_NUM_NODES is not set (got ''): submit this script with sbatch --nodes N"),
    ({"SLURM_GPUS_ON_NODE": "1", "CONFIG_FILE": "train_configs/no_such.toml"},
     f"error: the config 'train_configs/no_such.toml' does not exist (relative to {REPO}, where every node starts "
     "run_train.sh)"),
])
def test_bad_allocations_are_one_line(tmp_path, env, message):
    proc, srun, _ = submit(tmp_path, **env)
    assert proc.returncode == 2 and srun is None
    assert proc.stderr.strip() == message


def test_help_prints_the_usage(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.startswith("titan_lite on a SLURM cluster")
    assert "CONFIG_FILE=train_configs/llama3_8b.toml sbatch --nodes 4 scripts/slurm/multinode_trainer.slurm" in \
        proc.stdout
    assert "adjust --gpus-per-node and --cpus-per-task to your\nnodes" in proc.stdout


@pytest.mark.slow
def test_two_nodes_under_the_script_train_like_one_process(tmp_path):
    """The stand-in srun starts ./run_train.sh twice on this machine (two "nodes" of 1 rank, 4 sequences each);
    their c10d rendezvous on the first host gives the losses of one process with all 8 sequences."""
    (tmp_path / "data").mkdir()
    data = [*one_window_dataset(tmp_path / "data", 8 * 4, 64), "--training.steps", "3"]
    reference = run_train([*data, "--training.local_batch_size", "8"], tmp_path / "one", ngpu=1)
    assert reference.returncode == 0, reference.output[-3000:]
    stand_ins(tmp_path / "cluster", SRUN_NODES)
    log = tmp_path / "cluster" / "log"
    log.mkdir()
    env = slurm_env(tmp_path / "cluster" / "bin", log, FAKE_HOSTS="127.0.0.1,localhost", NGPU="1",
                    RDZV_PORT=str(free_port()), CONFIG_FILE=str(BASE_TOML), OMP_NUM_THREADS="1")
    env.pop("DRY_RUN", None)
    proc = subprocess.run(["bash", str(SCRIPT), "--job.dump_folder", str(tmp_path / "two"), *data,
                           "--training.local_batch_size", "4"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    node0 = (log / "node0.log").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr + node0[-3000:] + (log / "node1.log").read_text()[-3000:]
    assert "rendezvous at 127.0.0.1:" in proc.stdout
    assert "world 2 = dp_replicate 1 x dp_shard 2" in node0
    assert_losses_close(Run(0, node0, tmp_path / "two"), reference.tb_losses(), 1e-5)
