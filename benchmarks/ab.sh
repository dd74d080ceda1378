#!/usr/bin/env bash
# A/B of two versions of the package, side by side in one run: each round runs the
# core benchmark (workloads a, b) and the plugin's rows of the peers benchmark (c) once from checkout A
# and once from checkout B, the order alternating between rounds, so drift of this
# shared machine hits both alike. Both run this checkout's benchmark scripts (the same
# measurement; only the package on PYTHONPATH differs). Results:
# <out>/<label>-<round>-{core,peers}.json; benchmarks/ab_report.py takes the medians.
#
#   benchmarks/ab.sh A_DIR B_DIR OUT_DIR [ROUNDS]
# As root, cold reads drop the page cache; otherwise each checkpoint's files are evicted
# (posix_fadvise). PY= picks the interpreter (default benchmarks/.venv, from run.sh).
set -euo pipefail
a="$(cd "$1" && pwd)"; b="$(cd "$2" && pwd)"; out="$3"; rounds="${4:-2}"
here="$(cd "$(dirname "$0")" && pwd)"
py="${PY:-$here/.venv/bin/python}"  # benchmarks/run.sh creates benchmarks/.venv
mkdir -p "$out"
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
one() {  # label dir round
  local label="$1" dir="$2" r="$3"
  echo "== $label round $r ($dir) load $(cut -d' ' -f1-3 /proc/loadavg)"
  PYTHONPATH="$dir" "$py" "$here/bench_core.py" --quick --workloads ab
  cp "$here/results/core.json" "$out/$label-$r-core.json"
  PYTHONPATH="$dir" "$py" "$here/bench_peers.py" --quick --libs fop --workloads c --no-train
  cp "$here/results/peers.json" "$out/$label-$r-peers.json"
}
for r in $(seq 1 "$rounds"); do
  if (( r % 2 )); then one A "$a" "$r"; one B "$b" "$r"; else one B "$b" "$r"; one A "$a" "$r"; fi
done
