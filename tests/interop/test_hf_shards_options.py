"""``fop.HFShards``: names without a key map by ``fop.to_safetensors``'s rule, and its
options checked when it is made (by the Option kinds), never at the first save."""

from __future__ import annotations

import os

import numpy as np

import flax_orbax_plugin as fop


def _only_step(run):
    return max(p for p in os.listdir(run) if p.isdigit())


def test_colliding_default_names_are_full_paths_as_to_safetensors_names_them(tmp_path):
    """'a.b' and 'a/b' were refused ('both map to a.b'), which the docs say it resolves."""
    x, y = np.arange(3, dtype=np.float32), np.ones(2, np.float32)
    params = {"a.b": x, "a": {"b": y}}
    with fop.CheckpointManager(tmp_path / "run", hf_shards=fop.HFShards(every_steps=2)) as m:
        m.save(0, {"params": params})
    hf = tmp_path / "run" / _only_step(tmp_path / "run") / "hf"
    assert sorted(fop.from_safetensors(str(hf))) == ["a.b", "a/b"]  # full paths
    back = fop.from_safetensors(str(hf), like=params)  # read back by the same rule
    np.testing.assert_array_equal(back["a.b"], x)
    np.testing.assert_array_equal(back["a"]["b"], y)
    fop.to_safetensors(params, tmp_path / "one.safetensors")  # the same names both ways
    assert sorted(fop.from_safetensors(str(tmp_path / "one.safetensors"))) == ["a.b", "a/b"]
