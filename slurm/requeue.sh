# shellcheck shell=bash
# Preemption and requeue (slurm/common.sh sources this), for the job scripts, whose #SBATCH lines ask
# for `--signal=B:USR1@120 --requeue`; raw_* (raw_ddp.py) first.
# SIGUSR1 to the batch shell (Slurm's warning 120 s before the time limit; at preemption too where
# the site sets PreemptParameters=send_user_signal; or `scancel --batch --signal=USR1 <job id>`)
# means "checkpoint and come back": the shell passes it on to the training, whose ranks agree at
# their next check (every few steps); rank 0 writes the checkpoint, the training exits with
# PREEMPTED_EXIT, and the script requeues the job, which runs again under the same job id and
# resumes from the checkpoint by itself (--auto-resume). Only a stop with its checkpoint requeues,
# and at most MAX_REQUEUES times a job (requeue_or_exit): a job that fails at every signal, or stops
# at every one without getting anywhere, cannot requeue forever. SIGTERM (scancel, the end of the
# job, a preemption without the user signal) is passed on as SIGUSR1 too, for a checkpoint if there
# is time, but the job is not requeued: a requeue there would undo a scancel. See docs/slurm.md,
# "Preemption and requeue".
#
# The accel_* scripts (accel_train.py under `accelerate launch`) call accel_preemption_setup
# and differ in two places, because SIGUSR1 must never reach an `accelerate launch` process (it
# kills the launcher and orphans its ranks; srun would pass it to every process of the step):
# (1) the stop is passed on through a file, STOP_FILE (runs/<job id>/stop-request): the shell
# writes "stop" into it, and on every node launch_stoppable, which runs `accelerate launch`
# there, reads it every second and sends its launcher SIGTERM (torchrun's agent passes that on to
# the ranks, which checkpoint and exit 75); (2) `accelerate launch` then exits 1 (143 from 1.16
# on), not 75. raw_multinode can lose the 75 too: once the first node's launcher has exited 75,
# srun's --kill-on-bad-exit=1 terminates the other nodes' tasks, which had saved and were exiting
# too, and srun reports a failure, 143 say. So a failure after a stop signal counts as status 75
# when the training wrote a checkpoint during this run: the file CHECKPOINT_FILE is another one
# after the training than before it (see checkpoint_identity). The script never reads the
# training's messages: their wording may change.

PREEMPTED_EXIT=75  # raw_ddp.py: "stopped by a signal, checkpoint written: run me again"
MAX_REQUEUES=${MAX_REQUEUES:-20}  # requeues of one job at most (SLURM_RESTART_COUNT); checked by preemption_setup
STOP_REQUESTS=0    # stop signals the batch shell has received
REQUEUE_WANTED=0   # 1 once one of them was SIGUSR1
STEP_PID=          # the training running in the background (python, or srun); "ended" after it
RESUME_ARGS=()     # the trainer's checkpoint arguments, set by preemption_setup
STOP_FILE=         # accel_* scripts: the file launch_stoppable watches on every node; empty: raw_*
CHECKPOINT_FILE=   # the file each new checkpoint replaces: checkpoint.pt (raw_*), LATEST (accel_*)

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

