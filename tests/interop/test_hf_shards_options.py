"""``fop.HFShards``: names without a key map by ``fop.to_safetensors``'s rule, and its
options checked when it is made (by the Option kinds), never at the first save."""

from __future__ import annotations

import os

import numpy as np
import pytest

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


def test_options_are_checked_when_made_by_the_option_kinds():
    """Raw numpy / json / Python errors before (dtype='bf16', dtype=5, transposes=5,
    config={'a': object()}), or accepted and failing at the first save (dtype='int8',
    config with NaN), or numpy's ints refused."""
    bad = [
        (dict(dtype="bf16"), fop.OptionTypeError, "HFShards\\(dtype=\\): expected a floating"),
        (dict(dtype=5), fop.OptionTypeError, "HFShards\\(dtype=\\): expected a floating"),
        (dict(dtype="int8"), fop.OptionError, "HFShards\\(dtype=\\): expected a floating"),
        (dict(dtype="float4_e2m1fn"), fop.OptionError, "byte-sized dtypes only"),
        (dict(transposes=5), fop.OptionTypeError, "transposes: expected a regular expression"),
        (dict(config={"a": object()}), fop.OptionError, "HFShards\\(config=\\): cannot be"),
        (dict(config={"x": float("nan")}), fop.OptionError, "HFShards\\(config=\\): cannot be"),
        (dict(config=[1]), fop.OptionTypeError, "HFShards\\(config=\\): expected a dict"),
        (dict(max_shard_bytes=1.5), fop.OptionError, "max_shard_bytes"),
        (dict(item=3), fop.OptionTypeError, "HFShards\\(item=\\)"),
    ]
    for options, error, text in bad:
        with pytest.raises(error, match=text):
            fop.HFShards(every_steps=2, **options)
    with pytest.raises(fop.OptionTypeError, match="every_steps=.*found bool True"):
        fop.HFShards(every_steps=True)
    hf = fop.HFShards(every_steps=np.int64(2), max_shard_bytes=np.int64(4096))
    assert hf.every_steps == 2 and type(hf.every_steps) is int and hf.due(4)


def test_a_transposes_pattern_that_matches_no_leaf_is_refused(tmp_path):
    """It was silently ignored (the kernel written untransposed), whereas
    to_safetensors's key_map refuses a name the source does not have."""
    hf = fop.HFShards(every_steps=1, transposes=["dense/kernal"])
    params = {"dense": {"kernel": np.ones((2, 3), np.float32)}}
    with fop.CheckpointManager(tmp_path / "run", hf_shards=hf) as m:
        with pytest.raises(fop.OptionError, match="transposes: 'dense/kernal' matches no leaf"):
            m.save(0, {"params": params})
    hf = fop.HFShards(every_steps=1, transposes=["dense/kernel"])
    with fop.CheckpointManager(tmp_path / "ok", hf_shards=hf) as m:
        m.save(0, {"params": params})
    back = fop.from_safetensors(str(tmp_path / "ok" / _only_step(tmp_path / "ok") / "hf"))
    assert back["dense.kernel"].shape == (3, 2)
