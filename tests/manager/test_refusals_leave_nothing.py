"""A save refused in its blocking phase, and a manager refused at construction, leave
nothing behind on any store (issue 51 item 6).

On an object store a step is written in place: a save whose later item was refused in
its blocking phase (a PRNG key in ``extras``, or in an item that cannot hold one such
as ``HFShards``) left ``<step>/_PENDING.json`` and the earlier items' objects in the
bucket, after ``close()`` too, until another writer opened; on local disk its staging
directory was removed. A replacing save (``overwrite=True``) refused the same way must
leave the old step whole. A manager refused at construction left a ``.writer.lock``
(and the directory it made) where there was nothing.
"""

from __future__ import annotations

import os
import threading

import jax
import numpy as np
import pytest

import flax_orbax_plugin as fop

pytest_plugins = ["_servers"]


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """(url, listing of every object/file under it)."""
    if request.param == "local":
        root = tmp_path / "run"

        def listing():
            return sorted(
                os.path.relpath(os.path.join(d, f), root)
                for d, _, fs in os.walk(root)
                for f in fs
                if f != ".writer.lock"
            )

        return str(root), listing
    loc = request.getfixturevalue("s3_location")
    return loc.url, lambda: sorted(k for k in loc.keys() if not k.endswith("_RUN.json"))


def _params():
    return {"w": np.arange(6, dtype=np.float32)}


@pytest.mark.parametrize("refused", ["extras", "hf_shards", "replace"])
def test_a_save_refused_in_its_blocking_phase_leaves_nothing(store, refused):
    url, listing = store
    key = jax.random.key(0)
    hf = fop.HFShards(every_steps=1) if refused == "hf_shards" else None
    with fop.CheckpointManager(url, hf_shards=hf) as mngr:
        mngr.save(1, {"params": _params()})
        mngr.wait()
        before = listing()
        with pytest.raises(fop.StructureError, match="PRNG key"):
            if refused == "extras":
                mngr.save(2, {"params": _params()}, extras={"rng": key})
            elif refused == "hf_shards":
                mngr.save(2, {"params": {**_params(), "key": key}})
            else:  # replacing step 1: the old step stays whole
                mngr.save(
                    1,
                    {"params": _params() | {"v": np.ones(2)}},
                    extras={"rng": key},
                    overwrite=True,
                )
        assert listing() == before  # at once, not at close or the next open
        assert mngr.steps() == [1]
    assert listing() == before
    np.testing.assert_array_equal(fop.restore_params(url)["w"], _params()["w"])


def test_a_manager_refused_at_construction_leaves_no_lock_file(tmp_path):
    """handle_sigterm=True off the main thread is refused after the lock is taken."""
    fresh, errors = tmp_path / "fresh", []
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("the user's")

    def open_off_the_main_thread(directory):
        try:
            fop.CheckpointManager(directory, handle_sigterm=True)
        except ValueError as e:
            errors.append(e)

    for directory in (fresh, existing):
        t = threading.Thread(target=open_off_the_main_thread, args=(directory,))
        t.start()
        t.join()
    assert len(errors) == 2 and all("main thread" in str(e) for e in errors)
    assert not fresh.exists()  # the directory the open made, empty again: gone
    assert sorted(os.listdir(existing)) == ["notes.txt"]  # the lock file only
    with fop.CheckpointManager(existing) as mngr:  # and the next writer opens as usual
        mngr.save(1, {"params": _params()})
    assert (existing / ".writer.lock").exists()  # a writer that opened keeps its file


def test_a_writer_holding_the_lock_is_not_disturbed_by_a_refused_open(tmp_path):
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        with pytest.raises(fop.DirectoryLockedError):
            fop.CheckpointManager(run)
        assert (run / ".writer.lock").exists()
        with pytest.raises(fop.DirectoryLockedError):  # still held
            fop.CheckpointManager(run)
        mngr.save(1, {"params": _params()})
