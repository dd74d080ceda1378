"""The pool reserved before the loop (issue 34, item 4): ``CheckpointManager.reserve``
(and the callback's ``on_train_start``) allocates and populates every host buffer one
save takes, so the first save allocates none; the saved values stay right."""

from __future__ import annotations

import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import host as _host
from flax_orbax_plugin._base import host_memory as _host_memory


def _state(devices, v: float) -> dict:
    mesh = Mesh(np.array(devices).reshape(8), ("x",))
    rng = np.random.default_rng(int(v))
    return {
        "params": {
            "w": jnp.asarray(rng.standard_normal((600, 601), np.float32)),
            "s": jax.device_put(  # 8 shards of 260 KiB, each its own region
                rng.standard_normal((2048, 130), np.float32), NamedSharding(mesh, P("x"))
            ),
            "n": rng.standard_normal((200001,)),  # numpy
            # small leaves: one batch buffer of > 64 KiB
            **{f"b{i}": jnp.full((3000,), v + i, jnp.float32) for i in range(8)},
        },
        "opt_state": {"m": jnp.zeros((1030, 521), jnp.bfloat16) + v},
    }


def _pool(mngr: fop.CheckpointManager) -> _host_memory.BufferPool:
    return mngr._buffers  # the manager's pool: its counters are what is tested


def _check_first_save_takes_reserved_buffers(mngr, state, step, buffers=12) -> None:
    pool = _pool(mngr)
    assert pool.allocated == 0 and pool.nbytes > 0
    mngr.save(step, state)
    mngr.wait()
    assert pool.allocated == 0  # every buffer of the first save was reserved
    assert pool.reused >= buffers  # w, 8 shards, n, m, the batch
    restored = mngr.restore(step=step)
    for path, value in jax.tree_util.tree_leaves_with_path(state):
        got = restored
        for key in path:
            got = got[key.key]
        assert np.array_equal(np.asarray(got), np.asarray(value)), path


@pytest.mark.parametrize("version", [1, 2])
def test_after_reserve_the_first_save_allocates_no_buffer(tmp_path, devices, version):
    state = _state(devices, 1.0)
    with fop.CheckpointManager(tmp_path, format_version=version, reuse_host_buffers=True) as mngr:
        reserved = mngr.reserve(state)
        assert reserved == _pool(mngr).nbytes > 600 * 601 * 4
        assert mngr.reserve(state) == 0  # already there: nothing more
        _check_first_save_takes_reserved_buffers(mngr, state, 1)


def test_reserve_of_eval_shape_and_the_callback(tmp_path, devices):
    unsharded = _state(devices, 2.0)
    del unsharded["params"]["s"]  # a ShapeDtypeStruct over devices is refused (below)
    with fop.CheckpointManager(tmp_path / "a", reuse_host_buffers=True) as mngr:
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), unsharded)
        assert mngr.reserve(like) > 0  # (eval_shape would make the float64 leaf float32)
        _check_first_save_takes_reserved_buffers(mngr, unsharded, 1, buffers=4)
        with pytest.raises(ValueError, match=r"\['s'\].*8 devices"):
            sharded = _state(devices, 0.0)
            mngr.reserve(
                jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(
                        x.shape, x.dtype, sharding=getattr(x, "sharding", None)
                    ),
                    sharded,
                )
            )
    state = _state(devices, 3.0)
    cb = fop.CheckpointCallback(
        tmp_path / "b", every_steps=1, resume=False, manager_options={"reuse_host_buffers": True}
    )
    assert cb.on_train_start(state) is state
    _check_first_save_takes_reserved_buffers(cb.manager, state, 5)
    cb.on_train_end(state)


@pytest.mark.skipif(
    platform.system() != "Linux" or tuple(map(int, os.uname().release.split(".")[:2])) < (5, 14),
    reason="MADV_POPULATE_WRITE is Linux 5.14+",
)
def test_populate_uses_madvise_and_leaves_the_buffer_writable():
    buf = _host.empty((1 << 20,), np.uint8)
    assert _host_memory.populate(buf)
    buf[:] = 7
    assert int(buf.sum()) == 7 << 20
