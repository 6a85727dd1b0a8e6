#!/usr/bin/env bash
# Shared by the per-size scripts slurm/ppo_*.sh, grpo_*.sh (docs/cluster.md). Two uses:
#   source slurm/common.sh; megarl_batch       the batch shell, after its RECIPE and MEGARL_ROOT
#   bash slurm/common.sh trainer_task|engine_task RECIPE [key=value ...]
#                                               one srun task (the batch shell starts these)
# The job's layout comes from the recipe's `cluster:` section (megarl/plan/job.py): trainer and
# engine nodes, GPUs per node, engine TP (rollout.engines.tp), one server per ENGINE_TP GPUs of an
# engine node. A variable of the same name in sbatch's environment (TRAINER_NODES, ENGINE_NODES,
# GPUS_PER_NODE, ENGINE_TP, ENGINES_PER_NODE, TRAINER_PROCS_PER_NODE) replaces the recipe's value;
# the job log says which, and says when the servers it starts replace rollout.engines.count.
# The job: the first TRAINER_NODES nodes run the trainer (srun: one task per node, each a
# torchrun with TRAINER_PROCS_PER_NODE ranks; global rank 0 on the head node), the next
# ENGINE_NODES nodes run ENGINES_PER_NODE vLLM servers each (srun: one step per node), bound
# to the node's cluster-internal address with an API key made for this job. The trainer gets
# their URLs as rollout.engines.mode=remote rollout.engines.urls=[...]. Any trainer task that
# fails ends the trainer step (--kill-on-bad-exit); when the trainer step ends, everything else
# is stopped and the job exits with its code. SIGTERM to the batch shell (#SBATCH
# --signal=B:TERM@...) reaches the trainer ranks, which save a checkpoint and exit; the job
# then requeues itself and the next run resumes from RUN_DIR.
set -euo pipefail

