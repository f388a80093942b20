#!/bin/bash
# Example ABCI 3.0 (PBS Professional) job: 4 nodes x 8 H200, ResNet-50 with LARS at batch 32K.
# Submit from the repository root:   qsub -P <group> -v IMAGENET_ROOT=/groups/<group>/imagenet,DSTRAIN_IFACE=<ib iface> hostfiles/abci_job.sh
# Arguments, where the job is started by hand (bash hostfiles/abci_job.sh key=value ...), override the recipe.
# PBS lists each node once per MPI process (mpiprocs=8), so launch.sh gives each node 8 slots.
# Check it without a cluster: DSTRAIN_DRY_RUN=1 makes launch.sh print the hostfile and the command
# (tests/test_launch.py runs it so under a faked PBS node file).
#PBS -q rt_HF
#PBS -l select=4:mpiprocs=8
#PBS -l walltime=12:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-.}"
source "${DSTRAIN_MODULES_SH:-/etc/profile.d/modules.sh}"   # environment modules (a test fakes it)
module load hpcx          # mpirun for DeepSpeed's openmpi launcher (pdsh is not on ABCI compute nodes)
export NCCL_IB_HCA=mlx5   # InfiniBand NDR between nodes
status=0
./launch.sh --launcher openmpi --iface "${DSTRAIN_IFACE:?set it to the InfiniBand interface of the nodes, see ip -br link}" \
    --deepspeed_config ds_configs/lars_bf16.json --config imagenet_resnet50_lars \
    data.root="${IMAGENET_ROOT:?set IMAGENET_ROOT to the ImageNet folder (train/ and val/), e.g. /groups/<group>/imagenet}" \
    run_dir=runs/rn50-lars-32k resume=auto "$@" || status=$?
# 75: stopped by the walltime limit or qdel after writing a checkpoint (docs/faults.md);
# submitting this script again continues the run (resume=auto starts fresh when run_dir is empty).
[[ $status -eq 75 ]] && echo "stopped with a checkpoint: qsub this script again to continue"
exit $status
