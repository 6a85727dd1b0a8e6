#!/usr/bin/env bash
# PPO on Qwen2.5-32B-Instruct (recipes/qwen2.5_32b.yaml): 4 trainer nodes + 2 engine nodes
# of 8 GPUs, as the recipe's `cluster:` section sizes it. Submit from the repository root
# (docs/cluster.md):
#   sbatch slurm/ppo_32b.sh
#   EXTRA="train.steps=500 checkpoint.every=5" RUN_DIR=runs/my_exp sbatch slurm/ppo_32b.sh
# Every setting (below, and megarl_settings in slurm/common.sh) can be set in the environment
# of sbatch. The same RUN_DIR resumes from its newest complete checkpoint: on requeue, and on a
# new submission.
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

# ---- settings: this job's defaults. Every other setting and its default is in
# megarl_settings (slurm/common.sh) and docs/cluster.md; all can be set in sbatch's environment.
RECIPE=${RECIPE:-recipes/qwen2.5_32b.yaml}
TRAINER_NODES=${TRAINER_NODES:-4}        # the first nodes of the job; rank 0 on the first
ENGINE_NODES=${ENGINE_NODES:-2}          # the next nodes: vLLM servers
ENGINE_TP=${ENGINE_TP:-4}             # GPUs per vLLM server (rollout.engines.tp)
# the batch script runs from a copy in slurm's spool folder: find the repository from where
# sbatch was called
MEGARL_ROOT=${MEGARL_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
# -------------------------------------------------------------------------------------------

[[ -f $MEGARL_ROOT/slurm/common.sh ]] || {
    echo "megarl: $MEGARL_ROOT is not the repository: submit from its root or set MEGARL_ROOT" >&2
    exit 2
}
# shellcheck source=slurm/common.sh
source "$MEGARL_ROOT/slurm/common.sh"
megarl_settings
megarl_job
