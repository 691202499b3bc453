#!/usr/bin/env bash
# The GPU check: how a change is verified on a machine with an NVIDIA GPU and the project installed
# (`pip install -e '.[dev]'`, or from source with PYTHONPATH). In at most 8 minutes it runs every CUDA
# test (pytest -m cuda), then short runs on CUDA of `mdgan simulate` and `mdgan local` of every
# algorithm, MD-GAN crossing three swaps with checks on, with DP-SGD, with private feedback (no swaps),
# with the int8 wire and with --swap-lag,
# each `local` run held to its `simulate` twin bit for bit, and `mdgan audit` of a CUDA run.
# One line a check, a summary, exit 1 on any failure.
#
#   bash scripts/gpu_check.sh                 # MNIST under ../shared/data, or MDGAN_DATA_ROOT
#   MDGAN_GPU=cuda:1 bash scripts/gpu_check.sh
#
# Each check's output is kept in $MDGAN_GPU_CHECK_OUT (default: a new temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DEVICE=${MDGAN_GPU:-cuda}
DATA=${MDGAN_DATA_ROOT:-../shared/data}
OUT=${MDGAN_GPU_CHECK_OUT:-$(mktemp -d -t mdgan-gpu-check.XXXXXX)}
mkdir -p "$OUT"
started=$(date +%s)
passed=0
failed=0

say() { printf '%-6s %-52s %s\n' "$1" "$2" "$3"; }

# check NAME TIMEOUT COMMAND...: one line, PASS or FAIL with the last line the command printed.
check() {
  local name=$1 limit=$2; shift 2
  local log="$OUT/${name// /_}.log" t0 rc
  log=${log//,/}
  t0=$(date +%s%N)
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  local tenths=$(( ($(date +%s%N) - t0) / 100000000 ))
  local took="$((tenths / 10)).$((tenths % 10)) s"
  if [ $rc -eq 0 ]; then
    passed=$((passed + 1)); say PASS "$name" "$took"
  else
    failed=$((failed + 1))
    local why
    why=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)
    [ $rc -eq 124 ] && why="timed out after ${limit} s; $why"
    say FAIL "$name" "$took, exit $rc: $why (log: $log)"
  fi
  return $rc
}

# same NAME A B: the two runs' generators are the same bit for bit.
same() {
  local name=$1 a=$2 b=$3
  check "$name" 30 "$PY" -c '
import json, sys
a, b = (json.load(open(f"{d}/summary.json"))["generator_sha256"] for d in sys.argv[1:3])
print(f"local {a[:16]} simulate {b[:16]}")
sys.exit(a != b)' "$a" "$b"
}

MDGAN=("$PY" -m mdgan_app.cli)

card=$("$PY" -c "import torch; print(torch.cuda.get_device_name('$DEVICE'), 'torch', torch.__version__)" 2>/dev/null)
if [ -z "$card" ]; then
  say FAIL "a CUDA device" "torch sees no $DEVICE here"
  echo "gpu_check: 0 passed, 1 failed (no CUDA device)"
  exit 1
fi
echo "gpu_check on $card, $DEVICE; MNIST from $DATA; outputs in $OUT"

# 1. every CUDA test (tests marked `cuda`: CPU == CUDA for every algorithm and feature, local == simulate
#    on CUDA, the services with the server and the workers on different devices)
check "CUDA tests (pytest -m cuda)" 300 "$PY" -m pytest -q -m cuda -n 4 -p no:cacheprovider tests

# 2. short runs: MD-GAN with the CNN, 30 iterations, a swap every 10 (3 checked swaps; private feedback
# swaps nothing), scores every 10
common=(--device "$DEVICE" --data-root "$DATA" --no-progress --iterations 30 --eval-every 10
        --eval-samples 200 --seed 3)
swaps() { [ "$1" = mdgan-feedback ] || echo --swap-every 10; }
declare -A RUNS=(
  [mdgan-cnn]="--architecture cnn-mnist --workers 4 --kappa 2"
  [mdgan-dp]="--workers 4 --dp-noise-multiplier 1.0 --dp-fixed-noise 1"
  [mdgan-feedback]="--architecture cnn-mnist --workers 4 --dp-mechanism feedback --dp-discriminators 3 --dp-noise-multiplier 1.0 --dp-fixed-noise 1"
  [mdgan-int8]="--architecture cnn-mnist --workers 4 --wire-dtype int8 --aggregation median"
  [mdgan-swap-lag]="--architecture cnn-mnist --workers 4 --swap-lag 3"
  [flgan]="--algorithm flgan --workers 3"
  [pwgan]="--algorithm pwgan --workers 3"
  [psgan]="--algorithm psgan --workers 3"
  [standalone]="--algorithm standalone"
)
ORDER=(mdgan-cnn mdgan-dp mdgan-feedback mdgan-int8 mdgan-swap-lag flgan pwgan psgan standalone)
for run in "${ORDER[@]}"; do
  # shellcheck disable=SC2086
  check "simulate $run" 90 "${MDGAN[@]}" simulate ${RUNS[$run]} $(swaps "$run") "${common[@]}" --out "$OUT/simulate-$run" \
    $([ "$run" = mdgan-cnn ] && echo --save-discriminators)
done
for run in "${ORDER[@]}"; do
  [ "$run" = standalone ] && continue  # (no workers: it has no services)
  # shellcheck disable=SC2086
  if check "local $run" 120 "${MDGAN[@]}" local ${RUNS[$run]} $(swaps "$run") "${common[@]}" --out "$OUT/local-$run"; then
    same "local == simulate, $run" "$OUT/local-$run" "$OUT/simulate-$run"
  fi
done

# 3. the membership audit of a CUDA run (its discriminators saved by simulate)
check "audit simulate mdgan-cnn" 120 "${MDGAN[@]}" audit "$OUT/simulate-mdgan-cnn" --members 200 --nonmembers 200 \
  --generated 500

elapsed=$(( $(date +%s) - started ))
echo "gpu_check: $passed passed, $failed failed on $card in ${elapsed} s"
[ $failed -eq 0 ]
