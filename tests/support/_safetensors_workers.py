"""Targets for tests/interop/test_safetensors.py run in several jax processes
(see _multiprocess)."""

import numpy as np


def read_sharded(ctx, path: str, rows: int, cols: int):
    """Restores ``w`` sharded by rows over every device of every process; returns the
    bytes this process read (the kernel's rchar) and whether its rows are right."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from flax_orbax_plugin._interop import safetensors as _safetensors

    like = {
        "w": jax.ShapeDtypeStruct(
            (rows, cols), np.float32, sharding=NamedSharding(ctx.mesh, P("data"))
        )
    }
    _safetensors.read_safetensors_index(path)  # headers: read before counting
    before = ctx.io()["rchar"]
    got = _safetensors.from_safetensors(path, like)["w"]
    bytes_read = ctx.io()["rchar"] - before
    full = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    shards = got.addressable_shards
    ok = all(np.array_equal(np.asarray(s.data), full[s.index]) for s in shards)
    return {"bytes_read": bytes_read, "rows_ok": ok, "shard_rows": shards[0].data.shape[0]}
