#!/usr/bin/env bash
# Launch dstrain across the nodes of a PBS (ABCI 3.0) or Slurm job, or on this machine.
#
#   qsub -l select=4 -l walltime=2:00:00 -- ./launch.sh --deepspeed_config ds_configs/bf16.json \
#        --config fashion_mnist batch.global_size=4096
#   ./launch.sh ...                       # outside a scheduler: all local GPUs (or 1 CPU rank)
#
# Environment: GPUS_PER_NODE (default: nvidia-smi count, or 1), DSTRAIN_VENV (default .venv),
# MASTER_PORT (default 29500), HOSTFILE (default: written to $TMPDIR from the scheduler's node list).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DSTRAIN_VENV:-.venv}
[[ -x "$VENV/bin/deepspeed" ]] || { echo "launch.sh: $VENV/bin/deepspeed missing; run ./run.sh setup first" >&2; exit 2; }

if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | wc -l || true)
    [[ "$GPUS_PER_NODE" -gt 0 ]] || GPUS_PER_NODE=1
fi

nodes=""
if [[ -n "${PBS_NODEFILE:-}" && -f "$PBS_NODEFILE" ]]; then
    nodes=$(sort -u "$PBS_NODEFILE")
elif [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
    nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
fi

if [[ -n "$nodes" && $(echo "$nodes" | wc -l) -gt 1 ]]; then
    HOSTFILE=${HOSTFILE:-${TMPDIR:-/tmp}/dstrain-hostfile.$$}
    echo "$nodes" | awk -v s="$GPUS_PER_NODE" 'NF {print $1 " slots=" s}' > "$HOSTFILE"
    master=$(echo "$nodes" | head -n 1)
    echo "launch.sh: $(echo "$nodes" | wc -l) nodes x $GPUS_PER_NODE GPUs, hostfile $HOSTFILE, master $master"
    exec "$VENV/bin/deepspeed" --hostfile "$HOSTFILE" --master_addr "$master" \
        --master_port "${MASTER_PORT:-29500}" dstrain/main.py "$@"
fi
echo "launch.sh: single node, $GPUS_PER_NODE processes"
exec "$VENV/bin/deepspeed" --num_gpus "$GPUS_PER_NODE" --master_port "${MASTER_PORT:-29500}" dstrain/main.py "$@"