log() { printf '[megarl-slurm %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { log "error: $*" >&2; exit "${2:-1}"; }

# node name -> the address servers bind to and clients use. NODE_ADDRS="node=addr,..." wins
# (e.g. to pick the high-speed fabric's address); else the node's first IPv4 address.
node_addr() {
    local name=$1 pair addr
    local -a pairs=()
    IFS=, read -r -a pairs <<<"${NODE_ADDRS:-}"
    for pair in "${pairs[@]}"; do
        if [[ ${pair%%=*} == "$name" ]]; then
            echo "${pair#*=}"
            return
        fi
    done
    addr=$(getent ahostsv4 "$name" 2>/dev/null | awk 'NR == 1 {print $1}') || true
    [[ -n $addr ]] || die "cannot resolve node $name to an IPv4 address: set NODE_ADDRS=$name=ADDR,..."
    echo "$addr"
}

# ----------------------------------------------------------------------------- srun tasks

# One trainer node: torchrun with a static rendezvous on MASTER_ADDR:MASTER_PORT (node rank =
# this task's rank, so global rank 0 is on the head node). torchrun's own SIGTERM handling
# would SIGKILL the ranks 30 s later, before a large checkpoint is written: torchrun ignores
# SIGTERM here and this shell hands it to the ranks (under slurm they also get it directly).
# A rank that is still starting ignores SIGTERM (inherited from torchrun); a rank that has
# finished its work and is exiting has SIGTERM's default action again (Python's shutdown) and
# must not get it. So every rank gets SIGTERM once its handler is installed (SigCgt in
# /proc/PID/status), checked every 2 s until torchrun is gone: a stop requested during
# start-up is not lost, and a rank is never signalled while it exits.
TORCHRUN_PID=""
RESENDER_PID=""
catches_term() {    # pid: is a handler installed for SIGTERM (signal 15: bit 14)?
    local mask
    mask=$(awk '/^SigCgt:/ {print $2}' "/proc/$1/status" 2>/dev/null) || return 1
    [[ -n $mask ]] && (((16#$mask >> 14) & 1))
}
deliver_term() {    # SIGTERM to each rank once, as soon as it catches it
    local pid
    local -A done_pids=()
    while kill -0 "$TORCHRUN_PID" 2>/dev/null; do
        for pid in $(ps -o pid= --ppid "$TORCHRUN_PID" 2>/dev/null || true); do
            if [[ -z ${done_pids[$pid]:-} ]] && catches_term "$pid"; then
                kill -TERM "$pid" 2>/dev/null || true
                done_pids[$pid]=1
            fi
        done
        sleep 2
    done
}
forward_term() {
    [[ -z $RESENDER_PID ]] || return 0
    deliver_term &
    RESENDER_PID=$!
}

trainer_task() {
    local recipe=$1 rc=0
    shift
    trap '' TERM    # inherited by torchrun; the ranks install their own handler (megarl/distributed/stop.py)
    PET_SIGNALS_TO_HANDLE=SIGINT,SIGHUP,SIGQUIT "$MEGARL_PY" -m torch.distributed.run \
        --nnodes "$TRAINER_NODES" --nproc_per_node "$TRAINER_PROCS_PER_NODE" \
        --node_rank "$SLURM_PROCID" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
        --max_restarts 0 -m megarl.cli train "$recipe" "$@" &
    TORCHRUN_PID=$!
    trap forward_term TERM
    while true; do
        wait "$TORCHRUN_PID" && rc=0 || rc=$?
        kill -0 "$TORCHRUN_PID" 2>/dev/null || break     # else: a trapped signal woke us
    done
    [[ -z $RESENDER_PID ]] || kill "$RESENDER_PID" 2>/dev/null || true
    exit "$rc"
}

# One vLLM server (slot = SLURM_LOCALID on this node); the task becomes the server (exec).
engine_task() {
    local recipe=$1 slot=${SLURM_LOCALID:-0}
    shift
    local index=$((ENGINE_NODE_INDEX * ENGINES_PER_NODE + slot))
    local log="$JOB_LOG_DIR/engines/engine_${index}.log"
    if ((GPUS_PER_NODE > 0)); then     # this slot's ENGINE_TP GPUs of the node
        local -a gpus=()
        IFS=, read -r -a gpus <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((GPUS_PER_NODE - 1)))}"
        CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${gpus[*]:slot*ENGINE_TP:ENGINE_TP}")
        export CUDA_VISIBLE_DEVICES
    fi
    exec "$MEGARL_PY" -m megarl.rollout.engines.serve serve "$recipe" "$@" \
        --host "$ENGINE_ADDR" --port $((PORT_BASE + slot)) --index "$index" >>"$log" 2>&1
}

# ----------------------------------------------------------------------------- batch shell

TERM_RECEIVED=0
TRAINER_PID=""
ENGINE_PIDS=()

on_term() {
    TERM_RECEIVED=1
    log "SIGTERM: the trainer saves a checkpoint after its current step, then stops"
    [[ -z $TRAINER_PID ]] || kill -TERM "$TRAINER_PID" 2>/dev/null || true
}

# SIGTERM the srun steps still running (srun hands it to their tasks), SIGKILL after a grace
stop_steps() {
    local pid deadline=$((SECONDS + ${STOP_TIMEOUT:-60}))
    for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "$@"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}

abort_job() {   # message, exit code: stop every step and leave
    log "error: $1" >&2
    stop_steps ${TRAINER_PID:+"$TRAINER_PID"} "${ENGINE_PIDS[@]}"
    exit "${2:-1}"
}

write_job_info() {  # the per-job log folder: revision, resolved config, nodes, environment
    local dir=$1
    shift
    {
        echo "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} started $(date -u +%Y-%m-%dT%H:%M:%SZ)"
        echo "recipe $RECIPE"
        echo "trainer nodes: ${TRAINER_NODE_LIST[*]} ($TRAINER_PROCS_PER_NODE ranks each)"
        echo "engine nodes: ${ENGINE_NODE_LIST[*]} ($ENGINES_PER_NODE servers each, tp $ENGINE_TP)"
        echo "master $MASTER_ADDR:$MASTER_PORT"
        local note
        for note in "${LAYOUT_NOTES[@]}"; do echo "layout: $note"; done
        echo "engine urls: ${ENGINE_URLS[*]}"
    } >"$dir/job.txt"
    # a key given as a setting shows as <redacted>, as in every config megarl writes: the secrets
    # and their old names are megarl/config/secrets.py's to know; without it, no overrides at all
    if ! PYTHONPATH="$MEGARL_ROOT${PYTHONPATH:+:$PYTHONPATH}" "${MEGARL_PY:-$MEGARL_ROOT/.venv/bin/python}" \
        -m megarl.config.secrets "$@" >"$dir/overrides.txt" 2>/dev/null; then
        echo "(not written: megarl/config/secrets.py could not redact them)" >"$dir/overrides.txt"
    fi
    if git -C "$MEGARL_ROOT" rev-parse HEAD >"$dir/git.txt" 2>/dev/null; then
        git -C "$MEGARL_ROOT" status --short >>"$dir/git.txt" 2>/dev/null || true
    else
        echo "not a git checkout: $MEGARL_ROOT" >"$dir/git.txt"
    fi
    # never the API key
    env | grep -E '^(SLURM_|SLURMD_|NCCL_|CUDA_|VLLM_|TORCH|OMP_|MASTER_|MEGARL_|NODE_ADDRS|PYTHON|PATH=|LD_LIBRARY_PATH=|HOSTNAME=)' \
        | grep -v -E 'API_KEY' | sort >"$dir/env.txt" || true
}

# The settings every job shares, as ${VAR:-default}: a value in sbatch's environment wins. The
# per-size scripts set RECIPE and MEGARL_ROOT first; the layout is the recipe's (megarl_layout).
megarl_settings() {
    PORT_BASE=${PORT_BASE:-8100}                       # servers listen on PORT_BASE, PORT_BASE+1, ...
    MASTER_PORT=${MASTER_PORT:-29500}                  # torchrun rendezvous on the first trainer node
    WEIGHT_PORT=${WEIGHT_PORT:-29600}                  # the weight group's rendezvous on the first trainer node (engines connect)
    : "${RECIPE:?set by slurm/ppo_<size>.sh}"
    # stable across requeues: resumes here; the recipe's name in it: two recipes sent through one
    # script never share (and resume) each other's checkpoints
    RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME:-megarl}-$(basename "$RECIPE" .yaml)}
    STAGING_DIR=${STAGING_DIR:-$RUN_DIR/weight_staging}   # weight_sync.transport=files only: shared by trainer and engine nodes
    MEGARL_PY=${MEGARL_PY:-$MEGARL_ROOT/.venv/bin/python}
    ENGINE_START_TIMEOUT=${ENGINE_START_TIMEOUT:-1800}   # seconds for every server to answer /health
    EXTRA=${EXTRA:-}                                   # more key=value overrides, space separated
    SRUN_EXTRA=${SRUN_EXTRA:-}                         # more srun options for every step (e.g. --cpu-bind=none)
    NODE_ADDRS=${NODE_ADDRS:-}                         # node=addr,... : the address each node is reached at
    REQUEUE_ON_TERM=${REQUEUE_ON_TERM:-1}              # 1: a job stopped by SIGTERM requeues itself
    STOP_TIMEOUT=${STOP_TIMEOUT:-60}                   # seconds between SIGTERM and SIGKILL for the servers
    DOCTOR=${DOCTOR:-1}                                # 1: `megarl doctor` on a trainer and an engine node first
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}   # megatron TP comm overlap
    # NCCL_CUMEM_ENABLE is left as the user has it: with vLLM >= 0.16 and NCCL >= 2.27, 0
    # breaks the weight group's communicator init (docs/cluster.md)
    : "${RECIPE:?set by slurm/ppo_<size>.sh}"
}

