#!/usr/bin/env bash
# Where the time of an epoch of fast.yaml goes: one call of at most 5 minutes on one GPU (an H100 or H200). Each
# step has its own time limit and the whole script a deadline, so a slow step costs its own numbers only:
#   1. info: the GPU, the driver, torch, CUDA and cuDNN;
#   2. fast: fast.yaml as shipped to the criterion (bench/gpu_speed.py fast): per epoch its training steps, the
#      BatchNorm re-estimation and the rest, achieved TFLOP/s and the share of the GPU's bf16 peak (FLOPs per image
#      from FlopCounterMode), validation accuracy with and without flip TTA on the same weights, the cuDNN flag and
#      the frames torch.compile compiled inside the clock; this run is the only cold start;
#   3. kernels: torch.profiler over 10 training steps: top kernels, convolution against BatchNorm, elementwise and
#      foreach shares (bench/gpu_speed.py kernels);
#   4. ab: REPEATS (default 3) interleaved rounds of fast.yaml as shipped and each line of LEVERS, 2 epochs a run:
#      each lever's median epoch time and spread against fast.yaml's (bench/gpu_speed.py ab).
# Time, estimated (no GPU has run it yet): info 5 s, fast ~35 s, kernels ~15 s, ab ~11 s a run (~150 s a round of
# 13, each torch.compile line's first run ~60 s more): all levers do not fit one call's 5 minutes; split them with
# ONLY (below), e.g. ONLY='compile' in one call and ONLY='^[^t]' in another. A run that would end past the
# deadline is not started, and the table says how many ran of each.
#
#   git rev-parse --short HEAD     # here: the commit to record (the GPU machine's copy may have no .git)
#   bash bench/gpu_speed.sh 1a2b3c4 DATA    # there (device run, timeout_s 330), with the data folder (default data)
#   bash bench/gpu_speed.sh --dry-run       # every step at tiny size on the CPU, synthetic data: a few minutes
#
# Everything printed goes to $OUT/session.log (default runs/gpu_speed/). The tables (fast.md, kernels.md, ab.md),
# the JSON logs and the session log come back as $OUT/logs.tar.gz, refreshed after every step, its paths already
# under docs/runs/DATE-gpu-speed/: unpack it in the
# repository root (tar xzf logs.tar.gz). DEADLINE (seconds, default 285) and REPEATS may be set in the environment,
# and ONLY, a grep -E pattern of the LEVERS names to run (default all): more levers than a call's minutes hold are
# split over two calls (ONLY='compile|EMA', then the others), each against its own fast.yaml runs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # cifar_wrn and raw_ddp from this checkout, installed or not

# The levers, each against fast.yaml as shipped: 'NAME|raw_ddp.py flags'. The slowest last: the deadline cuts it.
LEVERS=(
    "cudnn_benchmark off|--set cudnn_benchmark=false"
    "channels_last off|--set channels_last=false"
    "EMA off|--set ema_decay=0"
    "no BatchNorm re-estimation|--set bn_recalibration=0"
    "no start-up warm-up|--set startup_steps=0"
    "DDP broadcast_buffers off|--set ddp_broadcast_buffers=false"
    "DDP buckets of 100 MB|--set ddp_bucket_cap_mb=100"
    "EMA every 5 steps|--set ema_every=5"
    "batch indices before the clock|--set prefetch_indices=true"
    "torch.compile|--set compile=true"
    "torch.compile max-autotune-no-cudagraphs|--set compile=true --set compile_mode=max-autotune-no-cudagraphs"
    "torch.compile + compiled step|--set compile=true --set compile_optimizer=true"
)

if [ "${1:-}" = --dry-run ]; then
    DRY=1 COMMIT=dry-run DATA=$(mktemp -d)
    SIZE=(--device cpu --model-width 4 --train-subset 160 --val-subset 101 --batch-size 16
          --set eval_batch_size=101 --set bn_recalibration=64)
    # one core, so one thread (raw_ddp.py sizes its threads from its affinity): a tiny model's threads, on a
    # loaded machine, wait on each other many times longer than they compute
    PIN=(taskset -c "$(python3 -c 'import os; print(min(os.sched_getaffinity(0)))')")
    OUT=${OUT:-runs/gpu_speed_dry}
else
    DRY=0 COMMIT=${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} DATA=${2:-data}
    SIZE=(--set batch_size=256)   # one GPU at 256 sees one step of 2 GPUs x 128; BatchNorm then sees 256 images
    PIN=() PROFILE=()
    OUT=${OUT:-runs/gpu_speed}
fi
DEADLINE=${DEADLINE:-285}
REPEATS=${REPEATS:-3}
mkdir -p "$OUT"
STAGE=$(mktemp -d)   # outside $OUT: the device returns a few files, so the logs come back as one tarball
RUN=docs/runs/$(date -u +%F)-gpu-speed
mkdir -p "$STAGE/$RUN"
exec > >(tee "$OUT/session.log") 2>&1

# shellcheck source=bench/steps.sh
source bench/steps.sh   # step NAME LIMIT CMD..., pack

echo "commit: $COMMIT   date: $(date -u +%F)   deadline: ${DEADLINE}s   repeats: $REPEATS   dry run: $DRY"
if ((DRY)); then
    python3 bench/gpu_speed.py synthetic "$DATA" || exit 1
    PROFILE=(--profile-steps 3 4)
elif [ ! -f "$DATA/cifar-10-batches-py/test_batch" ]; then
    echo "error: no CIFAR-10 in $DATA/cifar-10-batches-py (README, \"The data\")" >&2
    exit 2
fi
step info 20 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true;
    python3 -c \"import torch; v = torch.backends.cudnn.version(); print('torch', torch.__version__, 'cuda',
    torch.version.cuda, 'cudnn', v)\""
step fast 60 "${PIN[@]}" python3 bench/gpu_speed.py fast --data-dir "$DATA" "${SIZE[@]}" --out "$STAGE/$RUN"
step kernels 40 "${PIN[@]}" python3 bench/gpu_speed.py kernels --data-dir "$DATA" "${SIZE[@]}" "${PROFILE[@]}" \
    --out "$STAGE/$RUN"
levers=()
for lever in "${LEVERS[@]}"; do
    grep -qE -- "${ONLY:-.}" <<< "${lever%%|*}" && levers+=(--lever "$lever")
done
ab_deadline=$((DEADLINE - SECONDS - 15))   # room for the table and the last tarball
step ab $((ab_deadline + 10)) "${PIN[@]}" python3 bench/gpu_speed.py ab --data-dir "$DATA" "${SIZE[@]}" \
    --out "$STAGE/$RUN" --repeats "$REPEATS" --deadline "$ab_deadline" "${levers[@]}"
cp "$OUT/session.log" "$STAGE/$RUN/session.log"
pack
((DRY)) && rm -rf "$DATA"
echo "=== done at t=${SECONDS}s; logs: $OUT/logs.tar.gz (unpack in the repository root: $RUN/)"
