#!/usr/bin/env bash
# One task of `srun --ntasks-per-node=G` (one task per GPU), without torchrun: Slurm starts every
# worker itself, and this script turns Slurm's variables into the ones init_process_group("env://")
# and the kit read, then runs python with the arguments given:
#
#   srun --ntasks-per-node=2 examples/slurm_srun_task.sh -m ddp_helpers.lessons.beyond_one_machine --out runs/x
#
# No agent watches the workers: a task that fails ends the job step (srun --kill-on-bad-exit=1),
# and nothing restarts it; Slurm's --requeue and the checkpoint do. DRY_RUN=1 prints the
# variables instead of starting python (the kit's tests use both).
set -euo pipefail

: "${SLURM_PROCID:?not a Slurm task: run this through srun, one task per GPU}"
: "${SLURM_NTASKS_PER_NODE:?SLURM_NTASKS_PER_NODE is not set: give srun --ntasks-per-node}"

export RANK=$SLURM_PROCID              # this task's number in the whole step
export WORLD_SIZE=$SLURM_NTASKS        # every task of the step: one per GPU
# This task's number on its node, which picks its GPU: right when every task sees all the node's
# GPUs (--gpus-per-node). With --gpus-per-task=1 each task sees one GPU, as cuda:0: then set
# LOCAL_RANK=0 and LOCAL_WORLD_SIZE=1 instead.
export LOCAL_RANK=$SLURM_LOCALID
export LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE
# Task 0 runs on the first node (srun's default block distribution) and hosts the process
# group's store there: every task must reach it by this name.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
# A port from the job id, as in slurm_torchrun.sh; MASTER_PORT overrides.
export MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}

if [[ "${DRY_RUN:-0}" == 1 ]]; then
    for v in RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT; do
        echo "$v=${!v}"
    done
else
    exec "${PYTHON:-python}" "$@"
fi
