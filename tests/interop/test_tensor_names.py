"""Tensor names a safetensors header cannot hold, and key maps whose rules cannot name
(issue 51 item 5), refused before a byte is written, at every entry point that names
tensors: ``fop.to_safetensors``, ``flax-orbax export --key-map``, ``fop.HFShards`` (a
manager's save) and ``fop.from_safetensors``.

A tensor named ``__metadata__`` (a leaf of that name, or a key map's output) made a
file the ``safetensors`` library refuses, and the save said success. A key map rule
whose replacement names a group its pattern lacks was re's raw error at the first leaf
it matched (the class fixed for ``transform=``: the same checker now serves both).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import safetensors.numpy

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli


def _tree():
    return {"__metadata__": np.ones(3, np.float32), "w": np.arange(4, dtype=np.float32)}


def _files(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
    )


def test_to_safetensors_refuses_a_tensor_named_metadata_naming_the_leaf(tmp_path):
    out = tmp_path / "m.safetensors"
    with pytest.raises(fop.StructureError, match=r"leaf '__metadata__'.*metadata entry"):
        fop.to_safetensors(_tree(), out)
    with pytest.raises(fop.OptionError, match=r"key_map: leaf 'a'.*'__metadata__'"):
        fop.to_safetensors({"a": np.ones(2, np.float32)}, out, key_map={"a": "__metadata__"})
    with pytest.raises(fop.OptionError, match=r"key_map: leaf 'a'.*'__metadata__'"):
        fop.to_safetensors({"a": np.ones(2, np.float32)}, out, key_map=lambda p: "__metadata__")
    assert _files(tmp_path) == []  # nothing written
    # The advice works: the leaf named otherwise, the file is one safetensors reads.
    fop.to_safetensors(_tree(), out, key_map={"__metadata__": "meta"})
    assert sorted(safetensors.numpy.load_file(str(out))) == ["meta", "w"]
    # and reading back onto a like whose leaf maps to the reserved name says why.
    with pytest.raises(fop.StructureError, match=r"leaf '__metadata__'.*metadata entry"):
        fop.from_safetensors(str(out), like=_tree(), partial=True)
    with pytest.raises(fop.OptionError, match=r"key_map: leaf 'w'.*metadata entry"):
        fop.from_safetensors(
            str(out),
            like={"w": np.zeros(4, np.float32)},
            key_map={"w": "__metadata__"},
            partial=True,
        )


def test_cli_export_refuses_a_key_map_file_naming_metadata(tmp_path, capsys):
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}})
    key_map = tmp_path / "names.json"
    key_map.write_text(json.dumps({"w": "__metadata__"}))
    out = tmp_path / "out.safetensors"
    assert cli.main(["export", str(run), str(out), "--key-map", str(key_map)]) != 0
    assert "__metadata__" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "hf",
    [
        fop.HFShards(every_steps=1),  # the default names: the leaf's own name
        fop.HFShards(every_steps=1, key_map={r"w": "__metadata__", r"(.*)": r"\1"}),
    ],
    ids=["default-name", "key-map-output"],
)
def test_hf_shards_refuse_a_tensor_named_metadata_and_commit_no_step(tmp_path, hf):
    run = tmp_path / "run"
    params = _tree() if not hf.key_map else {"w": np.ones(2, np.float32), "b": np.ones(1)}
    with fop.CheckpointManager(run, hf_shards=hf) as mngr:
        with pytest.raises((fop.StructureError, fop.OptionError), match="__metadata__"):
            mngr.save(1, {"params": params})
            mngr.wait()
        assert mngr.steps() == []
    assert [p for p in os.listdir(run) if p[:1].isdigit()] == []


def test_a_key_map_replacement_naming_a_group_its_pattern_lacks_is_refused_when_made():
    bad = [
        ({r"(a)/b": r"x.\2"}, r"key_map\['\(a\)/b'\].*invalid group reference 2.*1 group"),
        ({r"a/b": r"x.\q"}, r"key_map\['a/b'\].*bad escape.*no groups"),
        ({r"(?P<n>a)": r"\g<m>"}, r"unknown group name 'm'.*named 'n'"),
    ]
    for key_map, text in bad:
        with pytest.raises(fop.OptionError, match=text):
            fop.HFShards(every_steps=1, key_map=key_map)
    fop.HFShards(every_steps=1, key_map={r"(a)/(?P<n>b)": r"x.\1.\g<n>"})  # valid
