#!/usr/bin/env bash
# What a short GPU loan is spent on, as two commands of at most 10 minutes (each step's output under $OUT, a file a
# step; a step that runs past its limit is stopped and the next one starts):
#   checks: every CUDA test (pytest -m cuda: CPU == CUDA, local == simulate on CUDA, graphs and lanes == eager);
#           bench/gpu.py --eager at N = 10 and 50 (with and without graphs, lanes and the flat Adam);
#           bench/gpu_divergence.py for P-WGAN (simulate twice, local twice) as its CUDA test runs it, then again
#           traced tensor by tensor (--trace: the module, gradient or step where local computes otherwise; a
#           trace reads every tensor to the host, so a divergence that needs two streams racing would not show)
#   figure3: Figure 3 with the CNN at 5,000 iterations (experiments/figure3-mnist-cnn-5k.yaml), its five runs
#           sharing the card, kept in $OUT/figure3-mnist-cnn-5k
#
#   OUT=/tmp/out bash bench/gpu_session.sh checks|figure3 [SECONDS]   # SECONDS: the command's whole time (570)
#
# From the project's root, after the line ../shared/tools/gpu_prepare.sh prints (MDGAN_DATA_ROOT set).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the outputs}
what=${1:-}
case "$what" in checks|figure3) ;; *) echo "usage: OUT=DIR bash bench/gpu_session.sh checks|figure3 [SECONDS]" >&2; exit 2;; esac
budget=${2:-570}
started=$(date +%s)
PY=${PYTHON:-python3}
mkdir -p "$OUT"

left() { echo $(( budget - ($(date +%s) - started) )); }

# step NAME LIMIT COMMAND...: runs it with at most LIMIT seconds (and never past the budget), output in $OUT/NAME.txt
step() {
  local name=$1 limit=$2; shift 2
  local room; room=$(left)
  (( room < limit )) && limit=$room
  if (( limit < 20 )); then echo "skip   $name (no time left)"; return; fi
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$([ $rc -eq 0 ] && echo done || echo "FAILED (exit $rc)") $name in $(( $(date +%s) - t0 )) s (limit $limit s)"
}

"$PY" -c "import torch; print(torch.cuda.get_device_name(0), 'torch', torch.__version__)" | tee "$OUT/card.txt"
if [ "$what" = figure3 ]; then
  config=$OUT/figure3-mnist-cnn-5k.yaml  # (the data where gpu_prepare.sh's line put it)
  sed "s#^base_from: #base_from: $PWD/experiments/#; s#^out: .*#out: ${TMPDIR:-/tmp}/mdgan-figure3-runs#
       s#^base: {#base: {data_root: ${MDGAN_DATA_ROOT:-$PWD/../shared/data}, #" experiments/figure3-mnist-cnn-5k.yaml \
    > "$config"
  step figure3 "$(left)" "$PY" -m mdgan_app.cli experiment "$config" --device cuda --jobs 5 \
    --keep "$OUT/figure3-mnist-cnn-5k"
  exit 0
fi
step cuda_tests 200 "$PY" -m pytest -q -m cuda -n 8 -p no:cacheprovider -rf tests
step bench 150 "$PY" bench/gpu.py --eager --workers 10 50 --cpu-iterations 4 --gpu-iterations 40
pwgan=(--algorithm pwgan --workers 3 --iterations 8 --batch-size 10 --disc-steps 2 --potential-rounds 3
       --potential-lr 0.5 --seed 4 --dataset synthetic --device cuda)
step divergence_pwgan 60 "$PY" bench/gpu_divergence.py -- "${pwgan[@]}" --gradient-penalty 5
step divergence_pwgan_traced 60 "$PY" bench/gpu_divergence.py --trace -- "${pwgan[@]}" --gradient-penalty 5
echo "gpu_session: $(( $(date +%s) - started )) s"