# The layout (megarl/plan/job.py): the recipe's cluster: section, sbatch's environment on top;
# sets TRAINER_NODES ENGINE_NODES GPUS_PER_NODE ENGINE_TP ENGINES_PER_NODE TRAINER_PROCS_PER_NODE
# JOB_NODES WEIGHT_TRANSPORT LAYOUT_OVERRIDES LAYOUT_NOTES and logs what replaced a recipe value
megarl_layout() {
    local layout note
    layout=$("$MEGARL_PY" -m megarl.plan.job_shell "$RECIPE" "$@") \
        || die "the job's layout (above): fix the recipe's cluster: section or the variable named" 2
    eval "$layout"
    log "layout (recipe's cluster: section): $TRAINER_NODES trainer node(s) x $TRAINER_PROCS_PER_NODE ranks," \
        "$ENGINE_NODES engine node(s) x $ENGINES_PER_NODE server(s) of ENGINE_TP=$ENGINE_TP, GPUS_PER_NODE=$GPUS_PER_NODE"
    for note in "${LAYOUT_NOTES[@]}"; do log "layout: $note"; done
}

# `megarl doctor` on the first trainer node and the first engine node, at once (srun options:
# "$@"): a missing feature stops the job before any server starts, its report in the job log
run_doctor() {
    local -a pids=()
    local kind node rc=0 pid
    for kind in trainer engine; do
        if [[ $kind == trainer ]]; then node=${TRAINER_NODE_LIST[0]}; else node=${ENGINE_NODE_LIST[0]}; fi
        srun --nodes=1 --ntasks=1 --nodelist="$node" "$@" "$MEGARL_PY" -m megarl.cli doctor \
            >"$JOB_LOG_DIR/doctor_$kind.txt" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    for kind in trainer engine; do log "doctor ($kind node): $(tail -n 1 "$JOB_LOG_DIR/doctor_$kind.txt")"; done
    ((rc == 0)) || die "megarl doctor found a problem on a node (above; $JOB_LOG_DIR/doctor_*.txt)" 2
}

