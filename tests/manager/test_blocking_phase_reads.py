"""A save's blocking phase on an accelerator is an enqueue: once the first transfer (the
device copy, or a staged region) is enqueued, nothing on the saving thread reads a
device value synchronously until the save returns (such a read waits behind the whole
state's transfer). Run on CPU with the device path switched on (``CPU_AS_DEVICE``); the
values live on two devices, where every host read goes through ``jax.Array``'s Python
methods (a single-device CPU array is read through the buffer protocol, unseen)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax._src.array import ArrayImpl
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin._core import device_copy as _device_copy

_READS = ("__array__", "__float__", "__int__", "__index__", "__bool__", "item", "tolist")


@pytest.fixture
def reads_after_enqueue(monkeypatch):
    """The synchronous device reads made on the main thread after the save's first
    transfer was enqueued, while ``watch["on"]`` (the blocking phase) is set."""
    monkeypatch.setattr(_device_copy, "CPU_AS_DEVICE", True)
    watch = {"on": False, "enqueued": False, "reads": []}
    for method in _READS:
        real = getattr(ArrayImpl, method)

        def reading(self, *args, _real=real, _method=method, **kw):
            main = threading.current_thread() is threading.main_thread()
            if watch["on"] and watch["enqueued"] and main:
                watch["reads"].append((_method, tuple(self.shape)))
            return _real(self, *args, **kw)

        monkeypatch.setattr(ArrayImpl, method, reading)
    for name in ("snapshot", "start"):
        real = getattr(_device_copy, name)

        def enqueue(*args, _real=real, **kw):
            out = _real(*args, **kw)
            watch["enqueued"] = watch["on"]
            return out

        monkeypatch.setattr(_device_copy, name, enqueue)
    return watch


def _two(x):
    """``x`` replicated on two devices."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    return jax.device_put(x, NamedSharding(mesh, P()))


def _train_state():
    params = {"w": jnp.ones((256, 512)), "b": jnp.zeros((512,)), "emb": jnp.ones((2048, 256))}
    state = train_state.TrainState.create(
        apply_fn=lambda *a: None, params=params, tx=optax.adam(1e-3)
    )
    return jax.tree_util.tree_map(_two, state)


class _It:
    def __init__(self):
        self.i = 0

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


@pytest.mark.parametrize("staging", ["device", "host", "pinned"])
def test_a_manager_save_reads_no_device_value_after_its_first_transfer(
    tmp_path, reads_after_enqueue, monkeypatch, staging
):
    monkeypatch.setattr(_device_copy, "staging_for", lambda platform: staging)
    state = _train_state().replace(step=_two(jnp.asarray(7)))  # on the device, as after a step
    extras = {"loss": _two(jnp.asarray(0.25)), "rng": _two(jax.random.key_data(jax.random.key(1)))}
    with fop.CheckpointManager(tmp_path / "run", best_metric="loss", keep_best=1, keep=2) as mngr:
        reads_after_enqueue["on"] = True
        mngr.save(7, state, data_iterator=_It(), extras=extras)
        reads_after_enqueue["on"] = False
        assert reads_after_enqueue["enqueued"], "no transfer took the device path"
        assert reads_after_enqueue["reads"] == []
        mngr.wait()
        got = mngr.restore(like=state)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got.params, state.params)
    assert int(got.step) == 7


def test_the_callback_and_save_async_read_nothing_after_the_first_transfer(
    tmp_path, reads_after_enqueue
):
    state = _train_state()
    cb = fop.CheckpointCallback(tmp_path / "run", every_steps=1)
    state = cb.on_train_start(state)
    state = state.replace(step=_two(jnp.asarray(1)))
    reads_after_enqueue["on"] = True
    cb.on_step_end(1, state)
    handle = fop.save_async(tmp_path / "one", {"params": state.params, "n": _two(jnp.asarray(3))})
    reads_after_enqueue["on"] = False
    assert reads_after_enqueue["enqueued"]
    assert reads_after_enqueue["reads"] == []
    handle.wait()
    cb.on_train_end(state)
