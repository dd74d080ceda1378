#!/usr/bin/env bash
# The benchmarks' one command. Creates benchmarks/.venv (the project, editable, plus
# its peers from requirements.txt), then runs a suite. Needs root (cold reads drop
# the page cache).
#
#   benchmarks/run.sh core  [--quick] [--repeats N]     issue 2: plugin vs raw limit (~2 min)
#   benchmarks/run.sh peers [--quick] [--repeats N]     issue 5: all libraries (~15 min)
#   benchmarks/run.sh all                               both
#
# Results: benchmarks/results/{core,peers}.{json,md,png}
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
venv="$here/.venv"
stamp="$venv/.installed"
py="${PYTHON:-python3}"

if [[ ! -f "$stamp" || "$here/requirements.txt" -nt "$stamp" || "$root/setup.cfg" -nt "$stamp" ]]; then
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q -e "$root" -r "$here/requirements.txt"
  touch "$stamp"
fi

export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
suite="${1:-all}"
shift || true
case "$suite" in
  core)  exec "$venv/bin/python" "$here/bench_core.py" "$@" ;;
  peers) exec "$venv/bin/python" "$here/bench_peers.py" "$@" ;;
  all)   "$venv/bin/python" "$here/bench_core.py" "$@"
         exec "$venv/bin/python" "$here/bench_peers.py" "$@" ;;
  *) echo "usage: $0 core|peers|all [options]" >&2; exit 2 ;;
esac
