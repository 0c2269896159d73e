# shellcheck shell=bash
# ============================================================================ SITE SETTINGS
# The site-specific runtime settings of every job script in slurm/, in one place. Edit the
# defaults below for your account, or override any of them from the environment when you submit:
# sbatch passes your environment to the job, e.g.
#
#     VENV=$HOME/envs/ddp DATA_SRC=/projects/myalloc/cifar sbatch slurm/raw_2gpu.sbatch
#
# The #SBATCH lines (account, partition, time, GPUs) cannot live here: sbatch reads them from the
# top of each script before any code runs. Edit them there, or override them on the command line
# (`sbatch --account=myalloc --time=1:00:00 slurm/raw_2gpu.sbatch`) or with SBATCH_ACCOUNT etc.
# `VAR=${VAR-default}` keeps a value given in the environment, even an empty one.

# Modules to load first, space-separated (`module load $MODULES`); empty: load none. The default is Falcon's
# supported PyTorch (Python and CUDA come with it); `module spider PyTorch` lists the others.
MODULES=${MODULES-PyTorch/2.7.1-foss-2024a-CUDA-12.6.0}
# `module reset` before loading (ARC's advice for job scripts): 1 or 0.
MODULE_RESET=${MODULE_RESET-0}
# The Python environment with the project (and accelerate for accel_*.sbatch): a venv or conda env folder
# (activated via bin/activate, or its bin/ put first on PATH). "auto": $REPO_DIR/.venv when it
# exists, else whatever `python` is on PATH after the modules. Empty: do nothing. docs/slurm.md's one-time
# setup makes .venv on top of the module (--system-site-packages: torch stays the module's).
VENV=${VENV-auto}
# The Python interpreter and the accelerate command, after the above.
PYTHON=${PYTHON-python}
ACCELERATE=${ACCELERATE-accelerate}

# Where CIFAR-10 lives on shared storage: a folder holding cifar-10-batches-py/ (data_batch_1..5,
# test_batch). Each job copies it to the node-local $TMPDIR first. Provide it once on a login node:
#     tar -xzf cifar-10-python.tar.gz -C "$DATA_SRC"      (the official archive), or
#     cifar-wrn-data download "$DATA_SRC"      (download, then check; CIFAR10_URL=<url> for a mirror of
#     the archive; `cifar-wrn-data check "$DATA_SRC"` checks a copy you made)
# Empty or missing: the trainer downloads into $TMPDIR on each node (needs internet there).
DATA_SRC=${DATA_SRC-$REPO_DIR/data}
# Where each job writes its folder runs/<job id>/ (must be on storage that every node can reach).
RUNS_DIR=${RUNS_DIR-$REPO_DIR/runs}
# ============================================================================ END OF SITE SETTINGS
