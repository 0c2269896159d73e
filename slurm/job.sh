# shellcheck shell=bash
# The job's shape, run folder and banner (slurm/common.sh sources this).

# The job's hosts, one a line: from Slurm's node list, or this machine outside Slurm.
job_hosts() {
    if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
        scontrol show hostnames "$SLURM_JOB_NODELIST"
    else
        hostname
    fi
}

# job_setup NODES PROCESSES_PER_NODE: everything before the banner. Sets JOB_ID, HOSTS,
# JOB_WORLD_SIZE, RUN_DIR, LOG, EXTRA (array), SAVE_ARGS (array), DEVICE, RECIPE.
job_setup() {
    NUM_NODES=$1
    GPUS_PER_NODE=$2
    [[ $NUM_NODES =~ ^[1-9][0-9]*$ ]] || die "the number of nodes must be a positive integer (got '$NUM_NODES')"
    [[ $GPUS_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "GPUS_PER_NODE must be a positive integer (got '$GPUS_PER_NODE')"
    cd "$REPO_DIR" || die "cannot cd to REPO_DIR=$REPO_DIR"
    # shellcheck source=slurm/site.sh
    source "$REPO_DIR/slurm/site.sh"
    setup_python

    # Left over from a torchrun or accelerate environment, these would make the trainer think it
    # was started by torchrun.
    unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK ROLE_RANK
    export PYTHONUNBUFFERED=1  # log lines as they happen, not when a buffer fills
    # cuda:i in the trainer = GPU i in nvidia-smi and topology.txt (CUDA's own order may differ)
    export CUDA_DEVICE_ORDER=${CUDA_DEVICE_ORDER:-PCI_BUS_ID}

    JOB_ID=${SLURM_JOB_ID:-local-$(date +%Y%m%d-%H%M%S)-$$}
    mapfile -t HOSTS < <(job_hosts)
    (( ${#HOSTS[@]} >= NUM_NODES )) || die "the job has ${#HOSTS[@]} host(s) (${HOSTS[*]}), not $NUM_NODES"
    JOB_WORLD_SIZE=$((NUM_NODES * GPUS_PER_NODE))
    DEVICE=${DEVICE:-cuda}
    [[ $DEVICE == cuda || $DEVICE == cpu ]] || die "DEVICE must be cuda or cpu (got '$DEVICE')"
    RECIPE=${RECIPE:-baseline}
    # shellcheck disable=SC2034  # EXTRA and SAVE_ARGS are used by the job scripts
    read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

    RUN_DIR=$RUNS_DIR/$JOB_ID
    mkdir -p "$RUN_DIR" || die "cannot create the run folder $RUN_DIR (set RUNS_DIR in slurm/site.sh)"
    LOG=$RUN_DIR/train.log
    SAVE_ARGS=()
    # shellcheck disable=SC2034
    if [[ ${SAVE_MODEL:-0} == 1 ]]; then SAVE_ARGS=(--save "$RUN_DIR/model.pt"); fi
    # What the command on each node needs (srun passes the environment on).
    export REPO_DIR DATA_SRC JOB_ID RUN_DIR PYTHON ACCELERATE
}

# Multi-node rendezvous: node 0's host name, and a port derived from the job id, so that two jobs
# sharing a node do not pick the same port. Either can be given in the environment instead.
set_master() {
    MASTER_ADDR=${MASTER_ADDR:-${HOSTS[0]}}
    if [[ -z ${MASTER_PORT:-} ]]; then
        if [[ $JOB_ID =~ ^[0-9]+$ ]]; then MASTER_PORT=$((10000 + JOB_ID % 20000)); else MASTER_PORT=29500; fi
    fi
    export MASTER_ADDR MASTER_PORT
}

# check_script NAME: the course_* scripts' SCRIPT (NAME: the job script, for the message), before anything is
# made: set, and a file (a path from the repository root, or an absolute one).
check_script() {
    [[ -n ${SCRIPT:-} ]] || die "SCRIPT is not set: name your training script, e.g. SCRIPT=my_cifar10.py sbatch slurm/$1"
    [[ ( $SCRIPT == /* && -f $SCRIPT ) || ( $SCRIPT != /* && -f $REPO_DIR/$SCRIPT ) ]] \
        || die "SCRIPT=$SCRIPT: no such file (a path from the repository root, $REPO_DIR, or an absolute one)"
}

# script_setup: after job_setup, set_master and set_data_dir, for the course_* scripts. Sets SCRIPT_ARGS: the
# job's shape, and those of the job's other flags that SCRIPT's --help lists; a script that takes
# --checkpoint-dir and --auto-resume gets preemption_setup's (it is requeued), any other no_checkpoint_setup.
script_setup() {
    local script_help flag
    script_help=$("$PYTHON" "$SCRIPT" --help 2>&1) \
        || die "'$PYTHON $SCRIPT --help' failed, so the job cannot tell which flags it takes:" \
            "$(tail -n 1 <<< "$script_help")"
    takes() { [[ $script_help =~ (^|[^[:alnum:]-])$1([^[:alnum:]-]|$) ]]; }
    for flag in --num-nodes --node-id --num-gpus; do
        takes "$flag" || die "SCRIPT=$SCRIPT takes no $flag (its --help does not list it): the job starts it with" \
            "--num-nodes, --node-id and --num-gpus, as course/cifar10_ddp.py takes them"
    done
    SCRIPT_ARGS=(--num-nodes "$NUM_NODES" --node-id 0 --num-gpus "$GPUS_PER_NODE")
    if takes --master-addr; then SCRIPT_ARGS+=(--master-addr "$MASTER_ADDR"); fi
    if takes --master-port; then SCRIPT_ARGS+=(--master-port "$MASTER_PORT"); fi
    if takes --device; then SCRIPT_ARGS+=(--device "$DEVICE"); fi
    if takes --data-dir; then SCRIPT_ARGS+=(--data-dir "$DATA_DIR"); fi
    if takes --recipe; then SCRIPT_ARGS+=(--recipe "$RECIPE"); fi
    if takes --log-json; then SCRIPT_ARGS+=(--log-json "$RUN_DIR/log.jsonl"); fi
    if takes --checkpoint-dir && takes --auto-resume; then
        preemption_setup
        SCRIPT_ARGS+=("${RESUME_ARGS[@]}")
    else
        no_checkpoint_setup
    fi
}

# accel_setup: after job_setup, for the accelerate scripts. ACCEL_CONFIG must be set.
# ACCEL_ARGS (environment): more `accelerate launch` options, split on spaces, e.g. "--mixed_precision no".
accel_setup() {
    [[ -f $ACCEL_CONFIG ]] || die "accelerate config $ACCEL_CONFIG not found (set ACCEL_CONFIG)"
    command -v "$ACCELERATE" >/dev/null || die "'$ACCELERATE' is not on PATH: install accelerate in the job's Python environment"
    # shellcheck disable=SC2034  # used by the job scripts
    read -r -a ACCEL_ARGS <<< "${ACCEL_ARGS:-}"
    # A multi-GPU config with ACCELERATE_USE_CPU=1 is what starts several CPU processes (see
    # accelerate_configs/two_cpus.yaml); accel_train.py then trains on the CPU with gloo.
    if [[ $DEVICE == cpu ]]; then export ACCELERATE_USE_CPU=1; fi
}

show_topology() {
    echo "--- GPU topology of $(hostname) (nvidia-smi topo -m; NV# = NVLink, SYS/NODE/PHB/PIX = PCIe)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L || echo "nvidia-smi -L failed"
        nvidia-smi topo -m || echo "nvidia-smi topo -m failed"
    else
        echo "nvidia-smi is not on this machine: no GPU topology to show"
    fi
}

# print_banner WHAT: the job's shape, software and GPU topology, to the output and train.log.
print_banner() {
    {
        echo "=== $(date '+%F %T') job $JOB_ID (${SLURM_JOB_NAME:-not under Slurm}): $1"
        echo "hosts: ${HOSTS[*]:0:NUM_NODES}"
        echo "world size: $JOB_WORLD_SIZE = $NUM_NODES node(s) x $GPUS_PER_NODE process(es), device $DEVICE"
        if [[ -n ${MASTER_ADDR:-} ]]; then echo "rendezvous: $MASTER_ADDR:${MASTER_PORT:-}"; fi
        echo "slurm: partition ${SLURM_JOB_PARTITION:-?}, account ${SLURM_JOB_ACCOUNT:-?}," \
             "cpus per task ${SLURM_CPUS_PER_TASK:-?}, GPUs on node ${SLURM_GPUS_ON_NODE:-?}," \
             "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"
        if [[ -n ${SLURM_RESTART_COUNT:-} ]]; then
            echo "restart ${SLURM_RESTART_COUNT}: this job was requeued; it continues from its checkpoint"
        fi
        if (( ${#RESUME_ARGS[@]} > 0 )); then echo "checkpoints: $CHECKPOINT_DIR (a requeued run resumes from there)"; fi
        echo "repo: $REPO_DIR, git $(git -C "$REPO_DIR" describe --always --dirty 2>/dev/null || echo unknown)"
        echo "python: $(command -v "$PYTHON")"
        "$PYTHON" -c 'import torch
nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {torch.cuda.device_count()} GPU(s) visible")' \
            || echo "torch: cannot be imported by $PYTHON"
        echo "run folder: $RUN_DIR"
        show_topology | tee "$RUN_DIR/topology.txt"
    } 2>&1 | tee -a "$LOG"
}

# quote_args ARG...: the arguments as one line a shell reads back as the same words.
quote_args() {
    local arg words=() q="'"
    for arg in "$@"; do
        if [[ $arg =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
            words+=("$arg")
        else
            words+=("$q${arg//$q/$q\\$q$q}$q")
        fi
    done
    echo "${words[*]}"
}
