# shellcheck shell=bash
# CIFAR-10 on each node's local scratch (slurm/common.sh sources this).

CIFAR_FILES=(data_batch_1 data_batch_2 data_batch_3 data_batch_4 data_batch_5 test_batch)

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
