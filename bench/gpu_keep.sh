#!/usr/bin/env bash
# After a loan's `bench/gpu_session.sh figure3`: puts the figure's kept folder from its archive into docs/results/
# (replacing the folder there: the loan started from a copy of it and only added to it), with the loan's own log
# beside it in loans/, ready to be committed (as a results commit). The next loan starts from what is committed.
#
#   bash bench/gpu_keep.sh /work/.device/.../gpu-session-figure3.tar.gz [RESULTS=docs/results]
set -euo pipefail
archive=${1:?usage: bash bench/gpu_keep.sh ARCHIVE [RESULTS_FOLDER]}
results=${2:-$(dirname "$0")/../docs/results}
name=figure3-mnist-cnn-5k
inside=gpu-session/figure3
[ -f "$archive" ] || { echo "gpu_keep: no archive $archive" >&2; exit 2; }
unpacked=$(mktemp -d "${TMPDIR:-/tmp}/gpu-keep.XXXXXX")
trap 'rm -rf "$unpacked"' EXIT
tar -xzf "$archive" -C "$unpacked"
[ -d "$unpacked/$inside/$name" ] || {
  echo "gpu_keep: $archive holds no $inside/$name: not the archive of a figure3 loan" >&2; exit 2; }
loan=$(date -u -r "$archive" +%Y%m%dT%H%M%SZ)
mkdir -p "$results"
target=$results/$name
fresh=$results/.$name.new
rm -rf "$fresh"
cp -R "$unpacked/$inside/$name" "$fresh"
mkdir -p "$fresh/loans"
for f in card commit steps figure3; do  # this loan's own record, beside the runs it added
  [ -f "$unpacked/$inside/$f.txt" ] && cp "$unpacked/$inside/$f.txt" "$fresh/loans/$loan-$f.txt"
done
rm -rf "$target.old"
[ -d "$target" ] && mv "$target" "$target.old"
mv "$fresh" "$target"
rm -rf "$target.old"
echo "gpu_keep: $(find "$target/runs" -name summary.json 2>/dev/null | wc -l) runs in $target; loans: $(wc -l < "$target/loans.txt")"
