"""Touch nothing we did not create, on every store: local disk, ``memory://``, S3 (moto)
and GCS (emulator). Every entry point that removes, clears or replaces (manager open,
``gc``, retention, overwrite, ``fop.save(force=True)``, the callback's ``overwrite``)
leaves foreign entries byte-identical, and refuses to write over them."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import tensorstore as ts

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._base import env as _env
from flax_orbax_plugin._core import ownership as _ownership
from flax_orbax_plugin._core import removing as _removing
from flax_orbax_plugin._storage import location as _storage
from flax_orbax_plugin._storage.location import Location

pytest_plugins = ["_servers"]

FOREIGN = {
    "2024/notes.txt": b"a user's year folder",
    "007/params/x.bin": b"zero-padded, not a step name",
    "notes.txt": b"top-level user file",
    "orbax_run/1/_CHECKPOINT_METADATA": b'{"item_handlers": {}}',
    "orbax_run/1/default/manifest.ocdbt": b"\x00\x01ocdbt",
    "3/readme.md": b"a digits-named folder without our manifest",
}


@pytest.fixture(
    params=[
        "local",
        "memory",
        pytest.param("s3", marks=pytest.mark.s3),
        pytest.param("gcs", marks=pytest.mark.gcs),
    ]
)
def store(request, tmp_path):
    """The URL (or path) of an empty checkpoint directory on one store."""
    if request.param == "local":
        return str(tmp_path / "run")
    if request.param == "memory":
        return f"memory://ownership-{uuid.uuid4().hex}/run"
    fixture = "s3_location" if request.param == "s3" else "gcs_location"
    return request.getfixturevalue(fixture).url


def seed(url: str) -> None:
    loc = Location.from_path(url)
    for key, data in FOREIGN.items():
        loc.write_bytes(key, data)


def contents(url: str) -> dict[str, bytes]:
    """Every key under ``url`` with its bytes (local files included)."""
    loc = Location.from_path(url)
    kv = ts.KvStore.open(loc.spec, context=_storage.context(local=loc.is_local)).result()
    return {k.decode(): kv.read(k).result().value for k in kv.list().result()}


def assert_foreign_intact(url: str) -> None:
    now = contents(url)
    for key, data in FOREIGN.items():
        assert now.get(key) == data, f"foreign {key} changed or removed on {url}"


def tiny(i: int) -> dict:
    return {"params": {"w": np.full(8, i, np.float32)}}


def test_manager_open_gc_retention_and_overwrite_leave_foreign_entries(store):
    seed(store)
    with fop.CheckpointManager(store, keep=2) as mngr:
        for step in (1, 2, 5, 6):
            mngr.save(step, tiny(step))
        mngr.wait()
        mngr.save(6, tiny(60), overwrite=True, ignore_policy=True)
        mngr.wait()
        assert mngr.gc() == []
        assert mngr.steps() == [5, 6]
    assert_foreign_intact(store)
    with fop.CheckpointManager(store) as mngr:  # a second open's housekeeping
        assert mngr.restore(step=6, items="params")["w"][0] == 60
    assert cli.main(["gc", store, "--keep", "1"]) == 0
    assert_foreign_intact(store)
    assert fop.CheckpointManager(store, read_only=True).steps() == [6]


def test_saving_a_step_held_by_a_foreign_entry_raises_naming_it(store):
    seed(store)
    with fop.CheckpointManager(store) as mngr:
        with pytest.raises(fop.ForeignEntryError, match=r"step 3 .*3.*did not create"):
            mngr.save(3, tiny(3))
        with pytest.raises(fop.ForeignEntryError, match="2024"):
            mngr.save(2024, tiny(2024))
        assert mngr.save(4, tiny(4))
    assert_foreign_intact(store)


def test_core_save_refuses_a_foreign_target_with_or_without_force(store):
    seed(store)
    target = f"{store}/2024"
    for force in (False, True):
        with pytest.raises(fop.ForeignEntryError, match="2024"):
            fop.save(target, {"a": np.ones(3)}, force=force)
    assert_foreign_intact(store)
    # force replaces a checkpoint of ours, and only that
    fop.save(f"{store}/mine", {"a": np.zeros(3)})
    with pytest.raises(fop.CheckpointError, match="force=True"):
        fop.save(f"{store}/mine", {"a": np.ones(3)})
    fop.save(f"{store}/mine", {"a": np.ones(3)}, force=True)
    np.testing.assert_array_equal(fop.restore(f"{store}/mine")["a"], np.ones(3))
    assert_foreign_intact(store)


def test_callback_overwrite_removes_only_our_steps(store):
    seed(store)
    with fop.CheckpointManager(store) as mngr:
        mngr.save(1, tiny(1))
    cb = fop.CheckpointCallback(store, every_steps=1, overwrite=True)
    cb.on_train_start(tiny(0))
    cb.on_step_end(1, tiny(11))
    cb.on_train_end(tiny(11), step=1)
    assert_foreign_intact(store)
    assert fop.restore_params(store)["w"][0] == 11


def test_zero_padded_and_odd_names_are_foreign_and_retention_goes_on(store):
    seed(store)
    with fop.CheckpointManager(store, keep=1) as mngr:
        for step in (7, 8, 9):
            mngr.save(step, tiny(step))
        mngr.wait()
        assert mngr.steps() == [9]
        assert mngr.restore(items="params")["w"][0] == 9
    assert_foreign_intact(store)


def test_remains_of_a_dead_save_are_removed_only_with_our_marker(store):
    seed(store)
    loc = Location.from_path(store)
    # a save of ours that died on an object store: claimed, data, no manifest
    if not loc.supports_rename:
        dead = loc.child("12")
        _ownership.claim(dead, "dead01")
        dead.write_bytes("params/_METADATA.json", b"{}")
    else:
        dead = loc.child("12.partial-dead01")
        _ownership.claim(dead, "dead01")
        dead.write_bytes("params/_METADATA.json", b"{}")
    with fop.CheckpointManager(store) as mngr:
        assert mngr.steps() == []
    assert not any(k.startswith(f"{dead.name}/") for k in contents(store))
    assert_foreign_intact(store)


def test_removal_refuses_without_proof_and_never_follows_links(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(outside, run / "5")
    loc = Location.from_path(run)
    with pytest.raises(fop.ForeignEntryError):
        _ownership.remove(loc.child("5"))
    with pytest.raises(fop.ForeignEntryError):
        _removing.remove_step(loc, 5)
    assert (outside / "keep.txt").read_text() == "x" and os.path.islink(run / "5")
    (run / "6").mkdir()
    (run / "6" / "f").write_text("user")
    assert not _removing.remove_if_ours(loc.child("6"), what="test")
    assert (run / "6" / "f").read_text() == "user"


@pytest.mark.parametrize("code", ["ENOSPC", "EIO", "EMFILE"])
def test_a_failed_save_leaves_nothing_and_touches_no_earlier_step(tmp_path, monkeypatch, code):
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        mngr.save(1, tiny(1))
        mngr.wait()
        monkeypatch.setattr(_env, "_HITS", _env._HITS.__class__())
        monkeypatch.setenv("FOP_FAIL_AT", f"write_small:1:{code}")
        with pytest.raises(OSError) as raised:
            mngr.save(2, tiny(2))
            mngr.wait()
        assert raised.value.errno == getattr(__import__("errno"), code)
        monkeypatch.delenv("FOP_FAIL_AT")
        assert mngr.steps() == [1]
        assert sorted(os.listdir(run)) == [".writer.lock", "1"]  # no staging left behind
        assert mngr.restore(step=1, items="params")["w"][0] == 1
        assert mngr.save(2, tiny(2))  # the failure does not block the next save
    assert fop.restore_params(run)["w"][0] == 2
    assert not list(run.glob("*.corrupt-*"))
