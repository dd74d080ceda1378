"""Golden checkpoints of format versions 1 and 2 (``tests/support/data/golden/``; the
version-2 ones are named ``v2_*``).

``python tests/support/golden.py`` (re)writes them (``--v2``: only the version-2 ones,
``--v2-zstd``: only the compressed version-2 one);
``tests/format/test_format.py``
restores them and
compares bit for bit with the trees built here. They are committed: a change of the
on-disk format that older checkpoints cannot be read with fails that test. Regenerate
only for a deliberate, compatible change, and never to make the test pass.
"""

from __future__ import annotations

import os
import shutil
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "data", "golden")


def every_leaf_kind():
    """One leaf of every kind and several dtypes; small leaves all go into batches."""
    return {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3) / 3,
        "bf16": (np.arange(4, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16),
        "f16": np.array([1.5, -2.25], np.float16),
        "i8": np.array([-128, 0, 127], np.int8),
        "u64": np.array([2**64 - 1], np.uint64),
        "c64": np.array([1 + 2j], np.complex64),
        "bool": np.array([True, False]),
        "zero_size": np.zeros((0, 5), np.float32),
        "scalar0d": np.float64(np.pi),
        "py_int": 2**40 + 3,
        "py_float": 0.1,
        "py_bool": True,
        "py_complex": 1 - 1j,
        "none": None,
        "empty_dict": {},
        "empty_list": [],
        "key": jax.random.key(7),
        "nested": [{"a": np.int32(5)}, (np.ones(2, np.float64),)],
        "big": np.arange(600, dtype=np.float32).reshape(20, 30),  # its own array (below)
    }


def small_leaves(n: int = 40):
    """A batch of many small leaves of two dtypes."""
    return {
        f"layer_{i}": {"w": np.full((i + 1,), i, np.float32), "n": np.int64(i)} for i in range(n)
    }


def linen_state():
    import optax
    from flax import linen as nn
    from flax.training import train_state

    model = nn.Dense(3)
    params = model.init(jax.random.key(0), jnp.ones((1, 4)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(0.1))
    grads = jax.tree.map(jnp.ones_like, state.params)
    return state.apply_gradients(grads=grads)


def nnx_state():
    import optax
    from flax import nnx

    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    opt.update(model, grads)
    return model, opt


def two_process_worker(ctx, directory):
    """Run by ``_multiprocess`` with 2 processes x 2 devices: a sharded and a replicated
    leaf and each process's iterator position."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    host = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    w = jax.make_array_from_callback(
        host.shape, NamedSharding(ctx.mesh, P("data")), lambda i: host[i]
    )
    b = jax.make_array_from_callback((6,), NamedSharding(ctx.mesh, P()), lambda i: host[0][i])

    class It:
        def get_state(self):
            return {"position": 10 + jax.process_index()}

    with fop.CheckpointManager(directory) as m:
        m.save(5, {"params": {"w": w, "b": b}}, data_iterator=It())
    return True


def write_v2() -> None:
    """The version-2 fixtures: every leaf kind, both storage kinds (arrays and batches),
    uncompressed and (``v2_zstd_leaf_kinds``) compressed with zstd level 3."""
    import flax_orbax_plugin as fop
    from flax_orbax_plugin._core import plan as _plan

    saved, _plan.SMALL_LEAF_BYTES = _plan.SMALL_LEAF_BYTES, 256
    try:
        path = os.path.join(GOLDEN, "v2_leaf_kinds")
        shutil.rmtree(path, ignore_errors=True)
        fop.save(path, every_leaf_kind(), format_version=2)
    finally:
        _plan.SMALL_LEAF_BYTES = saved
    write_v2_zstd()


def write_v2_zstd() -> None:
    """``v2_zstd_leaf_kinds``: the compressed version-2 fixture (``--v2-zstd``: only it)."""
    import flax_orbax_plugin as fop
    from flax_orbax_plugin._core import plan as _plan

    saved, _plan.SMALL_LEAF_BYTES = _plan.SMALL_LEAF_BYTES, 256
    try:
        path = os.path.join(GOLDEN, "v2_zstd_leaf_kinds")
        shutil.rmtree(path, ignore_errors=True)
        fop.save(path, every_leaf_kind(), format_version=2, compression="zstd")
    finally:
        _plan.SMALL_LEAF_BYTES = saved


def write_all() -> None:
    import flax_orbax_plugin as fop
    from flax_orbax_plugin._core import plan as _plan

    _plan.SMALL_LEAF_BYTES = 256  # leaves above 256 bytes get arrays of their own: both
    # storage kinds in a few KiB (the threshold is a writer's choice, not the format's)

    shutil.rmtree(GOLDEN, ignore_errors=True)
    os.makedirs(GOLDEN)
    fop.save(os.path.join(GOLDEN, "leaf_kinds"), every_leaf_kind())
    fop.save(os.path.join(GOLDEN, "small_leaves"), small_leaves())
    with fop.CheckpointManager(os.path.join(GOLDEN, "linen")) as m:
        m.save(1, linen_state(), extras={"loss": 0.25})
    with fop.CheckpointManager(os.path.join(GOLDEN, "nnx")) as m:
        m.save(1, nnx_state())
    sys.path.insert(0, HERE)
    from _multiprocess import run_processes

    result = run_processes(
        "golden:two_process_worker",
        2,
        devices_per_process=2,
        args={"directory": os.path.join(GOLDEN, "two_process")},
    )
    assert all(p.ok for p in result.procs), [p.describe() for p in result.procs]
    for root, dirs, _ in os.walk(GOLDEN):
        for d in dirs:
            if d.startswith("."):
                shutil.rmtree(os.path.join(root, d))
    for root, _, files in os.walk(GOLDEN):
        for f in files:
            if f == ".writer.lock":
                os.remove(os.path.join(root, f))
    write_v2()


if __name__ == "__main__":
    if sys.argv[1:] == ["--v2"]:
        write_v2()
    elif sys.argv[1:] == ["--v2-zstd"]:
        write_v2_zstd()
    else:
        write_all()
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(GOLDEN) for f in fs)
    print(f"wrote {GOLDEN}: {total} bytes")
