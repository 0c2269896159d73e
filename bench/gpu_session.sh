#!/usr/bin/env bash
# Every GPU check of the challenge (issues #5, #12) in one call of under 10 minutes, for a session that is
# lent one GPU for a few minutes. Each step has its own time limit and the whole script a deadline,
# so a slow step costs its own numbers, never the others'. Everything printed goes to
# $OUT/session.log (default runs/gpu_session/); copy the tables into docs/benchmarks.md.
#
#   mkdir -p .device_data && cp ../shared/data/cifar10-jpeg75.tar.gz ../shared/data/prepare_cifar10.py .device_data/
#   git rev-parse --short HEAD        # here: the commit to record (the GPU machine's copy may have no .git)
#   bash bench/gpu_session.sh 1a2b3c4   # there (device run, carry .device_data), with that commit
#
# Order = priority: the fast recipe to the criterion at the 2-GPU global batch (256 images per step),
# alone on the GPU, so its epoch times are a measurement; then it without the BatchNorm re-estimation,
# more seeds of it and the variants that tied with it in the 2026-12-01 sweep (bench/levers-next.txt,
# four at a time through bench/gpu_sweep.sh:
# accuracy only, their $OUT/sweep/ has its own session.log and logs.tar.gz), the data pipeline, and
# last the checks the first H200 session (2026-11-30) already made: the per-step ablation, 2 baseline
# epochs, the EMA host-sync check, torch.compile. The JSON logs of the runs made here go into
# $OUT/logs.tar.gz, refreshed after every step.
# DEADLINE (seconds, default 560) and DATA (default data) may be set in the environment.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-runs/gpu_session}
DATA=${DATA:-data}
DEADLINE=${DEADLINE:-560}
mkdir -p "$OUT"
LOGS=$(mktemp -d)   # the JSON logs, outside $OUT: the device returns 8 files at most
exec > >(tee "$OUT/session.log") 2>&1
export PYTHONUNBUFFERED=1

# step NAME LIMIT CMD...: run CMD with at most LIMIT seconds, and never past the deadline.
step() {
    local name=$1 limit=$2 left=$((DEADLINE - SECONDS))
    shift 2
    if ((left < 20)); then echo "=== $name: skipped, ${left}s left before the deadline"; return; fi
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit}s, t=${SECONDS}s): $*"
    timeout --kill-after=10 "$limit" "$@"
    echo "=== $name: exit $? after $((SECONDS))s in all"
    tar czf "$OUT/logs.tar.gz" -C "$LOGS" .   # after every step: whatever happens next, the logs come back
}

echo "commit: ${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}   date: $(date -u +%F)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'accelerate', accelerate.__version__)"

if [ ! -f "$DATA/cifar-10-batches-py/test_batch" ]; then
    step prepare_data 90 python3 .device_data/prepare_cifar10.py "$DATA"
fi

# One GPU with batch_size 256 sees the images of one step of 2 GPUs x 128 (fast.yaml); BatchNorm then
# sees 256 images, not 128 per GPU, the one difference.
FAST=(python3 bench/time_to_target.py --data-dir "$DATA" --num-gpus 1 --recipe fast --set batch_size=256)
step fast_to_target 120 "${FAST[@]}" --keep-log "$LOGS/fast.jsonl"
step lever_sweep 260 env OUT="$OUT/sweep" DATA="$DATA" DEADLINE=250 bash bench/gpu_sweep.sh "${1:-unknown}" \
    bench/levers-next.txt
step data_pipeline 30 python3 bench/data_pipeline.py --data-dir "$DATA" --device cuda --batches 190
step train_step 60 python3 bench/train_step.py --device cuda --ablation --steps 20 --warmup 5 --repeats 2
step baseline_2_epochs 100 python3 bench/time_to_target.py --data-dir "$DATA" --num-gpus 1 --recipe baseline \
    --epochs 2 --keep-log "$LOGS/baseline.jsonl"
# Does the EMA update synchronise with the host? (2026-11-30: yes, three times per update; docs/optimizations.md 7-12)
step ema_sync_check 30 python3 -c "
import torch; from cifar_wrn.model import WideResNet; from cifar_wrn.ema import build_ema
m = WideResNet().cuda(); e = build_ema(m, 0.99); e.update_parameters(m); torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode('warn'); [e.update_parameters(m) for _ in range(3)]; torch.cuda.synchronize()
print('EMA updates done; any host-sync warning above comes from them')"
step fast_compile 120 "${FAST[@]}" --keep-log "$LOGS/fast_compile.jsonl" --set compile=true
echo "=== done at t=${SECONDS}s"
