#!/usr/bin/env bash
# PPO on Qwen2.5-32B-Instruct (recipes/qwen2.5_32b.yaml): 4 trainer nodes + 2 engine nodes
# of 8 GPUs, as the recipe's `cluster:` section sizes it. Submit from the repository root
# (docs/cluster.md):
#   sbatch slurm/ppo_32b.sh
#   EXTRA="train.steps=500 checkpoint.every=5" RUN_DIR=runs/my_exp sbatch slurm/ppo_32b.sh
# Every setting below can be set in the environment of sbatch. The same RUN_DIR resumes from its
# newest complete checkpoint: on requeue, and on a new submission.
#SBATCH --job-name=megarl-ppo-32b
#SBATCH --nodes=6
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:TERM@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

# ---- settings ----------------------------------------------------------------------------
# the batch script runs from a copy in slurm's spool folder: find the repository from where
# sbatch was called
MEGARL_ROOT=${MEGARL_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
RECIPE=${RECIPE:-recipes/qwen2.5_32b.yaml}
TRAINER_NODES=${TRAINER_NODES:-4}                 # the first nodes of the job; rank 0 on the first
ENGINE_NODES=${ENGINE_NODES:-2}                   # the next nodes: vLLM servers
GPUS_PER_NODE=${GPUS_PER_NODE:-8}                 # 0: CPU (the local stand-in)
TRAINER_PROCS_PER_NODE=${TRAINER_PROCS_PER_NODE:-$GPUS_PER_NODE}   # torchrun ranks per trainer node
ENGINE_TP=${ENGINE_TP:-4}                      # GPUs per vLLM server (rollout.engine_tp)
ENGINES_PER_NODE=${ENGINES_PER_NODE:-$((GPUS_PER_NODE / ENGINE_TP))}
PORT_BASE=${PORT_BASE:-8100}                      # servers listen on PORT_BASE, PORT_BASE+1, ...
MASTER_PORT=${MASTER_PORT:-29500}                 # torchrun rendezvous on the first trainer node
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME:-megarl-ppo-32b}}   # stable across requeues: resumes here
STAGING_DIR=${STAGING_DIR:-$RUN_DIR/weight_staging}   # weight pushes: shared by trainer and engine nodes
MEGARL_PY=${MEGARL_PY:-$MEGARL_ROOT/.venv/bin/python}
ENGINE_START_TIMEOUT=${ENGINE_START_TIMEOUT:-1800}    # seconds for every server to answer /health
EXTRA=${EXTRA:-}                                 # more key=value overrides, space separated
SRUN_EXTRA=${SRUN_EXTRA:-}                       # more srun options for every step (e.g. --cpu-bind=none)
NODE_ADDRS=${NODE_ADDRS:-}                       # node=addr,... : the address each node is reached at
REQUEUE_ON_TERM=${REQUEUE_ON_TERM:-1}             # 1: a job stopped by SIGTERM requeues itself
STOP_TIMEOUT=${STOP_TIMEOUT:-60}                  # seconds between SIGTERM and SIGKILL for the servers
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}   # megatron TP comm overlap
export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}   # the same in trainer and vLLM (vLLM uses 0)
# -------------------------------------------------------------------------------------------

[[ -f $MEGARL_ROOT/slurm/common.sh ]] || {
    echo "megarl: $MEGARL_ROOT is not the repository: submit from its root or set MEGARL_ROOT" >&2
    exit 2
}
# shellcheck source=slurm/common.sh
source "$MEGARL_ROOT/slurm/common.sh"
megarl_job
