"""Retention's deletes: off the save path, a bounded queue, failures raised, never dropped.

Real managers on local disk, ``memory://`` and the moto S3 server; slow and failing
removals come from the package's own fault points (``FOP_PAUSE_AT`` / ``FOP_FAIL_AT``
``mid_retention`` / ``remove_step``, see ``_base/env.py``).
"""

import os

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._storage import contexts as _contexts
from flax_orbax_plugin._storage import deleting as _deleting

pytest_plugins = ["_servers"]


def tiny(step: int) -> dict:
    return {"params": {"w": np.full((4,), step, np.float32)}}


def test_a_failed_removal_is_raised_at_wait_and_the_step_stays_listed(tmp_path, monkeypatch):
    """A removal that fails is an error at wait() naming the step (it was only logged,
    and the step silently stayed on disk); the next pass, once it can, removes it."""
    monkeypatch.setenv("FOP_FAIL_AT", "remove_step")
    mngr = fop.CheckpointManager(tmp_path, keep=1)
    mngr.save(1, tiny(1))
    mngr.save(2, tiny(2))
    with pytest.raises(fop.CheckpointError, match=r"retention failed .*step 1: InjectedFault"):
        mngr.wait()
    assert mngr.steps() == [1, 2]  # kept, and listed: nothing lost without a word
    mngr.wait()  # reported once
    monkeypatch.delenv("FOP_FAIL_AT")
    mngr.save(3, tiny(3))
    mngr.close()  # drains: the retried removals succeed, nothing to raise
    assert sorted(os.listdir(tmp_path)) == [".writer.lock", "3"]


def test_gc_raises_a_failed_removal(tmp_path, monkeypatch):
    with fop.CheckpointManager(tmp_path) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, tiny(step))
    monkeypatch.setenv("FOP_FAIL_AT", "remove_step")
    with fop.CheckpointManager(tmp_path, keep=1) as mngr:
        with pytest.raises(fop.CheckpointError, match="step 1: InjectedFault"):
            mngr.gc()
        monkeypatch.delenv("FOP_FAIL_AT")
        assert mngr.gc() == [1, 2]


def test_flax_orbax_gc_reports_a_failed_removal(tmp_path, monkeypatch, capsys):
    from flax_orbax_plugin import cli

    with fop.CheckpointManager(tmp_path) as mngr:
        for step in (1, 2):
            mngr.save(step, tiny(step))
    monkeypatch.setenv("FOP_FAIL_AT", "remove_step")
    rc = cli.main(["gc", str(tmp_path), "--keep", "1"])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_ERROR and "step 1: InjectedFault" in err, err
    assert fop.CheckpointManager(tmp_path, read_only=True).steps() == [1, 2]


def test_the_queue_is_bounded_and_passes_coalesce(tmp_path, monkeypatch):
    """While one removal is slow, commits go on and queue at most one more pass (it was
    one queued pass per commit: an unbounded queue behind a slow store)."""
    monkeypatch.setenv("FOP_PAUSE_AT", "mid_retention")
    monkeypatch.setenv("FOP_PAUSE_S", "0.5")
    mngr = fop.CheckpointManager(tmp_path, keep=1, async_save=False)
    retainer = mngr._retainer
    queued = []
    for step in range(1, 7):
        mngr.save(step, tiny(step))  # synchronous: committed (and a pass submitted)
        queued.append(retainer._pool._work_queue.qsize())
    assert max(queued) <= 1, queued
    mngr.close()
    assert mngr.steps() == [6]
    assert sorted(os.listdir(tmp_path)) == [".writer.lock", "6"]


def test_a_save_commits_while_a_removal_is_in_progress(tmp_path, monkeypatch):
    """The deletion thread is paused inside a removal (step 1 renamed away, not yet
    removed); saves go on and commit meanwhile, and the renamed step is never listed."""
    monkeypatch.setenv("FOP_PAUSE_AT", "mid_retention")
    monkeypatch.setenv("FOP_PAUSE_S", "2")
    mngr = fop.CheckpointManager(tmp_path, keep=2, async_save=False)
    for step in (1, 2, 3):  # step 3's commit: step 1's removal starts, and pauses
        mngr.save(step, tiny(step))
    mngr.save(4, tiny(4))  # committed while step 1's removal is paused
    names = os.listdir(tmp_path)
    assert any(n.startswith("1.deleting-") for n in names), names  # mid-removal
    assert fop.CheckpointManager(tmp_path, read_only=True).steps() == [2, 3, 4]
    mngr.close()
    assert sorted(os.listdir(tmp_path)) == [".writer.lock", "3", "4"]


@pytest.mark.parametrize("store", ["s3", "gcs", "memory"])
def test_removals_on_each_object_store(store, request):
    """S3 and GCS removals open their own context (their own request slots, not a
    save's); a memory:// store lives in its context, so its removals use the shared one.
    Retention then deletes every object of the old steps, and the newest restores."""
    if store == "memory":
        where, spec, keys = "memory://deleting-test/run", {"driver": "memory"}, None
    else:
        loc = request.getfixturevalue(f"{store}_location")
        where, spec, keys = loc.url, dict(loc.spec), loc.keys
    shared = _deleting.removal_context(spec) is _contexts.context(local=False)
    assert shared == (store == "memory")
    with fop.CheckpointManager(where, keep=1) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, tiny(step))
    reader = fop.CheckpointManager(where, read_only=True)
    assert reader.steps() == [3]
    np.testing.assert_array_equal(reader.restore()["params"]["w"], tiny(3)["params"]["w"])
    if keys is not None:
        assert not [k for k in keys() if k.startswith(("1/", "2/"))]


