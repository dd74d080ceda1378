"""Hostile ``--key-map`` files of ``flax-orbax export`` (issue 32, the red-team pass):
a listed leaf path the source does not have (a typo: it was silently ignored and every
tensor kept its default name), a tensor name that is not UTF-8 text (a lone surrogate
went into the header), and a map that leaves out every leaf (exit 0, a file of no
tensors) are errors naming the file or the leaf; nothing is written."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli

HOSTILE = [
    ({"Dense_0/kernl": "fc.weight"}, r"names 1 leaf path\(s\) the source does not have: "),
    ({"Dense_0/kernel": "\ud800"}, r"leaf 'Dense_0/kernel': the tensor name .* UTF-8"),
    ({"Dense_0/kernel": None, "Dense_0/bias": None}, r"leaves out every leaf \(2\)"),
    ([["Dense_0/kernel", "w"]], r"expected a JSON object of leaf path -> tensor name"),
]


@pytest.fixture
def run(tmp_path):
    directory = tmp_path / "run"
    params = {"Dense_0": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3, np.float32)}}
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        mngr.save(1, {"params": params})
    return directory


@pytest.mark.parametrize("mapping,message", HOSTILE, ids=["typo", "surrogate", "none-left", "list"])
def test_a_hostile_key_map_is_an_error(run, tmp_path, capsys, mapping, message):
    key_map = tmp_path / "keys.json"
    key_map.write_text(json.dumps(mapping))
    out = tmp_path / "hf"
    assert cli.main(["export", str(run), str(out), "--key-map", str(key_map)]) == 2
    err = capsys.readouterr().err
    assert "flax-orbax export: error:" in err
    assert re.search(message, err), err
    assert not out.exists() or os.listdir(out) == []


def test_a_good_key_map_still_renames(run, tmp_path, capsys):
    key_map = tmp_path / "keys.json"
    key_map.write_text(json.dumps({"Dense_0/kernel": "fc.weight", "Dense_0/bias": None}))
    assert cli.main(["export", str(run), str(tmp_path / "hf"), "--key-map", str(key_map)]) == 0
    capsys.readouterr()
    header = fop.from_safetensors(tmp_path / "hf" / "model.safetensors")
    assert set(header) == {"fc.weight"}
