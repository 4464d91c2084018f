#!/usr/bin/env bash
# titan_lite launcher. Environment variables:
#   CONFIG_FILE   TOML config (default: train_configs/debug_model.toml; --job.config_file FILE does the same)
#   NGPU          processes per node (default: visible GPUs, else 1)
#   LOG_RANK      comma list of local ranks whose output is shown (default: 0)
#   COMM_BACKEND  nccl (default on CUDA) or gloo (default on CPU)
#   DRY_RUN=1     validate and plan the job in one CPU process for NGPU x NNODES ranks; train nothing
#   MAX_RESTARTS  torchrun --max_restarts: restart every rank of a node after a rank dies (default 0); with
#                 checkpoint.enable the restarted run continues from the newest complete checkpoint
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT or RDZV_ENDPOINT   multi-node torchrun
# Every other argument is a config override: --section.key value or --section.key=value.
# SIGTERM or Ctrl-C: every rank saves a checkpoint after its current step and the run exits 0; a second one stops
# at once. Exit codes: 0 done (or stopped and saved), 2 user error, 3 training fault, 4 hung collective (one line
# each), 5 DRY_RUN plan fine but files missing.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# titan_lite is importable from the checkout even when the python is not the project's .venv.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="$("$root/scripts/setup_env.sh")"

# The config: CONFIG_FILE or --job.config_file (the same file given both ways is fine, two different ones are not).
cli_config=""
for ((i = 1; i <= $#; i++)); do
  case "${!i}" in
    --job.config_file) j=$((i + 1)); cli_config="${!j:-}" ;;
    --job.config_file=*) cli_config="${!i#--job.config_file=}" ;;
  esac
done
if [ -n "$cli_config" ] && [ -n "${CONFIG_FILE:-}" ] && [ "$cli_config" != "$CONFIG_FILE" ]; then
  echo "error: CONFIG_FILE=$CONFIG_FILE and --job.config_file $cli_config name different configs; give one" >&2
  exit 2
fi
CONFIG_FILE="${cli_config:-${CONFIG_FILE:-$root/train_configs/debug_model.toml}}"
if [ -z "${NGPU:-}" ]; then
  NGPU=1
  # Counting GPUs imports torch (seconds): only where an NVIDIA or AMD device node exists.
  if compgen -G "/dev/nvidia[0-9]*" >/dev/null || [ -e /dev/kfd ]; then
    NGPU="$("$PYTHON" -c 'import torch; print(max(1, torch.cuda.device_count()))' 2>/dev/null || echo 1)"
  fi
fi
LOG_RANK="${LOG_RANK:-0}"
NNODES="${NNODES:-1}"
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: NGPU=$NGPU is not a number of processes per node (1 or more)" >&2
  exit 2
fi
if ! [[ "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "error: LOG_RANK=$LOG_RANK is not a comma list of local ranks whose output is shown (e.g. 0 or 0,1)" >&2
  exit 2
fi
export NGPU NNODES
[ -n "${COMM_BACKEND:-}" ] && export COMM_BACKEND

if [ "${DRY_RUN:-0}" = "1" ]; then
  DRY_RUN=1 exec "$PYTHON" -m titan_lite.train --job.config_file "$CONFIG_FILE" "$@"
fi

# On CPU, share the cores among this node's processes instead of oversubscribing them.
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cores="$(nproc 2>/dev/null || echo 1)"
  export OMP_NUM_THREADS=$(( cores / NGPU > 0 ? cores / NGPU : 1 ))
fi

if [ "$NNODES" -gt 1 ]; then
  if [ -n "${RDZV_ENDPOINT:-}" ]; then
    rdzv=(--rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "${RDZV_ID:-titan_lite}")
  else
    rdzv=(--node_rank "${NODE_RANK:?NODE_RANK is required with NNODES > 1}"
          --master_addr "${MASTER_ADDR:?MASTER_ADDR is required with NNODES > 1}" --master_port "${MASTER_PORT:-29500}")
  fi
  launch=(--nnodes "$NNODES" "${rdzv[@]}")
else
  launch=(--standalone)
fi

# The launcher supervises the ranks: stop signals reach them once, and a rank's user error ends the run in one line.
# One node without restarts needs no torchrun: the launcher starts the ranks itself (torchrun costs ~4 s a launch).
# Without GPUs it imports the trainer once and forks the ranks from it (torch's import costs ~5 s a rank on a CPU).
if [ "$NNODES" = "1" ] && [ "${MAX_RESTARTS:-0}" = "0" ]; then
  preload=()
  if [ "$(uname -s)" = "Linux" ] && ! compgen -G "/dev/nvidia[0-9]*" >/dev/null && ! [ -e /dev/kfd ]; then
    preload=(--preload)
  fi
  exec "$PYTHON" -m titan_lite.launcher --local "$NGPU" --log-ranks "$LOG_RANK" "${preload[@]+"${preload[@]}"}" \
    -m titan_lite.train --job.config_file "$CONFIG_FILE" "$@"
fi
exec "$PYTHON" -m titan_lite.launcher --nproc_per_node "$NGPU" "${launch[@]}" --max_restarts "${MAX_RESTARTS:-0}" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m titan_lite.train --job.config_file "$CONFIG_FILE" "$@"