# preemption_setup: after job_setup. Sets CHECKPOINT_DIR, CHECKPOINT_FILE and RESUME_ARGS (the
# trainer's checkpoint arguments), and traps SIGUSR1 and SIGTERM. The checkpoint folder must survive
# the requeue and be visible from every node: runs/<job id>/ is (a requeued job keeps its id), $TMPDIR is not.
preemption_setup() {
    [[ $MAX_REQUEUES =~ ^[0-9]{1,6}$ ]] \
        || die "MAX_REQUEUES=$MAX_REQUEUES: a whole number (0 or more) of requeues, please"
    MAX_REQUEUES=$((10#$MAX_REQUEUES))  # 08 is 8, not a bad octal number
    CHECKPOINT_DIR=${CHECKPOINT_DIR:-$RUN_DIR/checkpoints}
    CHECKPOINT_FILE=$CHECKPOINT_DIR/checkpoint.pt
    # shellcheck disable=SC2034  # used by print_banner and the job scripts
    RESUME_ARGS=(--checkpoint-dir "$CHECKPOINT_DIR" --auto-resume)
    trap 'on_stop_signal USR1' USR1
    trap 'on_stop_signal TERM' TERM
}

# no_checkpoint_setup: preemption_setup for a SCRIPT that cannot checkpoint (course_*.sbatch; job.sh,
# script_setup). A stop signal is noted, never passed on (SIGUSR1 would end the training with nothing to come back
# to), and the job is not requeued; scancel's SIGTERM reaches the training from Slurm itself.
no_checkpoint_setup() {
    CHECKPOINT_DIR=
    trap 'no_checkpoint_signal USR1' USR1
    trap 'no_checkpoint_signal TERM' TERM
}

no_checkpoint_signal() {
    echo "=== $(date '+%F %T') job $JOB_ID: SIG$1 received; not passed on, no requeue: $SCRIPT cannot checkpoint" \
         "(its --help lists no --checkpoint-dir and --auto-resume)" | tee -a "$LOG"
}

# accel_preemption_setup: preemption_setup for the accel_* scripts; also sets STOP_FILE (to hand to
# launch_stoppable on every node) and resets it to "run" for this run. It lies in runs/<job id>/
# for the checkpoint folder's reasons: every node reads it, a requeue keeps it.
accel_preemption_setup() {
    STOP_FILE=$RUN_DIR/stop-request
    echo run > "$STOP_FILE" || die "cannot write $STOP_FILE"
    preemption_setup
    CHECKPOINT_FILE=$CHECKPOINT_DIR/LATEST  # names the newest state-<n>/ folder
}

# checkpoint_identity: which file CHECKPOINT_FILE is now (inode, size, modification time to the
# nanosecond), or "none". The trainers write each checkpoint into a new file and rename it over the
# old one once every rank has saved, so another identity means a whole checkpoint written since.
# The writer (rank 0) runs on this node, the first of the job, so even NFS shows the new file at once.
checkpoint_identity() {
    stat -L -c '%i %s %y' "$CHECKPOINT_FILE" 2>/dev/null || echo none
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
            sleep 1 || true  # scancel's SIGTERM kills the sleep too: not an error (set -e)
        fi
    done
    # No `wait` until COMMAND has ended: a trap that interrupts it can lose the status (run_preemptable)
    while kill -0 "$pid" 2>/dev/null; do sleep 0.5 || true; done
    wait "$pid" || status=$?
    trap - TERM USR1
    return "$status"
}

# run_preemptable COMMAND...: run the training with its output also in train.log, then requeue or
# exit; never returns. The training runs in the background and the shell looks every half second
# whether it still runs: bash runs a trap only once the foreground command has ended, so a training in
# the foreground would never hear of the signal. It does not `wait` for the training until it has
# ended: a trap that interrupts `wait` just as the training ends (the training heard scancel's SIGTERM
# itself) can lose the training's status, or leave the next `wait` blocked (seen with bash 5.2).
run_preemptable() {
    echo "+ $(quote_args "$@")" | tee -a "$LOG"
    local status=0 start=$SECONDS seen log_fd tee_pid before
    if (( STOP_REQUESTS > 0 )); then
        echo "=== job $JOB_ID: stopped before the training started" | tee -a "$LOG"
        requeue_or_exit "$PREEMPTED_EXIT"
    fi
    before=$(checkpoint_identity)
    # The output to the job's output file and train.log. The tee ignores SIGTERM: scancel (and the end
    # of the job) sends it to every process of the job, and a tee killed by it would lose the
    # training's last lines, and make srun or the launcher die of SIGPIPE. It ends when the training's
    # output closes (SIGKILL at the latest).
    exec {log_fd}> >(trap '' TERM; exec tee -a "$LOG")
    tee_pid=$!
    seen=$STOP_REQUESTS
    "$@" >&"$log_fd" 2>&1 &
    STEP_PID=$!
    if (( STOP_REQUESTS != seen )); then pass_stop_on || true; fi  # came in between
    # `|| true`: scancel's SIGTERM kills the sleep too, and `set -e` would end the script there.
    while kill -0 "$STEP_PID" 2>/dev/null; do sleep 0.5 || true; done
    wait "$STEP_PID" || status=$?  # ended: at once, with its status
    STEP_PID=ended
    exec {log_fd}>&-
    for _ in {1..100}; do  # up to 10 s for tee to write the last lines
        kill -0 "$tee_pid" 2>/dev/null || break
        sleep 0.1 || true
    done
    if (( status != 0 && status != PREEMPTED_EXIT && STOP_REQUESTS > 0 )) \
        && [[ $(checkpoint_identity) != "$before" ]]; then
        echo "=== $(basename "$1") exited $status after the stop signal, and this run wrote a new checkpoint" \
             "($CHECKPOINT_FILE): taken as status $PREEMPTED_EXIT, the status its ranks exit with" | tee -a "$LOG"
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

# requeue_or_exit STATUS: the end of a job script. After a SIGUSR1, a training that stopped with its
# checkpoint (status PREEMPTED_EXIT, which run_preemptable also gives a failure with a new checkpoint)
# is requeued unless the job has been MAX_REQUEUES times already (SLURM_RESTART_COUNT: Slurm's own
# requeues count too): `scontrol requeue`, then exit 0 (Slurm ends this run and queues the job again).
# A failure without a new checkpoint is not requeued: it would fail again at every signal. Anything
# not requeued exits with the training's status.
requeue_or_exit() {
    local status=$1 output restarts=${SLURM_RESTART_COUNT:-0} name=${SLURM_JOB_NAME:-job}
    local again="${SCRIPT:+SCRIPT=$SCRIPT }CHECKPOINT_DIR=$CHECKPOINT_DIR sbatch slurm/${name%.sbatch}.sbatch"
    if (( status == 0 )); then exit 0; fi
    if (( status != PREEMPTED_EXIT )); then
        if (( REQUEUE_WANTED == 1 )); then
            echo "=== not requeued: the training failed (exit status $status) after SIGUSR1 without writing a" \
                 "new checkpoint; only a stop with its checkpoint is requeued" | tee -a "$LOG"
        fi
        exit "$status"
    fi
    if (( REQUEUE_WANTED == 0 )); then
        if (( STOP_REQUESTS > 0 )); then
            echo "=== not requeued after SIGTERM (scancel, or the end of the job). To continue from the" \
                 "checkpoint: $again (a job that Slurm requeues itself resumes from there anyway)" | tee -a "$LOG"
        fi
        exit "$status"
    fi
    if [[ -z ${SLURM_JOB_ID:-} ]]; then
        echo "=== not under Slurm: to continue, run the same command again with CHECKPOINT_DIR=$CHECKPOINT_DIR" \
            | tee -a "$LOG"
        exit "$PREEMPTED_EXIT"
    fi
    if (( restarts >= MAX_REQUEUES )); then
        echo "=== not requeued: job $JOB_ID was requeued $restarts time(s) already, MAX_REQUEUES=$MAX_REQUEUES." \
             "To continue from the checkpoint: $again" | tee -a "$LOG"
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
        echo "If squeue does not show the job pending again, continue from the checkpoint in a new job: $again"
    } 2>&1 | tee -a "$LOG" >&2
    exit "$PREEMPTED_EXIT"
}
