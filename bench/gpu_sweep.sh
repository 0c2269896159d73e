#!/usr/bin/env bash
# Whole 4-epoch runs of the fast recipe with one override set each, several at once on one GPU, for a
# session that is lent a GPU for a few minutes (which lever lifts epoch 3?).
#
#   bash bench/gpu_sweep.sh "$(git rev-parse --short HEAD)" bench/levers.txt DATA   # DATA: the data folder
#
# DATA (default data) must hold cifar-10-batches-py/ (README, "Getting the data").
#
# LEVERS_FILE: one run per line, its --set overrides as space-separated KEY=VALUE ("-" = fast.yaml as it
# is), '#' starts a comment; lines run in file order, PARALLEL (default 4) at a time, each pinned to its
# own slice of the CPU cores (raw_ddp.py sizes its threads from its affinity). Accuracy per epoch does
# not depend on the timing, so sharing the GPU costs only speed: the images/sec of such runs are not
# benchmarks. One GPU with batch_size 256 sees the images of one step of 2 GPUs x 128 (fast.yaml);
# BatchNorm then sees 256 images, not 128 per GPU, the one difference.
# A run still going at DEADLINE seconds (default 500) is stopped; $OUT/session.log ends with a table of
# every run's validation accuracy per epoch, and the JSON logs are in $OUT/logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
COMMIT=${1:-unknown}
LEVERS_FILE=${2:?usage: gpu_sweep.sh COMMIT LEVERS_FILE [DATA]}
DATA=${3:-data}
OUT=${OUT:-runs/gpu_sweep}
DEADLINE=${DEADLINE:-500}
PARALLEL=${PARALLEL:-4}
mkdir -p "$OUT"
LOGS=$(mktemp -d)   # outside $OUT: the device returns 8 files at most, so the logs come back as one tarball
exec > >(tee "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1

echo "commit: $COMMIT   date: $(date -u +%F)   parallel: $PARALLEL   deadline: ${DEADLINE}s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [ ! -f "$DATA/cifar-10-batches-py/test_batch" ]; then
    echo "error: no CIFAR-10 in $DATA/cifar-10-batches-py (README, \"Getting the data\")" >&2
    exit 2
fi

cores=$(nproc)
slice=$((cores / PARALLEL))
((slice < 1)) && slice=1
slots=()   # slots[i]: the run on cores i*slice .. (i+1)*slice-1
free_slot() {
    local i
    for ((i = 0; i < PARALLEL; i++)); do
        if [ -z "${slots[i]:-}" ] || ! kill -0 "${slots[i]}" 2>/dev/null; then echo "$i"; return; fi
    done
    echo -1
}
n=0
while IFS= read -r line; do
    read -ra words <<< "${line%%#*}"   # the line's KEY=VALUE words: comment and blanks dropped
    ((${#words[@]} == 0)) && continue
    setting="${words[*]}"
    while slot=$(free_slot); ((slot < 0)); do wait -n; done
    left=$((DEADLINE - SECONDS))
    if ((left < 90)); then echo "=== not started (${left}s left): $setting"; continue; fi
    sets=()
    [ "$setting" != "-" ] && for kv in "${words[@]}"; do sets+=(--set "$kv"); done
    name=$(printf '%02d_%s' "$n" "${setting// /_}")
    name=${name//=/-}
    first=$((slot * slice))
    echo "=== start $name at t=${SECONDS}s on cores $first-$((first + slice - 1))"
    (timeout --kill-after=10 "$left" taskset -c "$first-$((first + slice - 1))" \
        python3 bench/time_to_target.py --data-dir "$DATA" --num-gpus 1 --recipe fast --set batch_size=256 \
        "${sets[@]}" --keep-log "$LOGS/$name.jsonl" > "$LOGS/$name.out" 2>&1
     echo "=== end $name: exit $? at t=${SECONDS}s"
     tar czf "$OUT/logs.tar.gz" -C "$LOGS" .) &
    slots[slot]=$!
    n=$((n + 1))
    sleep 3   # staggered starts: each run picks a free port for its process group
done < "$LEVERS_FILE"
# not a bare `wait`: that would also wait for the tee of the exec above, which never ends
while (($(jobs -rp | wc -l) > 0)); do wait -n; done
tar czf "$OUT/logs.tar.gz" -C "$LOGS" .
echo "=== done at t=${SECONDS}s; validation accuracy per epoch (EMA, flip TTA as each recipe says):"
python3 - "$LOGS" <<'EOF'
import sys
from pathlib import Path
from cifar_wrn.runlog import read_log
for log in sorted(Path(sys.argv[1]).glob("*.jsonl")):
    try:
        _, epochs = read_log(log)
    except Exception as e:  # a run stopped at the deadline may have no complete record
        print(f"{log.stem:55s} unreadable: {e}")
        continue
    print(f"{log.stem:55s} " + " ".join(f"{e['val_accuracy']:.4f}" for e in epochs))
EOF
