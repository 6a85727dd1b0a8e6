#!/usr/bin/env bash
# PPO on Llama-3.1-70B-Instruct (recipes/llama3.1_70b.yaml), on the nodes of the recipe's
# `cluster:` section: it sets the job's layout (trainer and engine nodes, GPUs per node,
# engine TP; slurm/common.sh), and #SBATCH --nodes below must equal its cluster.nodes.
# Submit from the repository root
# (docs/cluster.md):
#   sbatch slurm/ppo_70b.sh
#   EXTRA="train.steps=500 checkpoint.every=5" RUN_DIR=runs/my_exp sbatch slurm/ppo_70b.sh
# Every setting (megarl_settings in slurm/common.sh, docs/cluster.md; the layout: the recipe's
# cluster: section) can be set in the environment of sbatch. The same RUN_DIR resumes from its
# newest complete checkpoint: on requeue, and on a new submission.
#SBATCH --job-name=megarl-ppo-70b
#SBATCH --nodes=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:TERM@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

RECIPE=${RECIPE:-recipes/llama3.1_70b.yaml}   # the rest: megarl_batch (slurm/common.sh)
# slurm runs a copy of this script from its spool folder: the repository is where sbatch was called
MEGARL_ROOT=${MEGARL_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
[[ -f $MEGARL_ROOT/slurm/common.sh ]] || {
    echo "megarl: $MEGARL_ROOT is not the repository: submit from its root or set MEGARL_ROOT" >&2
    exit 2
}
# shellcheck source=slurm/common.sh
source "$MEGARL_ROOT/slurm/common.sh"
megarl_batch
