"""Orbax checkpoints holding low-bit dtypes (every dtype of the table Orbax itself
saves: int4, int2, float4_e2m1fn, float8_e8m0fnu, float8_e3m4 ...): restored and
imported as a step bit for bit."""

from __future__ import annotations

import numpy as np
import orbax.checkpoint as ocp
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._interop import importing as _importing


def _values(name: str) -> np.ndarray:
    dtype = _layout.dtype_from_name(name)
    if name == "bool":
        return np.array([True, False, True, True])
    bits = min(8, _layout.DTYPES[name].bits)
    raw = np.random.default_rng(bits).integers(0, 1 << bits, 64 * dtype.itemsize, dtype=np.uint8)
    if bits < 8:
        raw = (np.arange(64) % (1 << bits)).astype(np.uint8)
    return raw.view(dtype).reshape(8, -1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A StandardSave of one leaf per dtype Orbax accepts (the others it refuses)."""
    root = tmp_path_factory.mktemp("orbax")
    state = {}
    for name in sorted(_layout.DTYPES):
        try:
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(root / f"probe-{name}", {"x": _values(name)})
                ckptr.wait_until_finished()
        except Exception:  # noqa: BLE001 - Orbax's own refusal of a dtype
            continue
        state[name] = _values(name)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(root / "state", {"params": state})
        ckptr.wait_until_finished()
    return root / "state", state


def _same(got, want):
    for name, w in want.items():
        g = np.asarray(got[name])
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes(), name


def test_orbax_low_bit_dtypes_restore_and_import_bit_exact(saved, tmp_path):
    path, state = saved
    assert {"int4", "float4_e2m1fn", "float8_e8m0fnu", "float8_e3m4"} <= set(state)
    _same(fop.restore(path)["params"], state)
    out = tmp_path / "run"
    assert _importing.import_orbax(path, out, step=1) == [1]
    _same(fop.restore_params(out), state)
