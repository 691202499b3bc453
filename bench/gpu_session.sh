#!/usr/bin/env bash
# What a GPU loan is spent on, as commands of at most 10 minutes each. Every step prints as it goes and writes its
# output to a file; after every step all of them are packed again into ONE archive at the top of $OUT
# ($OUT/gpu-session-<command>.tar.gz), so a command the device tool cuts off still brings back what it had done.
#   checks [SECONDS=270]: the CUDA tests, a line a test as each ends (pytest -m cuda -v, each test at most 60 s);
#           bench/gpu.py --eager at N = 10 and 50, a row and each run's generator hash as each run is timed (at one
#           N the CUDA simulate, local and eager runs must have the same hash); one P-WGAN divergence, traced
#           tensor by tensor (bench/gpu_divergence.py --trace)
#   figure3 SECONDS: Figure 3 with the CNN to 5,000 iterations (experiments/figure3-mnist-cnn-5k.yaml), its runs
#           sharing the card, grown loan by loan: the runs kept in docs/results/figure3-mnist-cnn-5k (committed after
#           earlier loans) are not run again; of the others, those expected to end within the SECONDS given (what is
#           left of the loan) start (mdgan experiment --time-limit), the rest wait for the next loan. The kept
#           folder, now with this loan's runs and a line in its loans.txt, is in the archive: `bash
#           bench/gpu_keep.sh ARCHIVE` puts it back in docs/results/ to be committed. (A run is kept whole or not
#           at all: the state a checkpoint holds, 30 to 313 MB a run, cannot travel with a loan; bench/loan_state.py)
#
#   OUT=/tmp/out bash bench/gpu_session.sh checks            # then: OUT=/tmp/out bash bench/gpu_session.sh figure3 300
#   MDGAN_GPU=cpu OUT=/tmp/out bash bench/gpu_session.sh checks   # a dry run on this CPU, tiny (tests/test_gpu_session.py)
#   (a dry run's figure3 starts from MDGAN_FIGURE_KEPT when set, a folder of its own tiny runs, else from nothing)
#
# From the project's root, after the line ../shared/tools/gpu_prepare.sh prints (MDGAN_DATA_ROOT set).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the outputs}
what=${1:-}
case "$what" in
  checks) budget=${2:-270} ;;
  figure3) budget=${2:?figure3 needs the seconds it may take (what is left of the loan)} ;;
  *) echo "usage: OUT=DIR bash bench/gpu_session.sh checks [SECONDS] | figure3 SECONDS" >&2; exit 2 ;;
esac
[[ "$budget" =~ ^[0-9]+$ ]] || { echo "gpu_session: SECONDS must be a whole number, got $budget" >&2; exit 2; }
started=$(date +%s)
PY=${PYTHON:-python3}
device=cuda
dry=${MDGAN_GPU:-}
[ "$dry" = cpu ] && device=cpu
mkdir -p "$OUT"
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-session.XXXXXX")
trap 'rm -rf "$work"' EXIT
records=$work/gpu-session/$what
mkdir -p "$records"
archive=$OUT/gpu-session-$what.tar.gz
ARCHIVE_S=15  # kept for the last packing
EXIT_RUNS_LEFT=3  # mdgan experiment --time-limit: it ended in time with runs left (mdgan_app/cli.py)
STOP_S=20  # the experiment's own time limit ends this much before its step's: its runs stopped, its records kept

left() { echo $(( budget - ($(date +%s) - started) )); }

BACK_FILE_BYTES=16777216  # the device tool brings back no file over 16 MiB (docs/GPU.md)
pack() {  # all the records so far, into the one archive (written beside, then renamed: never half an archive)
  tar -czf "$archive.part" -C "$work" gpu-session && mv "$archive.part" "$archive"
  local size; size=$(stat -c %s "$archive")
  (( size > BACK_FILE_BYTES )) && echo "gpu_session: WARNING: $archive is $size bytes, over the $BACK_FILE_BYTES a file that comes back"
  return 0
}

