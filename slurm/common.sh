# shellcheck shell=bash
# Shared steps of the job scripts in slurm/: sourced by them, and by the command each one runs on
# every node. Nothing here needs editing for a new site: see slurm/site.sh and the #SBATCH lines.
#
# Variables read from the environment (all optional), besides those in slurm/site.sh:
#   DEVICE         cuda (default) or cpu: cpu runs gloo processes on the CPU (tests, laptops)
#   GPUS_PER_NODE  processes per node (default: the script's GPU count)
#   RECIPE         recipe name or YAML path (default baseline)
#   EXTRA_ARGS     more arguments for the training script, split on spaces (no quoting)
#   SAVE_MODEL     1: also write the final weights to runs/<job id>/model.pt
#   MASTER_ADDR, MASTER_PORT   multi-node rendezvous (default: first host of the job, 10000 + job id % 20000)
#   DATA_DIR       where each node puts its copy of the data (default $TMPDIR/cifar10)
#   REPO_DIR       the repository (default: the folder sbatch was run from)
#   CHECKPOINT_DIR where the checkpoints go (default runs/<job id>/checkpoints)

CIFAR_FILES=(data_batch_1 data_batch_2 data_batch_3 data_batch_4 data_batch_5 test_batch)

die() {
    echo "error: $*" >&2
    exit 2
}

# Run a command with `set -u` off: module and activate scripts are not written for it.
without_nounset() {
    local status=0
    set +u
    "$@" || status=$?
    set -u
    return "$status"
}

setup_python() {
    if [[ -n $MODULES || $MODULE_RESET == 1 ]]; then
        if ! type module >/dev/null 2>&1; then
            local init
            for init in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh; do
                # shellcheck source=/dev/null
                if [[ -f $init ]]; then without_nounset source "$init"; break; fi
            done
        fi
        type module >/dev/null 2>&1 || die "MODULES='$MODULES' is set, but there is no \`module\` command here"
        if [[ $MODULE_RESET == 1 ]]; then without_nounset module reset; fi
        # shellcheck disable=SC2086  # MODULES is a space-separated list
        without_nounset module load $MODULES || die "module load $MODULES failed"
    fi
    local venv=$VENV
    if [[ $venv == auto ]]; then
        venv=
        if [[ -f $REPO_DIR/.venv/bin/activate ]]; then venv=$REPO_DIR/.venv; fi
    fi
    if [[ -n $venv ]]; then
        if [[ -f $venv/bin/activate ]]; then
            # shellcheck source=/dev/null
            without_nounset source "$venv/bin/activate"
        elif [[ -x $venv/bin/python ]]; then
            PATH=$venv/bin:$PATH
        else
            die "VENV=$venv has neither bin/activate nor bin/python (set VENV in slurm/site.sh)"
        fi
    fi
    command -v "$PYTHON" >/dev/null || die "'$PYTHON' is not on PATH: set MODULES and VENV in slurm/site.sh"
}

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

dataset_present() {
    local file
    for file in "${CIFAR_FILES[@]}"; do
        [[ -f $1/cifar-10-batches-py/$file ]] || return 1
    done
}

# set_data_dir: where this node's copy of the data goes (sets DATA_DIR): the node-local $TMPDIR.
set_data_dir() {
    DATA_DIR=${DATA_DIR:-${TMPDIR:-/tmp/${USER:-user}}/cifar10}
}

# stage_data: copy the dataset to this node's local scratch; sets DATA_DIR. Run once per node.
stage_data() {
    set_data_dir
    local where
    where="node ${SLURM_NODEID:-0} ($(hostname))"
    if dataset_present "$DATA_DIR"; then
        echo "$where: CIFAR-10 already in $DATA_DIR"
        return 0
    fi
    if [[ -n ${DATA_SRC:-} ]] && dataset_present "$DATA_SRC"; then
        local start=$SECONDS partial
        if ! mkdir -p "$DATA_DIR" || ! partial=$(mktemp -d "$DATA_DIR/.staging.XXXXXX"); then
            echo "error: $where: cannot write to $DATA_DIR" >&2
            return 1
        fi
        # Copy, then rename: another process never sees a half-copied folder.
        if ! cp -r "$DATA_SRC/cifar-10-batches-py" "$partial/"; then
            rm -rf "$partial"
            echo "error: $where: copying $DATA_SRC/cifar-10-batches-py to $DATA_DIR failed" >&2
            return 1
        fi
        mv -T "$partial/cifar-10-batches-py" "$DATA_DIR/cifar-10-batches-py" 2>/dev/null || true
        rm -rf "$partial"
        dataset_present "$DATA_DIR" || { echo "error: $where: staging into $DATA_DIR failed" >&2; return 1; }
        echo "$where: copied $DATA_SRC/cifar-10-batches-py to $DATA_DIR in $((SECONDS - start)) s"
    else
        echo "warning: $where: no CIFAR-10 in DATA_SRC='${DATA_SRC:-}' (expected cifar-10-batches-py/" \
             "data_batch_1..5 and test_batch there). Provide it once on a login node: extract the official" \
             "cifar-10-python.tar.gz into ${DATA_SRC:-data}, or copy a folder in that layout there, or let a" \
             "first run download it (CIFAR10_URL=<url> for a mirror). This job lets the trainer download it" \
             "into $DATA_DIR (needs internet)." >&2
        mkdir -p "$DATA_DIR"
    fi
}