def test_removals_slow_down_while_a_save_runs(tmp_path, monkeypatch):
    """While the training thread is in a save a removal is paused; while its background
    write runs it keeps only WHILE_SAVING deletes in flight (the save's requests never
    queue behind ours); the full share otherwise."""
    from flax_orbax_plugin._manager import retaining

    monkeypatch.setenv("FOP_PAUSE_AT", "mid_write")
    monkeypatch.setenv("FOP_PAUSE_S", "1")
    with fop.CheckpointManager(tmp_path, keep=1, async_save=True) as mngr:
        pace = mngr._retainer._pace
        assert pace() == _deleting.REMOVAL_CONCURRENCY
        in_save = []  # asked from the training thread's part of the save
        state = {"params": {"w": np.ones((256, 1024), np.float32)}}
        mngr.save(1, state, extras=lambda: in_save.append(pace()) or {"loss": 0.5})
        assert in_save == [0]  # paused
        assert mngr.save_in_flight and pace() == retaining.WHILE_SAVING
        mngr.wait()
        assert pace() == _deleting.REMOVAL_CONCURRENCY


def test_a_removal_on_s3_asks_its_pace_before_each_delete(s3_location):
    """``delete_keys`` on the S3 server: every object goes, the number of deletes in
    flight is asked before each request (so a save starting mid-removal slows it at
    once), and 0 pauses it until the answer changes."""
    import tensorstore as ts

    kv = ts.KvStore.open(s3_location.spec).result()
    for i in range(40):
        kv.write(f"k{i:02d}", b"x").result()
    asked = []

    def pace() -> int:  # paused for its first 3 answers, then 1, then 8
        asked.append(len(asked))
        return 0 if len(asked) <= 3 else 1 if len(asked) <= 20 else 8

    _deleting.delete_keys(kv, kv.list().result(), pace)
    assert len(asked) == 40 + 3
    assert kv.list().result() == []


def test_a_step_on_s3_is_removed_by_batch_deletes(s3_location):
    """On the S3 server a doomed step's objects go in DeleteObjects requests (POST
    ?delete, up to 1000 keys each), not one DELETE per object; the step is gone, the
    kept step whole."""
    from _s3_requests import S3Requests

    state = {"params": {f"l{i:02d}": np.full((4,), i, np.float32) for i in range(30)}}
    with fop.CheckpointManager(s3_location.spec, keep=1, format_version=1) as mngr:
        mngr.save(1, state)
        mngr.wait()
        objects = [k for k in s3_location.keys() if k.startswith("1/")]
        assert len(objects) >= 4  # small leaves share batch files: still several objects
        with S3Requests() as requests:
            mngr.save(2, state)
            mngr.wait()  # retention drained
            requests.settle()
            lines = requests.take_lines()
    # DeleteObjects: a POST of the bucket itself (werkzeug's line drops the "?delete")
    batch = [path for k, path, _ in lines if k == "POST" and path.strip("/").count("/") == 0]
    single = [path for k, path, _ in lines if k.startswith("DELETE") and "/1/" in path]
    assert len(batch) == 1, [x for x in lines if "/1/" in x[1] or x[0] == "POST"]
    assert len(single) <= 2, single  # the pending marker and range deletes only
    assert not [k for k in s3_location.keys() if k.startswith("1/")]
    with fop.CheckpointManager(s3_location.spec, read_only=True) as reader:
        assert reader.steps() == [2]


KILLED_DELETER = """
import sys
import numpy as np
import flax_orbax_plugin as fop
with fop.CheckpointManager(sys.argv[1], keep=1) as m:
    for step in (1, 2):
        m.save(step, {"params": {"w": np.full((4,), step, np.float32)}})
        m.wait()
"""


def test_a_crash_between_rename_and_delete_is_finished_by_the_next_manager(tmp_path):
    """Killed (SIGKILL) after step 1 was renamed to its to-delete name and before its
    files went: the leftover is never listed as a step, and the next writer's open
    removes it (proven ours by the step manifest inside it); step 2 is whole."""
    import subprocess
    import sys

    from _proc import child_env

    d = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_DELETER, d],
        env=child_env(JAX_PLATFORMS="cpu", FOP_KILL_AT="mid_retention"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    left = [n for n in os.listdir(d) if n.startswith("1.deleting-")]
    assert len(left) == 1 and os.path.isfile(os.path.join(d, left[0], "_CHECKPOINT.json"))
    with fop.CheckpointManager(d, read_only=True) as reader:  # a reader removes nothing
        assert reader.steps() == [2]
    assert os.path.isdir(os.path.join(d, left[0]))
    with fop.CheckpointManager(d, keep=1) as mngr:
        assert mngr.steps() == [2]
        np.testing.assert_array_equal(mngr.restore()["params"]["w"], tiny(2)["params"]["w"])
    assert sorted(os.listdir(d)) == [".writer.lock", "2"]
