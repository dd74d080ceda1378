# Sourced on the TPU machine (device tool): installs what the machine's JAX lacks into
# /tmp/site (the wheels carried in .whl-tpu: clu, crc32c, google-crc32c, xxhash) and
# /tmp/site2 (its own package index: flax, optax, orbax-checkpoint, tensorstore ...),
# behind the machine's own JAX on PYTHONPATH, with this checkout first for the package.
# The wheels are not committed: fetch them here first (x86-64, Python 3.11), then run
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl-tpu \
#     clu crc32c google-crc32c xxhash
# and carry .whl-tpu with the device tool's run; its command starts with
# `source benchmarks/tpu_setup.sh > /tmp/setup.log 2>&1` (not piped: a pipe is a subshell).
export PIP_CONFIG_FILE=/dev/null
python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl-tpu/*.whl || return 1
python3 -m pip install --isolated -q --only-binary=:all: --no-cache-dir \
  --index-url file:///opt/pypi/simple --target /tmp/site2 \
  flax optax orbax-checkpoint tensorstore ml-collections absl-py etils msgpack psutil \
  2>&1 | grep -v -i "warning" | tail -3
export PYTHONPATH="$PWD:$PYTHONPATH:/tmp/site:/tmp/site2"
export PYTHONUNBUFFERED=1
python3 -c "import platform, jax, flax, optax, orbax.checkpoint as o, tensorstore as ts, clu, flax_orbax_plugin as f; print('SETUP', platform.libc_ver(), 'jax', jax.__version__, 'flax', flax.__version__, 'orbax', o.__version__, 'ts', ts.__version__, jax.devices())"
