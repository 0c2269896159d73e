#!/usr/bin/env bash
# The project's GPU checks in one call of under 9 minutes on one GPU (an H100 or H200), for a session that
# is lent a GPU for 15 minutes in all (start-up and transfers included). Each step has its own time limit and the
# whole script a deadline, so a slow step costs its own numbers, never the others'. In order of priority:
#   1. fast_alone: recipes/fast.yaml to the criterion alone on the GPU (bench/time_to_target.py): seed 0 of the
#      ten seeds, and the only epoch times of this session that are a measurement (the time-to-target row);
#   2. sync_count: host synchronisations per training step of fast.yaml, by phase and source line
#      (bench/sync_count.py, torch.cuda.set_sync_debug_mode("warn")); the EMA's row should read 0 since
#      cifar_wrn/ema.py keeps its counter on the host, and the data row too since the epoch's indices go to the
#      GPU in one copy;
#   2b. startup: epoch 1 against epoch 2 with and without fast.yaml's start-up warm-up (bench/startup.py);
#   3. sweep: one bench/gpu_sweep.sh call, four runs at a time (accuracy only; sharing the GPU changes no
#      number but the times): fast.yaml at seeds 1-9 (bench/seeds.py --emit), then the epoch-3
#      candidates at seeds 0-1 (bench/levers-epoch3.txt), seed by seed; lines past the deadline are not started;
#   4. seeds_summary: bench/seeds_summary.py --group over every log: fast.yaml's ten seeds (the largest group,
#      the reference) per epoch with mean / min / max / std and the criterion count, then each lever apart.
# Time, estimated from the 2026-12-01 logs (docs/runs/h200-session-2026-11-30.log: data 12 s, a fast run alone
# 46-59 s with start-up; docs/runs/h200-sweep-2026-12-01/session-*.log: four at a time, 27 runs in 522 s, a run
# every ~19 s): data ~15 s, fast_alone ~60 s, sync_count ~30 s, startup ~70 s
# (two 2-epoch runs with start-up), then the sweep gets ~340 s: 9 seeds and the first 9 lines of the epoch-3
# candidates (18 runs, ~340 s; a run the safety net extends by an epoch adds ~3 s of GPU time).
#
#   git rev-parse --short HEAD        # here: the commit to record (the GPU machine's copy may have no .git)
#   bash bench/gpu_session.sh 1a2b3c4 DATA   # there (device run, timeout_s 600), with that commit and the data
#   folder (default data), which must hold cifar-10-batches-py/ (README, "Getting the data"): carry it along
#
# Everything printed goes to $OUT/session.log (default runs/gpu_session/). The JSON logs come back as
# $OUT/logs.tar.gz, refreshed after every step, its paths already under docs/runs/gpu-session-DATE/: unpack it in
# the repository root (tar xzf logs.tar.gz), then copy the tables into docs/benchmarks.md.
# DEADLINE (seconds, default 540) may be set in the environment.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-runs/gpu_session}
DATA=${2:-data}
DEADLINE=${DEADLINE:-540}
COMMIT=${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
STAGE=$(mktemp -d)   # outside $OUT: the device returns 8 files at most, so the logs come back as one tarball
RUN=docs/runs/gpu-session-$(date -u +%F)
mkdir -p "$STAGE/$RUN/sweep"
exec > >(tee "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1

pack() { tar czf "$OUT/logs.tar.gz" -C "$STAGE" docs; }

# step NAME LIMIT CMD...: run CMD with at most LIMIT seconds, and never past the deadline.
step() {
    local name=$1 limit=$2 left=$((DEADLINE - SECONDS))
    shift 2
    if ((left < 20)); then echo "=== $name: skipped, ${left}s left before the deadline"; return; fi
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit}s, t=${SECONDS}s): $*"
    timeout --kill-after=10 "$limit" "$@"
    echo "=== $name: exit $? after $((SECONDS))s in all"
    pack   # after every step: whatever happens next, the logs come back
}

echo "commit: $COMMIT   date: $(date -u +%F)   deadline: ${DEADLINE}s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

if [ ! -f "$DATA/cifar-10-batches-py/test_batch" ]; then
    echo "error: no CIFAR-10 in $DATA/cifar-10-batches-py (README, \"Getting the data\")" >&2
    exit 2
fi

# One GPU with batch_size 256 sees the images of one step of 2 GPUs x 128 (fast.yaml); BatchNorm then
# sees 256 images, not 128 per GPU, the one difference. Every run below uses it.
step fast_alone 100 python3 bench/time_to_target.py --data-dir "$DATA" --num-gpus 1 --recipe fast \
    --set batch_size=256 --keep-log "$STAGE/$RUN/fast-seed-0-alone.jsonl"
step sync_count 60 bash -c "set -o pipefail; python3 bench/sync_count.py --set batch_size=256 | tee '$STAGE/$RUN/sync_count.md'"
step startup 100 bash -c "set -o pipefail; python3 bench/startup.py --data-dir '$DATA' --num-gpus 1 --device cuda \
    --train-subset 50000 --rounds 1 --set batch_size=256 | tee '$STAGE/$RUN/startup.md'"

levers="$STAGE/levers.txt"
python3 bench/seeds.py --seeds 9 --first 1 --emit > "$levers"
cat bench/levers-epoch3.txt >> "$levers"   # the epoch-3 candidates
sweep_deadline=$((DEADLINE - SECONDS - 30))   # room for the summary and the last tarball
step sweep $((sweep_deadline + 20)) env OUT="$OUT/sweep" DEADLINE="$sweep_deadline" \
    bash bench/gpu_sweep.sh "$COMMIT" "$levers" "$DATA"
if [ -f "$OUT/sweep/logs.tar.gz" ]; then
    tar xzf "$OUT/sweep/logs.tar.gz" -C "$STAGE/$RUN/sweep" && rm -f "$STAGE/$RUN"/sweep/*.out
    cp "$OUT/sweep/session.log" "$STAGE/$RUN/sweep/session.log" 2>/dev/null
fi
pack
echo "=== seeds_summary (t=${SECONDS}s): fast.yaml's seeds first (the largest group), then each lever"
python3 bench/seeds_summary.py --group "$STAGE/$RUN" "$STAGE/$RUN/sweep" | tee "$STAGE/$RUN/seeds_summary.md"
pack
echo "=== done at t=${SECONDS}s; logs: $OUT/logs.tar.gz (unpack in the repository root: $RUN/)"
