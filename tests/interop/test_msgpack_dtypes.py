"""Flax msgpack files holding any dtype of the table (int4, float8_e8m0fnu, float4 ...):
read bit for bit, and imported as a step that restores bit for bit."""

from __future__ import annotations

import flax
import numpy as np
import pytest
from flax import serialization
from flax.training import checkpoints

import flax_orbax_plugin as fop
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._interop import importing as _importing
from flax_orbax_plugin._interop import msgpack_reader as _msgpack_import


def _values(name: str) -> np.ndarray:
    dtype = _layout.dtype_from_name(name)
    if name == "bool":
        return np.array([True, False, True])
    count = 1 << min(8, _layout.DTYPES[name].bits)
    raw = np.random.default_rng(7).integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    if _layout.DTYPES[name].bits < 8:
        raw = np.arange(count, dtype=np.uint8)  # every value, in its canonical byte
    return raw.view(dtype)


STATE = {"params": {name: _values(name) for name in sorted(_layout.DTYPES)}}


def _same(got, want):
    for name, w in want.items():
        g = np.asarray(got[name])
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), name


def test_every_dtype_is_read_bit_exact(tmp_path):
    path = tmp_path / "state.msgpack"
    path.write_bytes(serialization.to_bytes(STATE))
    _same(_msgpack_import.read_msgpack(path)["params"], STATE["params"])


def test_every_dtype_is_imported_as_a_step(tmp_path):
    src = tmp_path / "flax"
    flax.config.update("flax_use_orbax_checkpointing", False)  # the msgpack writer
    try:
        checkpoints.save_checkpoint(str(src), STATE, step=3)
    finally:
        flax.config.update("flax_use_orbax_checkpointing", True)
    out = str(tmp_path / "run")
    assert _importing.import_msgpack(str(src), out) == [3]
    with fop.CheckpointManager(out) as mngr:
        got = mngr.restore(step=3)
    _same(got["params"], STATE["params"])


def test_a_narrowing_cast_is_refused_until_asked_for(tmp_path):
    """restore_msgpack takes fop.restore's cast= (before, its refusal pointed to an
    option of another function, and none of its own cast anyway)."""
    path = tmp_path / "state.msgpack"
    path.write_bytes(serialization.to_bytes({"w": np.full(3, 0.1, np.float32)}))
    like = {"w": np.zeros(3, np.float16)}
    with pytest.raises(fop.StructureError, match=r"changes values \(pass cast='unsafe' to cast"):
        fop.restore_msgpack(path, like)
    got = fop.restore_msgpack(path, like, cast="unsafe")
    assert got["w"].dtype == np.float16 and np.allclose(got["w"], 0.1, atol=1e-3)
    with pytest.raises(fop.OptionError, match=r"cast must be one of"):
        fop.restore_msgpack(path, like, cast="lossy")
