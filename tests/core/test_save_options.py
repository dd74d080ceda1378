"""fop.save / fop.save_async: every keyword option checked by its declaration where it
enters, before anything is written or waited for; data_file_bytes refused with format
version 1, where it does nothing (issue 32)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import flax_orbax_plugin as fop

NAN = float("nan")


def _case_id(case):
    return f"{case[0]}={case[1]!r}"


SAVE_CASES = [
    ("force", "yes", {}, "True or False, found str 'yes'"),
    ("memory_limit_bytes", 0, {}, "a positive int"),
    ("memory_limit_bytes", 10**30, {}, "<= 9223372036854775807"),
    ("memory_limit_bytes", "1G", {}, "found str '1G'"),
    ("compression", "lz4", {}, "expected None, 'zstd' or 'zstd:<1-22>', found 'lz4'"),
    ("compression", "", {}, "found str ''"),
    ("compression", "zstd:99", {}, "found 'zstd:99'"),
    ("compression", 3, {}, "found int 3"),
    ("format_version", 3, {}, "one of 1, 2"),
    ("format_version", "1", {}, "found str '1'"),
    ("data_file_bytes", -1, {"format_version": 2}, "a positive int"),
    ("data_file_bytes", 10**30, {"format_version": 2}, "<= 9223372036854775807"),
    ("data_file_bytes", NAN, {"format_version": 2}, "found float nan"),
    ("host_memory_budget", NAN, {}, "found float nan"),
    ("host_memory_budget", "x", {}, "found str 'x'"),
]


@pytest.mark.parametrize("entry", ["save", "save_async"])
@pytest.mark.parametrize("name, value, extra, words", SAVE_CASES, ids=map(_case_id, SAVE_CASES))
def test_every_save_keyword_refuses_a_hostile_value(tmp_path, entry, name, value, extra, words):
    with pytest.raises(fop.OptionError) as info:
        getattr(fop, entry)(tmp_path / "c", {"w": np.zeros(4)}, **extra, **{name: value})
    assert str(info.value).startswith(name) and words in str(info.value), info.value
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("entry", ["save", "save_async"])
def test_data_file_bytes_with_format_version_1_is_refused(tmp_path, entry):
    # Was silently ignored: version 1 writes one file per chunk.
    with pytest.raises(fop.OptionError, match=r"^data_file_bytes=1048576 does nothing without "):
        getattr(fop, entry)(
            tmp_path / "c", {"w": np.zeros(4)}, format_version=1, data_file_bytes=1 << 20
        )
    assert not (tmp_path / "c").exists()


def test_data_file_bytes_with_format_version_2_is_taken(tmp_path):
    fop.save(tmp_path / "c", {"w": np.zeros(4)}, format_version=2, data_file_bytes=1 << 20)
    assert fop.is_committed(tmp_path / "c")


@pytest.mark.parametrize("entry", ["save", "save_async"])
def test_a_host_memory_budget_with_format_version_2_is_taken(tmp_path, entry):
    # Version 2 streams under a budget as version 1 does (tests/core/test_snapshot_paths.py).
    tree = {"w": np.arange(1 << 20, dtype=np.float32)}
    out = getattr(fop, entry)(tmp_path / "c", tree, format_version=2, host_memory_budget=1 << 20)
    if entry == "save_async":
        out.wait()
    np.testing.assert_array_equal(fop.restore(tmp_path / "c")["w"], tree["w"])


def test_format_version_none_means_the_default_as_on_the_manager(tmp_path):
    """``format_version=None`` was refused by fop.save and fop.save_async ('found
    None') while the manager took it as the default version: one meaning everywhere."""
    tree = {"w": np.arange(6, dtype=np.float32)}
    fop.save(tmp_path / "a", tree, format_version=None)
    fop.save_async(tmp_path / "b", tree, format_version=None).wait()
    with fop.CheckpointManager(tmp_path / "run", format_version=None) as mngr:
        mngr.save(1, {"params": tree})
    for path in (tmp_path / "a", tmp_path / "b", tmp_path / "run" / "1" / "params"):
        assert json.loads((path / "_METADATA.json").read_text())["format_version"] == 2, path
        np.testing.assert_array_equal(fop.restore(path)["w"], tree["w"])
