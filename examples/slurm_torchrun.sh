#!/usr/bin/env bash
# What runs once per node inside a Slurm allocation (srun starts one copy per node): work out
# the rendezvous from Slurm's variables, then hand over to torchrun, which starts the node's
# workers. Everything after the script's name is torchrun's training script and its arguments:
#
#   srun --ntasks-per-node=1 examples/slurm_torchrun.sh -m ddp_helpers.lessons.beyond_one_machine --out runs/x
#
# DRY_RUN=1 prints the torchrun command instead of running it (the kit's tests use both).
set -euo pipefail

: "${SLURM_JOB_ID:?not inside a Slurm job: run this through srun from an sbatch script}"
: "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set: run this through srun}"
: "${SLURM_NODEID:?SLURM_NODEID is not set: run this through srun, one task per node}"

# The rendezvous endpoint is the allocation's first host, which every node must reach by name.
# Its agent hosts the c10d store (an agent hosts it when the endpoint names its own machine);
# the other agents connect to it.
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:?SLURM_JOB_NUM_NODES is not set}}
# A port from the job id: two jobs sharing a first node collide only if their ids are equal
# modulo 1000; MASTER_PORT overrides.
MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
# One worker per GPU when Slurm gave GPUs; NPROC_PER_NODE overrides (e.g. on CPU nodes).
NPROC_PER_NODE=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
# Unquoted below on purpose: TORCHRUN may be a command with arguments ("python -m torch.distributed.run").
TORCHRUN=${TORCHRUN:-torchrun}
# After a restart, workers sharing the rendezvous store can read dead workers' addresses from the
# previous attempt and fail to connect (pytorch/pytorch#135712); a fresh store per attempt avoids
# that (see lesson 08).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

# --max-restarts is this node's agent's budget for restarting its workers after a failure; a
# node that dies takes its agent and budget with it, and Slurm's --requeue takes over.
# No --node-rank: the c10d rendezvous numbers the nodes itself (torchrun ignores --node-rank
# unless --rdzv-backend static, and warns). SLURM_NODEID only labels this node's log line.
# shellcheck disable=SC2206
cmd=($TORCHRUN
     --nnodes "$NNODES"
     --nproc-per-node "$NPROC_PER_NODE"
     --rdzv-backend c10d
     --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
     --rdzv-id "slurm-$SLURM_JOB_ID"
     --max-restarts "${MAX_RESTARTS:-1}"
     "$@")

echo "node $SLURM_NODEID of $NNODES: rendezvous at $MASTER_ADDR:$MASTER_PORT, $NPROC_PER_NODE worker(s) here" >&2
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%s\n' "${cmd[@]}"
else
    exec "${cmd[@]}"
fi