# step NAME LIMIT COMMAND...: at most LIMIT seconds (never past the budget less the packing), printed as it goes and
# kept in NAME.txt; one line in steps.txt and on the terminal says how it ended
step() {
  local name=$1 limit=$2; shift 2
  local room=$(( $(left) - ARCHIVE_S ))
  (( room < limit )) && limit=$room
  if (( limit < 10 )); then echo "skip $name (no time left)" | tee -a "$records/steps.txt"; pack; return; fi
  echo "start $name (limit $limit s)"
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$records/$name.txt"
  local rc=${PIPESTATUS[0]}
  local said="done"
  (( rc == 124 || rc == 137 )) && said="CUT OFF at its limit"
  (( rc == EXIT_RUNS_LEFT )) && said="done, runs left for the next loan,"
  (( rc != 0 && rc != 124 && rc != 137 && rc != EXIT_RUNS_LEFT )) && said="FAILED (exit $rc)"
  echo "$said $name in $(( $(date +%s) - t0 )) s (limit $limit s)" | tee -a "$records/steps.txt"
  pack
}

"$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device (MDGAN_GPU=cpu: a dry run)', 'torch', torch.__version__)" \
  | tee "$records/card.txt"
git log -1 --format='commit %H %s' > "$records/commit.txt" 2>/dev/null || true
pack

if [ "$what" = figure3 ]; then
  config=$records/figure3-mnist-cnn-5k.yaml  # (the data where gpu_prepare.sh's line put it)
  sed "s#^base_from: #base_from: $PWD/experiments/#; s#^out: .*#out: $work/figure3-runs#
       s#^base: {#base: {data_root: ${MDGAN_DATA_ROOT:-$PWD/../shared/data}, #" experiments/figure3-mnist-cnn-5k.yaml \
    > "$config"
  committed=${MDGAN_FIGURE_KEPT:-docs/results/figure3-mnist-cnn-5k}
  if [ -n "$dry" ]; then  # a few iterations, unscored: what comes back, not what it measures
    sed -i 's#^base: {\(.*\)iterations: 5000, eval_every: 500}#base: {\1iterations: 2, eval_every: -1}#' "$config"
    committed=${MDGAN_FIGURE_KEPT:-}  # (the committed runs are the real figure's, not a dry run's)
  fi
  kept=$records/figure3-mnist-cnn-5k
  if [ -n "$committed" ] && [ -d "$committed" ]; then
    cp -R "$committed" "$kept"
    echo "figure3: $(find "$kept/runs" -name summary.json 2>/dev/null | wc -l) runs kept by earlier loans ($committed)"
  fi
  mkdir -p "$kept"
  limit=$(( $(left) - ARCHIVE_S ))
  step figure3 "$limit" "$PY" -m mdgan_app.cli experiment "$config" --device "$device" --jobs 5 --no-progress \
    --probe 10 --keep "$kept" --time-limit "$(( limit > 2 * STOP_S ? limit - STOP_S : limit / 2 ))"
  echo "$(date -u +%Y-%m-%dT%H:%MZ) $(head -c 120 "$records/card.txt") $(cut -d' ' -f2 "$records/commit.txt" | cut -c1-10): $(tail -n 1 \
    "$records/steps.txt"); $(find "$kept/runs" -name summary.json 2>/dev/null | wc -l) runs kept" >> "$kept/loans.txt"
  pack
  echo "gpu_session: $(( $(date +%s) - started )) s; $archive"
  exit 0
fi

tests=(tests) timeout_flag=() processes=8 tests_s=150 bench_s=80 divergence_s=40  # 270 s with the packing
"$PY" -c "import pytest_timeout" 2>/dev/null && timeout_flag=(--timeout 60)
bench=(--eager --workers 10 50 --cpu-iterations 4 --gpu-iterations 40)
pwgan=(--algorithm pwgan --workers 3 --iterations 8 --batch-size 10 --disc-steps 2 --potential-rounds 3
       --potential-lr 0.5 --seed 4 --dataset synthetic --device "$device" --gradient-penalty 5)
if [ -n "$dry" ]; then  # the same steps, tiny: one test file, N = 2, two iterations
  tests=(tests/test_adam.py) processes=2 divergence_s=120  # (a CPU's processes start slower)
  bench=(--device cpu --workers 2 --cpu-iterations 2)
  pwgan=(--algorithm pwgan --workers 2 --iterations 1 --batch-size 10 --potential-rounds 1 --seed 4
         --dataset synthetic --device cpu)
fi
step cuda_tests "$tests_s" "$PY" -m pytest -m cuda -v -n "$processes" -p no:cacheprovider "${timeout_flag[@]}" -rf "${tests[@]}"
step bench "$bench_s" "$PY" -u bench/gpu.py "${bench[@]}"
step divergence_pwgan_traced "$divergence_s" "$PY" -u bench/gpu_divergence.py --trace -- "${pwgan[@]}"
echo "gpu_session: $(( $(date +%s) - started )) s; $archive"
