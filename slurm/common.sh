# shellcheck shell=bash
# Shared steps of the job scripts in slurm/: sourced by them, and by the command each one runs on
# every node. Nothing here needs editing for a new site: see slurm/site.sh and the #SBATCH lines.
# The steps live in four files, one job each, all sourced here:
#   python_env.sh   the Python environment: modules, the venv (setup_python)
#   job.sh          the job's shape, run folder and banner (job_setup, set_master, print_banner)
#   data.sh         copying CIFAR-10 to each node's $TMPDIR (stage_data, node_prepare)
#   requeue.sh      preemption and requeue: stop signals, checkpoint, scontrol requeue (run_preemptable)
#
# Variables read from the environment (all optional), besides those in slurm/site.sh:
#   SCRIPT         course_*.sbatch: the training script to run (required), from the repository root
#   DEVICE         cuda (default) or cpu: cpu runs gloo processes on the CPU (tests, laptops)
#   GPUS_PER_NODE  processes per node (default: the script's GPU count)
#   RECIPE         recipe name or YAML path (default baseline)
#   EXTRA_ARGS     more arguments for the training script, split on spaces (no quoting)
#   SAVE_MODEL     1: also write the final weights to runs/<job id>/model.pt
#   MASTER_ADDR, MASTER_PORT   multi-node rendezvous (default: first host of the job, 10000 + job id % 20000)
#   DATA_DIR       where each node puts its copy of the data (default $TMPDIR/cifar10)
#   REPO_DIR       the repository (default: the folder sbatch was run from)
#   CHECKPOINT_DIR where the checkpoints go (default runs/<job id>/checkpoints)
#   MAX_REQUEUES   most requeues of one job after a stop signal (default 20; requeue.sh)

die() {
    echo "error: $*" >&2
    exit 2
}

# The folder of this file, wherever it is sourced from.
JOB_LIB=$(cd -- "$(dirname "${BASH_SOURCE[0]}")" >/dev/null && pwd)
# shellcheck source=slurm/python_env.sh
source "$JOB_LIB/python_env.sh"
# shellcheck source=slurm/job.sh
source "$JOB_LIB/job.sh"
# shellcheck source=slurm/data.sh
source "$JOB_LIB/data.sh"
# shellcheck source=slurm/requeue.sh
source "$JOB_LIB/requeue.sh"
