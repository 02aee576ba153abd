#!/usr/bin/env bash
# The GPU check, in one command on a bare NVIDIA machine with Python 3.12 and torch (CUDA),
# and no network: see docs/gpu.md.
#
#   scripts/gpu_check.sh [--dry-run] [--generate | --generate-memory] [--out DIR]
#
# Installs .whl/*.whl (`make gpu-wheels`) into a folder of its own, keeps the machine's torch,
# runs (1) pytest -m gpu, (2) an out-of-memory storm against a real replica, (3) throughput
# against the in-process limit, and writes results.json, summary.md, check.log and logs.tar.gz
# to $OUT (default gpu-results/). Exits non-zero if any step failed. --dry-run runs every step
# on the CPU, at small sizes, with the CPU counterparts of the GPU parts and the Python
# environment already in use (no wheels). --generate runs, instead of those steps, a short
# `batchfit bench --generate` of batchfit against the in-process limit on the device: a call
# of its own, as the four steps fill one 10-minute call. --generate-memory runs, in a call of
# its own too, 64 streams twice, the second time with a process taking 30% of the device's
# memory a quarter of the way in (docs/gpu.md).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
DRY_RUN=0
GENERATE=0
OUT=${OUT:-gpu-results}
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --generate) GENERATE=1 ;;
        --generate-memory) GENERATE=memory ;;
        --out) OUT=$2; shift ;;
        *) echo "usage: $0 [--dry-run] [--generate | --generate-memory] [--out DIR]" >&2
           exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/batchfit-gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT  # every way out, the early ones included
exec > >(tee "$OUT/check.log") 2>&1
PYTHON=${PYTHON:-python3}
started=$(date +%s)

if [ "$DRY_RUN" = 1 ]; then
    DEVICE=cpu
    # Step time limits (seconds): generous on a shared CPU host.
    LIMITS=(240 300 300 120)
    GENERATE_LIMIT=360
else
    DEVICE=cuda
    # 9 min 40 s in all, plus the install: inside one 10-minute call to a lent machine. On an
    # H200 host the steps took 26, 65 and 102 s, and the workers step about 30 s a replica.
    # A step cut short keeps the runs it finished (each writes its figures after every run).
    LIMITS=(50 100 150 280)
    # Its own call: the limit's and the replica's start-ups, 2 levels and 3 joins.
    GENERATE_LIMIT=480
    shopt -s nullglob
    wheels=("$ROOT"/.whl/*.whl)
    if [ ${#wheels[@]} = 0 ]; then
        echo "no wheels in $ROOT/.whl: run 'make gpu-wheels' where there is a network" >&2
        exit 2
    fi
    SITE="$WORK/site"
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
        --target "$SITE" "${wheels[@]}" || { echo "wheel install failed" >&2; exit 2; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
cd "$ROOT" || exit 2
echo "gpu check: device $DEVICE, out $OUT, work $WORK"
"$PYTHON" -m scripts.gpu_check machine --device "$DEVICE" --work "$WORK" || exit 2

step() {  # name, time limit, command...
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "=== step $name (at most ${limit}s)"
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    echo "=== step $name: exit $rc after $(($(date +%s) - t0))s"
    STATUS+=("$name=$rc")
}
STATUS=()
if [ "$GENERATE" = 1 ]; then
    step generate "$GENERATE_LIMIT" \
        "$PYTHON" -m scripts.gpu_check generate --device "$DEVICE" --work "$WORK"
elif [ "$GENERATE" = memory ]; then
    step generate-memory "$GENERATE_LIMIT" \
        "$PYTHON" -m scripts.gpu_check generate-memory --device "$DEVICE" --work "$WORK"
else
    step tests "${LIMITS[0]}" env BATCHFIT_GPU_CHECK_DEVICE=$DEVICE BATCHFIT_GPU_CHECK_OUT="$WORK" \
        "$PYTHON" -m pytest tests/gpu -m gpu -q -p no:cacheprovider --timeout "${LIMITS[0]}" \
        -W ignore::pytest.PytestConfigWarning
    step storm "${LIMITS[1]}" "$PYTHON" -m scripts.gpu_check storm --device "$DEVICE" --work "$WORK"
    step throughput "${LIMITS[2]}" \
        "$PYTHON" -m scripts.gpu_check throughput --device "$DEVICE" --work "$WORK"
    step workers "${LIMITS[3]}" \
        "$PYTHON" -m scripts.gpu_check workers --device "$DEVICE" --work "$WORK"
fi

dry=()
[ "$DRY_RUN" = 1 ] && dry=(--dry-run)
"$PYTHON" -m scripts.gpu_check summary --device "$DEVICE" --work "$WORK" --out "$OUT" \
    "${dry[@]}" --status "${STATUS[@]}"
rc=$?
[ -d "$WORK/generate" ] && cp -r "$WORK/generate" "$WORK/logs/" 2>/dev/null
[ -d "$WORK/logs" ] && tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs
echo "gpu check: $([ $rc = 0 ] && echo passed || echo FAILED) in $(($(date +%s) - started))s;" \
    "figures in $OUT/results.json and $OUT/summary.md"
exit $rc