megarl_job() {
    : "${SLURM_JOB_ID:?not inside a slurm job: submit with sbatch}"
    cd "$MEGARL_ROOT"
    if [[ ! -x $MEGARL_PY ]]; then
        if ((GPUS_PER_NODE > 0)); then   # `make venv` builds the CPU stack: GPU nodes need the gpu extra
            die "MEGARL_PY=$MEGARL_PY is not an executable python: with the GPU nodes' Python 3.12 run python3.12 -m venv .venv && .venv/bin/pip install -e '.[gpu]' (README: Install on GPU nodes), or set MEGARL_PY"
        fi
        die "MEGARL_PY=$MEGARL_PY is not an executable python (make venv: the CPU stack; or set MEGARL_PY)"
    fi
    [[ -f $RECIPE ]] || die "RECIPE=$RECIPE: no such file"
    RECIPE=$(realpath "$RECIPE")
    [[ $RUN_DIR == /* ]] || RUN_DIR="$MEGARL_ROOT/$RUN_DIR"
    [[ $STAGING_DIR == /* ]] || STAGING_DIR="$MEGARL_ROOT/$STAGING_DIR"
    local -a extra_args=()
    read -r -a extra_args <<<"$EXTRA"
    megarl_layout "${extra_args[@]}"

    local -a nodes=()
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    local need=$JOB_NODES
    ((${#nodes[@]} >= need)) || die "the job has ${#nodes[@]} nodes; the layout needs $need ($TRAINER_NODES trainer + $ENGINE_NODES engine): sbatch --nodes=$need, or change the recipe's cluster: section"
    ((${#nodes[@]} == need)) || log "layout: the job has ${#nodes[@]} nodes; the layout uses the first $need"
    TRAINER_NODE_LIST=("${nodes[@]:0:TRAINER_NODES}")
    ENGINE_NODE_LIST=("${nodes[@]:TRAINER_NODES:ENGINE_NODES}")
    MASTER_ADDR=$(node_addr "${TRAINER_NODE_LIST[0]}")

    local suffix=""
    ((${SLURM_RESTART_COUNT:-0} == 0)) || suffix="-restart$SLURM_RESTART_COUNT"
    JOB_LOG_DIR="$RUN_DIR/slurm-$SLURM_JOB_ID$suffix"
    mkdir -p "$JOB_LOG_DIR/engines" "$STAGING_DIR"
    MEGARL_ENGINE_API_KEY=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
    export MEGARL_ROOT MEGARL_PY MASTER_ADDR MASTER_PORT WEIGHT_PORT JOB_LOG_DIR MEGARL_ENGINE_API_KEY \
        TRAINER_NODES TRAINER_PROCS_PER_NODE GPUS_PER_NODE ENGINE_TP ENGINES_PER_NODE PORT_BASE

    ENGINE_URLS=()
    local -a addrs=() waits=()
    local node addr slot i
    for node in "${ENGINE_NODE_LIST[@]}"; do
        addr=$(node_addr "$node")
        addrs+=("$addr")
        for ((slot = 0; slot < ENGINES_PER_NODE; slot++)); do
            ENGINE_URLS+=("http://$addr:$((PORT_BASE + slot))")
            waits+=("http://$addr:$((PORT_BASE + slot))=$JOB_LOG_DIR/engines/engine_$((${#ENGINE_URLS[@]} - 1)).log")
        done
    done
    local urls
    urls=$(IFS=,; echo "${ENGINE_URLS[*]}")
    local -a overrides=()
    # the layout of this job (`megarl plan` checks it: memory per GPU) and the servers it starts
    overrides=("run.dir=$RUN_DIR" "${LAYOUT_OVERRIDES[@]}" "rollout.engines.mode=remote" "rollout.engines.urls=[$urls]"
               "rollout.engines.start_timeout_s=$ENGINE_START_TIMEOUT")
    if [[ $WEIGHT_TRANSPORT == files ]]; then
        overrides+=("weight_sync.staging_dir=$STAGING_DIR")
    else    # global rank 0 hosts the weight group; every engine worker connects to it
        overrides+=("weight_sync.master_addr=$MASTER_ADDR" "weight_sync.master_port=$WEIGHT_PORT")
    fi
    overrides+=("${extra_args[@]}")

    # the resolved config (the plan as comments); a bad recipe or override, or a plan that does
    # not fit the GPUs' memory, stops here, before any node is busy
    "$MEGARL_PY" -m megarl.cli plan --config "$RECIPE" "${overrides[@]}" >"$JOB_LOG_DIR/config.yaml" \
        || die "megarl plan rejected the recipe or the overrides (above)" 2
    write_job_info "$JOB_LOG_DIR" "${overrides[@]}"
    log "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: logs in $JOB_LOG_DIR; run dir $RUN_DIR"

    trap on_term TERM
    trap 'abort_job "interrupted" 130' INT HUP
    local -a gres=()
    ((GPUS_PER_NODE == 0)) || gres=("--gres=gpu:$GPUS_PER_NODE")
    local -a srun_args=()
    read -r -a srun_args <<<"$SRUN_EXTRA"
    local common="$MEGARL_ROOT/slurm/common.sh"
    ((DOCTOR == 0)) || run_doctor "${gres[@]}" "${srun_args[@]}"
    for i in "${!ENGINE_NODE_LIST[@]}"; do
        ENGINE_NODE_INDEX=$i ENGINE_ADDR=${addrs[$i]} srun --nodes=1 --ntasks="$ENGINES_PER_NODE" \
            --ntasks-per-node="$ENGINES_PER_NODE" --nodelist="${ENGINE_NODE_LIST[$i]}" \
            --kill-on-bad-exit=1 "${gres[@]}" "${srun_args[@]}" \
            bash "$common" engine_task "$RECIPE" "${overrides[@]}" &
        ENGINE_PIDS+=($!)
    done
    # the trainer starts while the servers load (it waits for them up to ENGINE_START_TIMEOUT)
    local trainer_nodes
    trainer_nodes=$(IFS=,; echo "${TRAINER_NODE_LIST[*]}")
    srun --nodes="$TRAINER_NODES" --ntasks="$TRAINER_NODES" --ntasks-per-node=1 \
        --nodelist="$trainer_nodes" --kill-on-bad-exit=1 "${gres[@]}" "${srun_args[@]}" \
        bash "$common" trainer_task "$RECIPE" "${overrides[@]}" >>"$JOB_LOG_DIR/trainer.log" 2>&1 &
    TRAINER_PID=$!
    log "trainer: $TRAINER_NODES node(s) x $TRAINER_PROCS_PER_NODE ranks, log $JOB_LOG_DIR/trainer.log"
    log "engines: ${ENGINE_URLS[*]} (logs $JOB_LOG_DIR/engines/)"

    # health: every server up before the deadline, or the job stops with the server's log tail
    local -a watch=()
    for i in "${ENGINE_PIDS[@]}"; do watch+=(--watch-pid "$i"); done
    "$MEGARL_PY" -m megarl.rollout.engines.serve wait --timeout "$ENGINE_START_TIMEOUT" \
        --watch-pid "$TRAINER_PID" "${watch[@]}" "${waits[@]}" &
    local waiter=$! rc=0
    while true; do     # wait again when a trapped SIGTERM interrupted the wait
        wait "$waiter" && rc=0 || rc=$?
        kill -0 "$waiter" 2>/dev/null || break
    done
    if ((rc != 0)) && kill -0 "$TRAINER_PID" 2>/dev/null; then
        kill -TERM "$waiter" 2>/dev/null || true
        abort_job "the engines did not come up (above); stopping the job" 1
    fi

    # supervise: engine steps may end (the trainer retires their engines and goes on, or stops
    # when none is left); the job ends with the trainer step
    local -a alive=()
    while kill -0 "$TRAINER_PID" 2>/dev/null; do
        wait -n 2>/dev/null || true
        alive=()
        for i in "${ENGINE_PIDS[@]}"; do
            if kill -0 "$i" 2>/dev/null; then
                alive+=("$i")
            else
                wait "$i" && rc=0 || rc=$?
                log "an engine step (srun pid $i) ended with code $rc; the trainer retires its engines"
            fi
        done
        ENGINE_PIDS=("${alive[@]}")
    done
    local trainer_rc=0
    wait "$TRAINER_PID" && trainer_rc=0 || trainer_rc=$?
    TRAINER_PID=""
    log "trainer exited with code $trainer_rc; stopping the engines"
    stop_steps "${ENGINE_PIDS[@]}"
    tail -n 5 "$JOB_LOG_DIR/trainer.log" || true

    if ((TERM_RECEIVED && trainer_rc == 0)) && [[ ${REQUEUE_ON_TERM} == 1 ]] \
        && grep -qE "stopping (after|before) step" "$JOB_LOG_DIR/trainer.log"; then
        log "stopped early on SIGTERM: requeueing job $SLURM_JOB_ID (it resumes from $RUN_DIR)"
        scontrol requeue "$SLURM_JOB_ID" || log "scontrol requeue failed: resubmit to resume"
    fi
    return "$trainer_rc"
}

# The batch shell of every per-size script: the shared settings, then the job
megarl_batch() {
    megarl_settings
    megarl_job
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then     # run, not sourced: one srun task
    case "${1:-}" in
        trainer_task | engine_task) "$@" ;;
        *) die "usage: bash slurm/common.sh trainer_task|engine_task RECIPE [key=value ...]" 2 ;;
    esac
fi
