"""Packed sub-byte leaves written by two real JAX processes (2 CPU devices each): each
writes only whole bytes of its own regions (shards of rows, of columns, and a
replicated leaf's chunk rows split between them), both formats; read back bit for bit
onto another split."""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin._format import layout as _layout

SHAPE = (1024, 2048)  # 2 Mi four-bit values (1 MiB packed), 1 MiB int2 values ...


def _values(name: str, shape=SHAPE) -> np.ndarray:
    bits = _layout.DTYPES[name].bits
    raw = (np.arange(int(np.prod(shape))) * 7 % (1 << bits)).astype(np.uint8)
    return raw.view(_layout.dtype_from_name(name)).reshape(shape)


def mp_save(ctx, path, format_version):
    """Each of 2 processes: saves a row-sharded int4 leaf, a column-sharded uint2 leaf
    and a replicated 1-D float4 leaf (its chunk rows split between the processes)."""
    from flax_orbax_plugin._zarr import arrays as _arrays

    _arrays.CHUNK_TARGET_BYTES = 256 << 10  # several chunks per writer
    rows = NamedSharding(ctx.mesh, P("data"))
    cols = NamedSharding(ctx.mesh, P(None, "data"))
    everywhere = NamedSharding(ctx.mesh, P())
    tree = {}
    for key, name, sharding, shape in [
        ("rows", "int4", rows, SHAPE),
        ("cols", "uint2", cols, SHAPE),
        ("flat", "float4_e2m1fn", everywhere, (4 << 20,)),
    ]:
        values = _values(name, shape)
        tree[key] = jax.make_array_from_callback(shape, sharding, lambda i, v=values: v[i])
    result = fop.save_async(path, tree, format_version=format_version).wait()
    return {"written": result.bytes_written}


@pytest.mark.distributed
@pytest.mark.parametrize("format_version", [1, 2])
def test_two_processes_write_packed_leaves(tmp_path, devices, format_version):
    from _multiprocess import run_processes

    path = str(tmp_path / "c")
    run = run_processes(
        "test_subbyte_processes:mp_save",
        2,
        devices_per_process=2,
        args={"path": path, "format_version": format_version},
        env={"FOP_COORDINATION_TIMEOUT_S": "20"},
        timeout_s=120,
    ).check()
    packed = {"rows": SHAPE[0] * SHAPE[1] // 2, "cols": SHAPE[0] * SHAPE[1] // 4}
    packed["flat"] = (4 << 20) // 2
    # each process wrote half of every leaf, packed (a replicated leaf: half its rows)
    assert [r["written"] for r in run.results] == [sum(packed.values()) // 2] * 2
    doc = json.loads(open(os.path.join(path, _layout.METADATA_FILE), "rb").read())
    assert {r["path"]: r["storage"]["type"] for r in doc["leaves"]} == dict.fromkeys(
        packed, "packed_array"
    )
    grid = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("a", "b"))
    other = NamedSharding(grid, P("b", "a"))
    like = {
        "rows": jax.ShapeDtypeStruct(SHAPE, ml_dtypes.int4, sharding=other),
        "cols": jax.ShapeDtypeStruct(SHAPE, ml_dtypes.uint2, sharding=other),
        "flat": jax.ShapeDtypeStruct((4 << 20,), ml_dtypes.float4_e2m1fn),
    }
    got = fop.restore(path, like=like)
    for key, name in [("rows", "int4"), ("cols", "uint2"), ("flat", "float4_e2m1fn")]:
        want = _values(name, like[key].shape)
        assert np.asarray(got[key]).tobytes() == want.tobytes(), key
    assert fop.verify(path)[0].ok
