"""The format seam: one object per version, picked once (the request on save, the
metadata on read), owning both directions."""

import os

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._core import formats as _formats
from flax_orbax_plugin._format.steps import read_document
from flax_orbax_plugin._manager.checkpointables import PytreeCheckpointable
from flax_orbax_plugin._storage.location import Location

TREE = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(3, np.int32)}
MEMBERS = (
    "version",
    "copies_before_writing",
    "per_host_directories",
    "ignored_options",
    "batch_damage",
    "array_specs",
    "write",
    "reuser",
    "wrote",
    "open",
    "array_store",
    "read_stored",
    "batch_store",
    "reads_batch_runs",
)


@pytest.mark.parametrize("version", [1, 2])
def test_each_version_has_its_format_owning_both_directions(tmp_path, version):
    fmt = _formats.for_version(version)
    assert fmt.version == version
    assert all(hasattr(fmt, m) for m in MEMBERS)
    fop.save(tmp_path / "c", TREE, format_version=version)
    doc = read_document(Location.from_path(tmp_path / "c"))
    assert _formats.of_document(doc) is fmt and fmt.wrote(doc)
    other = _formats.for_version(3 - version)
    assert not other.wrote(doc)
    out = fop.restore(tmp_path / "c")
    np.testing.assert_array_equal(out["w"], TREE["w"])
    assert all(r.ok for r in fop.verify(tmp_path / "c"))


@pytest.mark.parametrize("bad", [0, 3, True, "2", None], ids=["0", "3", "True", "str", "None"])
def test_a_version_no_format_writes_is_refused(bad):
    with pytest.raises(fop.OptionError, match=r"format_version must be one of 1, 2"):
        _formats.check_version(bad)
    if bad is not None:  # None: the item takes the request's format
        with pytest.raises(ValueError, match="format_version"):
            PytreeCheckpointable(format_version=bad)


def test_an_explicit_pytree_item_takes_the_managers_format(tmp_path):
    """A checkpointables= override of the built-in pytree, without a version of its
    own, writes the manager's format (it wrote version 1 under format_version=2)."""
    with fop.CheckpointManager(
        tmp_path,
        async_save=False,
        format_version=2,
        checkpointables={"params": PytreeCheckpointable()},
    ) as mngr:
        mngr.save(1, {"params": TREE, "opt_state": TREE})
    for item in ("params", "opt_state"):
        doc = read_document(Location.from_path(tmp_path / "1" / item))
        assert doc.format_version == 2, item


def test_an_item_of_its_own_version_keeps_it(tmp_path):
    with fop.CheckpointManager(
        tmp_path,
        async_save=False,
        format_version=2,
        checkpointables={"params": PytreeCheckpointable(format_version=1)},
    ) as mngr:
        mngr.save(1, {"params": TREE, "opt_state": TREE})
    versions = {
        item: read_document(Location.from_path(tmp_path / "1" / item)).format_version
        for item in ("params", "opt_state")
    }
    assert versions == {"params": 1, "opt_state": 2}


@pytest.mark.parametrize(
    ("version", "option", "needs"),
    [(1, "data_file_bytes", "format_version=2")],
)
def test_what_a_format_ignores_is_refused_as_it_says(tmp_path, version, option, needs):
    (name, why), *_ = _formats.for_version(version).ignored_options
    assert name == option and why.startswith(needs)
    with pytest.raises(fop.OptionError, match=f"^{option}=1048576 does nothing without {needs}"):
        fop.save(tmp_path / "c", TREE, format_version=version, **{option: 1 << 20})


def test_version_2_is_the_default_and_version_1_is_written_on_request(tmp_path):
    """New saves write data files (version 2) unless asked for version 1; a manager in
    a directory per host, which version 2 does not write yet, takes version 1."""
    fop.save(tmp_path / "c", TREE)
    assert read_document(Location.from_path(tmp_path / "c")).format_version == 2
    assert os.path.isfile(tmp_path / "c" / "data" / "0.json")
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": TREE})
    doc = read_document(Location.from_path(tmp_path / "run" / "1" / "params"))
    assert doc.format_version == 2
    fop.save(tmp_path / "v1", TREE, format_version=1)
    assert read_document(Location.from_path(tmp_path / "v1")).format_version == 1
    np.testing.assert_array_equal(fop.restore(tmp_path / "v1")["w"], TREE["w"])
    assert _formats.version_for(None, per_host=False) == 2
    assert _formats.version_for(None, per_host=True) == 1
    assert _formats.version_for(2, per_host=True) == 2  # asked: refused at the open
