"""Multi-process workers of test_format_v2 (run by tests/support/_multiprocess.py)."""

from __future__ import annotations

import os

import _mp_workers


def save_and_reshard(ctx, directory):
    """Every process saves the sharded state in format version 2, then restores it onto
    another sharding (columns split: regions that are not whole chunks) and checks
    every local shard; returns this process's files of the checkpoint."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    state = _mp_workers.make_state(ctx, 1)
    path = f"{directory}/1"
    fop.save(path, state, format_version=2)
    axis = ctx.mesh.axis_names[0]
    rows = _mp_workers.ROWS_PER_DEVICE * len(ctx.devices)
    cols = NamedSharding(ctx.mesh, P(None, axis))
    shape = (rows, _mp_workers.COLS)
    like = {
        "params": {
            "w": jax.ShapeDtypeStruct(shape, np.float32, sharding=cols),
            "b": jax.ShapeDtypeStruct(
                (_mp_workers.COLS,), np.float32, sharding=NamedSharding(ctx.mesh, P())
            ),
        },
        "opt_state": {"mu": jax.ShapeDtypeStruct(shape, np.float32, sharding=cols)},
    }
    out = fop.restore(path, like)
    full = _mp_workers.expected_w(len(ctx.devices)) + 1
    for s in out["params"]["w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), full[s.index])
    for s in out["opt_state"]["mu"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), -full[s.index])
    b = out["params"]["b"].addressable_shards[0].data
    np.testing.assert_array_equal(np.asarray(b), np.ones(_mp_workers.COLS))
    files = sorted(
        os.path.relpath(os.path.join(root, f), path)
        for root, _, names in os.walk(path)
        for f in names
    )  # none on an object store
    return {"files": files, "process": ctx.process_id}
