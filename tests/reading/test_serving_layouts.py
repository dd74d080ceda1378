"""Serving onto the layouts a user brings: a like or sharding= on an AbstractMesh
(``nnx.eval_shape`` under ``jax.set_mesh`` gives these) is read onto the concrete mesh
of that ``set_mesh``, and refused naming the leaf outside it (it was jax's raw
ValueError from deep inside the read); dry_run=True is never ignored."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop


@pytest.fixture
def run(tmp_path):
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    w = jax.device_put(
        np.arange(32, dtype=np.float32).reshape(8, 4), NamedSharding(mesh, P("x", "y"))
    )
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, {"params": {"w": w}})
    return tmp_path, mesh, np.asarray(w)


def test_a_like_on_an_abstract_mesh_reads_onto_the_mesh_set_around_the_call(run):
    directory, mesh, saved = run
    abstract = NamedSharding(mesh.abstract_mesh, P("y"))
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=abstract)}
    with pytest.raises(fop.StructureError, match=r"leaf 'w': .*abstract mesh.*jax.set_mesh"):
        fop.restore_params(directory, like=like)
    with pytest.raises(fop.StructureError, match=r"^sharding: .*abstract mesh"):
        fop.restore_params(directory, sharding=NamedSharding(mesh.abstract_mesh, P()))
    with jax.set_mesh(mesh):
        got = fop.restore_params(directory, like=like)["w"]
        placed = fop.restore_params(directory, sharding=NamedSharding(mesh.abstract_mesh, P()))
    assert got.sharding == NamedSharding(mesh, P("y"))
    np.testing.assert_array_equal(np.asarray(got), saved)
    np.testing.assert_array_equal(np.asarray(placed["w"]), saved)
    assert placed["w"].sharding.mesh == mesh


def test_dry_run_with_dtype_or_sharding_and_no_like_is_refused_not_ignored(run):
    directory, mesh, _ = run
    for options in ({"dtype": jnp.bfloat16}, {"sharding": NamedSharding(mesh, P())}):
        with pytest.raises(fop.OptionError, match=r"dry_run=True with dtype= or sharding="):
            fop.restore_params(directory, dry_run=True, **options)
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}
    plan = fop.restore_params(directory, like=like, dry_run=True, dtype=jnp.bfloat16)
    assert isinstance(plan, fop.RestorePlan)