# node_prepare: what the command srun starts on each node does before the trainer: say where it
# is, then stage the data into that node's own $TMPDIR.
node_prepare() {
    echo "node ${SLURM_NODEID:-?} of ${SLURM_NNODES:-?}: $(hostname) (${SLURMD_NODENAME:-?})," \
         "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"
    stage_data
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

# run_logged COMMAND...: run it with its output (stdout and stderr) also in train.log; return its status.
run_logged() {
    echo "+ $(quote_args "$@")" | tee -a "$LOG"
    local status=0 start=$SECONDS
    "$@" 2>&1 | tee -a "$LOG" || status=$?
    if (( status == 0 )); then
        echo "=== job $JOB_ID finished in $((SECONDS - start)) s; logs: $RUN_DIR/" | tee -a "$LOG"
    else
        echo "=== job $JOB_ID FAILED (exit status $status) after $((SECONDS - start)) s; logs: $RUN_DIR/" \
            | tee -a "$LOG"
    fi
    return "$status"
}

# ============================================================================ preemption and requeue
# For the job scripts, whose #SBATCH lines ask for `--signal=B:USR1@120 --requeue`; raw_* (raw_ddp.py) first.
# SIGUSR1 to the batch shell (Slurm's warning 120 s before the time limit; at preemption too where
# the site sets PreemptParameters=send_user_signal; or `scancel --batch --signal=USR1 <job id>`)
# means "checkpoint and come back": the shell passes it on to the training, whose ranks agree at
# their next check (every few steps); rank 0 writes the checkpoint, the training exits with
# PREEMPTED_EXIT, and the script requeues the job, which runs again under the same job id and
# resumes from the checkpoint by itself (--auto-resume). SIGTERM (scancel, the end of the job, a preemption without the user
# signal) is passed on as SIGUSR1 too, for a checkpoint if there is time, but the job is not
# requeued: a requeue there would undo a scancel. See docs/slurm.md, "Preemption and requeue".
#
# The accel_* scripts (accel_train.py under `accelerate launch`) call accel_preemption_setup
# and differ in two places, because SIGUSR1 must never reach an `accelerate launch` process (it
# kills the launcher and orphans its ranks; srun would pass it to every process of the step):
# (1) the stop is passed on through a file, STOP_FILE (runs/<job id>/stop-request): the shell
# writes "stop" into it, and on every node launch_stoppable, which runs `accelerate launch`
# there, reads it every second and sends its launcher SIGTERM (torchrun's agent passes that on to
# the ranks, which checkpoint and exit 75); (2) `accelerate launch` then exits 1 (143 from 1.16 on), not 75, so the
# shell takes the training's own line "stopped by a signal at epoch E, step S: checkpoint written
# to ..." in this run's output as the status 75. (raw_multinode needs that too: once the first
# node's launcher has exited 75, srun's --kill-on-bad-exit=1 terminates the other nodes' tasks,
# which had saved and were exiting too, and srun reports a failure, 143 say, instead of 75.)

PREEMPTED_EXIT=75  # raw_ddp.py: "stopped by a signal, checkpoint written: run me again"
STOP_REQUESTS=0    # stop signals the batch shell has received
REQUEUE_WANTED=0   # 1 once one of them was SIGUSR1
STEP_PID=          # the training running in the background (python, or srun); "ended" after it
RESUME_ARGS=()     # the trainer's checkpoint arguments, set by preemption_setup
STOP_FILE=         # accel_* scripts: the file launch_stoppable watches on every node; empty: raw_*
# the training's line for "stopped by a signal, checkpoint written", taken as status 75
STOPPED_LINE='stopped by a signal at epoch [0-9]+, step [0-9]+: checkpoint written to'

# pass_stop_on: tell the running training to checkpoint and stop; fails if it has ended already.
pass_stop_on() {
    if [[ -z $STOP_FILE ]]; then
        kill -USR1 "$STEP_PID" 2>/dev/null
    else
        kill -0 "$STEP_PID" 2>/dev/null || return 1
        echo stop > "$STOP_FILE" || echo "error: cannot write $STOP_FILE: the training was not told to stop" >&2
    fi
}

# on_stop_signal NAME: the trap. Only SIGUSR1 is passed on: srun answers SIGTERM by killing its
# tasks at once, and raw_ddp.py's launcher treats both alike. (accel_*: through STOP_FILE instead.)
on_stop_signal() {
    STOP_REQUESTS=$((STOP_REQUESTS + 1))
    if [[ $1 == USR1 ]]; then REQUEUE_WANTED=1; fi
    local what="the training will not be started"
    if [[ $STEP_PID == ended ]] || { [[ -n $STEP_PID ]] && ! pass_stop_on; }; then
        what="the training has ended already"
    elif [[ -n $STEP_PID && -n $STOP_FILE ]]; then
        what="passed on to the training through $STOP_FILE: within a second each node's accelerate launch gets"
        what+=" SIGTERM and passes it to its ranks, which write a checkpoint within a few steps and stop"
    elif [[ -n $STEP_PID ]]; then
        what="passed on to the training as SIGUSR1: it writes a checkpoint within a few steps and stops"
    fi
    echo "=== $(date '+%F %T') job $JOB_ID: SIG$1 received; $what" | tee -a "$LOG"
}

# preemption_setup: after job_setup. Sets CHECKPOINT_DIR and RESUME_ARGS (the trainer's checkpoint
# arguments), and traps SIGUSR1 and SIGTERM. The checkpoint folder must survive the requeue and be
# visible from every node: runs/<job id>/ is (a requeued job keeps its id), $TMPDIR is not.
preemption_setup() {
    CHECKPOINT_DIR=${CHECKPOINT_DIR:-$RUN_DIR/checkpoints}
    RESUME_ARGS=(--checkpoint-dir "$CHECKPOINT_DIR" --auto-resume)
    trap 'on_stop_signal USR1' USR1
    trap 'on_stop_signal TERM' TERM
}

# accel_preemption_setup: preemption_setup for the accel_* scripts; also sets STOP_FILE (to hand to
# launch_stoppable on every node) and resets it to "run" for this run. It lies in runs/<job id>/
# for the checkpoint folder's reasons: every node reads it, a requeue keeps it.
accel_preemption_setup() {
    STOP_FILE=$RUN_DIR/stop-request
    echo run > "$STOP_FILE" || die "cannot write $STOP_FILE"
    preemption_setup
}

# launch_stoppable STOP_FILE COMMAND...: the accel_* scripts run `accelerate launch` through this,
# on each node. It runs COMMAND in the background and, once STOP_FILE says "stop" (read every
# second; reading opens the file, so even NFS shows a fresh copy), or when this shell itself gets
# SIGTERM or SIGUSR1, sends COMMAND SIGTERM: the one signal `accelerate launch` passes on to its
# ranks. Returns COMMAND's status.
launch_stoppable() {
    local stop_file=$1 pid word status=0 stopped=0
    shift
    "$@" &
    pid=$!
    # shellcheck disable=SC2064  # $pid now, on purpose
    trap "kill -TERM $pid 2>/dev/null || true" TERM USR1
    while (( stopped == 0 )) && kill -0 "$pid" 2>/dev/null; do
        word=
        read -r word < "$stop_file" 2>/dev/null || true
        if [[ $word == stop ]]; then
            echo "node ${SLURM_NODEID:-0} ($(hostname)): stop requested: SIGTERM to accelerate launch (pid $pid)"
            kill -TERM "$pid" 2>/dev/null || true
            stopped=1
        else
            sleep 1
        fi
    done
    while true; do  # a trap interrupts `wait` (status > 128): wait again until COMMAND has ended
        status=0
        wait "$pid" || status=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    trap - TERM USR1
    return "$status"
}

# run_preemptable COMMAND...: run_logged for the training, then requeue or exit; never returns.
# The command runs in the background while the shell waits for it: bash runs a trap only once the
# foreground command has ended, so a training in the foreground would never hear of the signal.
run_preemptable() {
    echo "+ $(quote_args "$@")" | tee -a "$LOG"
    local status=0 start=$SECONDS seen log_fd tee_pid log_start
    log_start=$(wc -c < "$LOG" 2>/dev/null || echo 0)  # where this run's output starts in train.log
    if (( STOP_REQUESTS > 0 )); then
        echo "=== job $JOB_ID: stopped before the training started" | tee -a "$LOG"
        requeue_or_exit "$PREEMPTED_EXIT"
    fi
    # The output to the job's output file and train.log, as run_logged does. The tee ignores SIGTERM:
    # scancel (and the end of the job) sends it to every process of the job, and a tee killed by it
    # would lose the training's last lines (its "checkpoint written" line among them), and make srun
    # or the launcher die of SIGPIPE. It ends when the training's output closes (SIGKILL at the latest).
    exec {log_fd}> >(trap '' TERM; exec tee -a "$LOG")
    tee_pid=$!
    seen=$STOP_REQUESTS
    "$@" >&"$log_fd" 2>&1 &
    STEP_PID=$!
    if (( STOP_REQUESTS != seen )); then pass_stop_on || true; fi  # came in between
    while true; do
        seen=$STOP_REQUESTS
        status=0
        wait "$STEP_PID" || status=$?
        # A trap interrupts `wait` (status > 128) while the training goes on: wait again for its own status.
        if (( STOP_REQUESTS == seen )); then break; fi
    done
    STEP_PID=ended
    exec {log_fd}>&-
    for _ in {1..100}; do  # up to 10 s for tee to write the last lines
        kill -0 "$tee_pid" 2>/dev/null || break
        sleep 0.1
    done
    # `accelerate launch` fails (1, or 143) when its ranks exit 75, and srun reports a failure when
    # --kill-on-bad-exit ended a node that was exiting 75 after another: the training's line says
    # what happened.
    if (( status != 0 && status != PREEMPTED_EXIT )) \
        && tail -c +"$((log_start + 1))" "$LOG" | grep -E "$STOPPED_LINE" >/dev/null; then  # not -q: pipefail
        echo "=== the training stopped for the signal and wrote its checkpoint (its ranks exited" \
             "$PREEMPTED_EXIT; $(basename "$1") exited $status): taken as status $PREEMPTED_EXIT" | tee -a "$LOG"
        status=$PREEMPTED_EXIT
    fi
    if (( status == 0 )); then
        echo "=== job $JOB_ID finished in $((SECONDS - start)) s; logs: $RUN_DIR/" | tee -a "$LOG"
    elif (( status == PREEMPTED_EXIT )); then
        echo "=== job $JOB_ID stopped after $((SECONDS - start)) s with its checkpoint in $CHECKPOINT_DIR" \
            | tee -a "$LOG"
    else
        echo "=== job $JOB_ID FAILED (exit status $status) after $((SECONDS - start)) s; logs: $RUN_DIR/" \
            | tee -a "$LOG"
    fi
    requeue_or_exit "$status"
}

# requeue_or_exit STATUS: the end of a job script. After a SIGUSR1, a training that stopped (exit
# status PREEMPTED_EXIT, or any failure: a launcher the signal reached before it could handle it,
# say) is requeued: `scontrol requeue`, then exit 0 (Slurm ends this run and queues the job again).
# Anything else exits with the training's status.
requeue_or_exit() {
    local status=$1 output
    if (( status == 0 )); then exit 0; fi
    if (( REQUEUE_WANTED == 0 )); then
        if (( STOP_REQUESTS > 0 )); then
            echo "=== not requeued after SIGTERM (scancel, or the end of the job). To continue from the" \
                 "checkpoint: CHECKPOINT_DIR=$CHECKPOINT_DIR sbatch slurm/${SLURM_JOB_NAME%.sbatch}.sbatch" \
                 "(a job that Slurm requeues itself resumes from there anyway)" | tee -a "$LOG"
        fi
        exit "$status"
    fi
    if [[ -z ${SLURM_JOB_ID:-} ]]; then
        echo "=== not under Slurm: to continue, run the same command again with CHECKPOINT_DIR=$CHECKPOINT_DIR" \
            | tee -a "$LOG"
        exit "$PREEMPTED_EXIT"
    fi
    trap '' USR1 TERM  # nothing left to pass on; Slurm ends this run once the job is requeued
    if output=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
        echo "=== $(date '+%F %T') job $JOB_ID requeued (scontrol requeue): when it runs again it resumes" \
             "from $CHECKPOINT_DIR and appends to these logs" | tee -a "$LOG"
        exit 0
    fi
    {
        echo "error: scontrol requeue $SLURM_JOB_ID failed: $output"
        echo "If squeue does not show the job pending again, continue from the checkpoint in a new job:" \
             "CHECKPOINT_DIR=$CHECKPOINT_DIR sbatch slurm/${SLURM_JOB_NAME%.sbatch}.sbatch"
    } 2>&1 | tee -a "$LOG" >&2
    exit "$PREEMPTED_EXIT"
}
