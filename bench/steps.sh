# shellcheck shell=bash
# What bench/gpu_session.sh and bench/gpu_speed.sh share (sourced, not run): a session's steps, each under its own
# time limit and never past the session's DEADLINE (seconds since the script started), and the tarball of the logs
# under $STAGE/docs, $OUT/logs.tar.gz, refreshed after every step.

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
