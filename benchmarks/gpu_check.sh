#!/usr/bin/env bash
# Workload (a) on one NVIDIA GPU: this plugin vs orbax-checkpoint (blocking D2H time,
# durable save, cold restore; median of 3), then the training loop on the GPU
# (bench_train.py: none / plugin / plugin with host_memory_budget / orbax, 2 repeats).
# For the device machine; about 5-8 minutes.
#
# The H200 image already has jax (CUDA), orbax-checkpoint, tensorstore, numpy and
# ml_dtypes; the plugin needs tensorstore >= 0.1.86. If the image's is older, the
# tensorstore wheel carried in .whl/ is installed to /tmp/site first. Prepare it here,
# once, in the repo root (already ignored by .gitignore):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl tensorstore==0.1.86
# Invoke (device tool):  run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=420)
# Result: a 'GPU_CHECK {json}' line in the output and $OUT/gpu_check.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
need_ts() {
  "$PY" - <<'PY'
import sys
try:
    from importlib.metadata import version
    import tensorstore  # noqa: F401
    v = tuple(int(x) for x in version("tensorstore").split(".")[:3])
    sys.exit(0 if v >= (0, 1, 86) else 1)
except Exception:
    sys.exit(1)
PY
}
if ! need_ts; then
  if ls .whl/tensorstore-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/tensorstore-*.whl && export PYTHONPATH=/tmp/site
  else
    echo "tensorstore too old and no .whl/tensorstore-*.whl carried" >&2
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import jax, importlib.metadata as m; print('jax', jax.__version__, jax.devices(), 'tensorstore', m.version('tensorstore'), 'orbax', m.version('orbax-checkpoint'))" || true
out="${OUT:-$PWD/benchmarks/results}"
timeout 300 "$PY" benchmarks/gpu_check.py --repeats "${REPEATS:-3}" --out "$out"
rc=$?
echo "gpu_check exit $rc"
# Issue 26, point 5: the training loop with the state on the GPU. Blocking time (the
# pinned_host copies enqueued), the step after each save, the whole run against the
# run without saves, and the host link's GB/s (one copy of the state to pinned_host).
timeout 360 "$PY" benchmarks/bench_train.py --platform cuda --repeats 2 --steps 40 \
  --batch "${TRAIN_BATCH:-8192}" --dir /tmp/fop_gpu_train --out "$out/gpu_train" \
  --libs none fop 'fop:{"host_memory_budget": 268435456}' orbax
rc2=$?
echo "gpu_train exit $rc2"
[ "$rc" -eq 0 ] && [ "$rc2" -eq 0 ]
