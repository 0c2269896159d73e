# shellcheck shell=bash
# The Python environment of a job (slurm/common.sh sources this): the modules and the venv that slurm/site.sh names.

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
    # shellcheck disable=SC2153  # VENV is set by slurm/site.sh
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
