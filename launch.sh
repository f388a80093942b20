#!/usr/bin/env bash
# Launch dstrain on this machine or across the nodes of a PBS (ABCI 3.0), Slurm or UGE job.
#
#   ./launch.sh [--dry-run] [--launcher auto|pdsh|openmpi] [--iface ib0] [--gpus-per-node 8] \
#       --deepspeed_config ds_configs/bf16.json --config imagenet_resnet50 data.root=/path
#
# Inside a job it writes a DeepSpeed hostfile from the scheduler's node list ($PBS_NODEFILE,
# $SLURM_JOB_NODELIST, $PE_HOSTFILE / $SGE_JOB_HOSTLIST), uses the first node as rendezvous and
# runs `deepspeed --hostfile ... --launcher pdsh|openmpi dstrain/main.py ARGS`. Outside a job:
# `deepspeed --num_gpus N` with N = local GPUs, or $DSTRAIN_CPU_RANKS CPU ranks (default 1).
# --dry-run prints the hostfile and the exact command. Logic and options: dstrain/run/launch.py.
# Environment: GPUS_PER_NODE, MASTER_PORT (29500), DSTRAIN_VENV (.venv), DSTRAIN_IFACE, TMPDIR,
# DSTRAIN_DRY_RUN=1 (as --dry-run).
# Example ABCI 3.0 job script: hostfiles/abci_job.sh.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${DSTRAIN_VENV:-.venv}
PY="$VENV/bin/python"
[[ -x "$PY" ]] || PY=$(command -v python3)
exec "$PY" -m dstrain.launch "$@"
