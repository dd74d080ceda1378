"""Nothing outside a checkpoint directory is followed, read, written or removed
(issue 11, points 1, 2, 4 and 9): symlinks and special files inside a checkpoint
are refused with an error that names them, and what they point to is untouched."""

import contextlib
import os
import shutil
import threading

import numpy as np
import pytest
from _trust_world import files_under as snapshot

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._storage.local_files import MAX_DOCUMENT_BYTES as MAX_SMALL_FILE_BYTES
from flax_orbax_plugin._storage.location import Location
from flax_orbax_plugin._storage.lock import DirectoryLock


@pytest.fixture
def outside(tmp_path):
    """A directory outside the checkpoint directory, holding someone else's files."""
    d = tmp_path / "outside"
    (d / "sub").mkdir(parents=True)
    (d / "precious.txt").write_bytes(b"do not touch")
    (d / "sub" / "more.bin").write_bytes(b"\x01" * 100)
    return d


def small_tree():
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int32)}


# -- point 1: removal never follows a symlink -----------------------------------------


def test_remove_refuses_a_symlinked_location_and_leaves_the_target(tmp_path, outside):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside, ckpt / "9")
    before = snapshot(outside)
    with pytest.raises(fop.ForeignEntryError, match=r"ckpt/9.*symbolic link"):
        Location.from_path(ckpt / "9").remove()
    assert snapshot(outside) == before
    assert os.path.islink(ckpt / "9")


def test_remove_of_a_real_directory_unlinks_inner_symlinks_only(tmp_path, outside):
    step = tmp_path / "ckpt" / "3.partial-abc"
    step.mkdir(parents=True)
    (step / "own.bin").write_bytes(b"x")
    os.symlink(outside, step / "link_to_dir")
    os.symlink(outside / "precious.txt", step / "link_to_file")
    before = snapshot(outside)
    Location.from_path(step).remove()
    assert not os.path.lexists(step)
    assert snapshot(outside) == before


def test_retention_never_empties_a_step_linked_in_from_another_run(tmp_path, outside):
    ckpt = tmp_path / "ckpt"
    with fop.CheckpointManager(ckpt, keep=1, async_save=False) as mngr:
        mngr.save(5, {"params": small_tree()})
    other_run = tmp_path / "other_run"
    shutil.copytree(ckpt / "5", other_run / "5")  # another run's committed step
    os.symlink(other_run / "5", ckpt / "1")  # linked in as the oldest step
    before = snapshot(other_run)
    with contextlib.suppress(fop.ForeignEntryError):  # refusing to open is fine too
        with fop.CheckpointManager(ckpt, keep=1, async_save=False) as mngr:
            mngr.save(6, {"params": small_tree()})
            with contextlib.suppress(fop.ForeignEntryError):
                mngr.gc()
    assert snapshot(other_run) == before


def test_opening_a_writer_never_empties_a_directory_linked_as_a_step(tmp_path, outside):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside, ckpt / "9")
    before = snapshot(outside)
    with contextlib.suppress(fop.ForeignEntryError):
        fop.CheckpointManager(ckpt).close()
    assert snapshot(outside) == before


def test_cli_gc_never_empties_a_directory_linked_as_an_unfinished_step(tmp_path, outside, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside, ckpt / "3.partial-abc")
    before = snapshot(outside)
    code = cli.main(["gc", str(ckpt)])
    err = capsys.readouterr().err
    assert snapshot(outside) == before
    if code != 0:  # refused: the error names the link
        assert "3.partial-abc" in err


def test_delete_does_not_follow_a_symlinked_parent(tmp_path, outside):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside, ckpt / "sub")
    before = snapshot(outside)
    with pytest.raises(fop.ForeignEntryError, match=r"ckpt/sub"):
        Location.from_path(ckpt).delete("sub/precious.txt")
    assert snapshot(outside) == before


def test_write_bytes_does_not_write_through_a_symlinked_parent(tmp_path, outside):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside, ckpt / "sub")
    with pytest.raises(fop.ForeignEntryError, match=r"ckpt/sub"):
        Location.from_path(ckpt).write_bytes("sub/precious.txt", b"overwritten")
    assert (outside / "precious.txt").read_bytes() == b"do not touch"


def test_child_kinds_reports_links_without_following_them(tmp_path, outside):
    ckpt = tmp_path / "ckpt"
    (ckpt / "4").mkdir(parents=True)
    (ckpt / "note").write_text("x")
    os.symlink(outside, ckpt / "9")
    os.mkfifo(ckpt / "fifo")
    kinds = Location.from_path(ckpt).child_kinds()
    assert kinds == {"4": "dir", "9": "symlink", "fifo": "other", "note": "file"}


# -- point 2: the writer lock ------------------------------------------------------------


def test_a_symlinked_writer_lock_is_refused_and_its_target_untouched(tmp_path, outside):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(outside / "precious.txt", ckpt / ".writer.lock")
    with pytest.raises(fop.ForeignEntryError, match=r"\.writer\.lock.*symbolic link"):
        DirectoryLock(str(ckpt)).acquire()
    with pytest.raises(fop.ForeignEntryError, match=r"\.writer\.lock"):
        fop.CheckpointManager(ckpt)
    assert (outside / "precious.txt").read_bytes() == b"do not touch"


def test_a_fifo_writer_lock_is_refused_without_blocking(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / ".writer.lock")
    with pytest.raises(fop.ForeignEntryError, match=r"\.writer\.lock.*FIFO"):
        DirectoryLock(str(ckpt)).acquire()


def test_a_directory_named_like_the_lock_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / ".writer.lock").mkdir(parents=True)
    with pytest.raises(fop.ForeignEntryError, match=r"\.writer\.lock.*directory"):
        DirectoryLock(str(ckpt)).acquire()


def test_a_dangling_symlinked_lock_creates_nothing_outside(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    target = tmp_path / "would_be_created"
    os.symlink(target, ckpt / ".writer.lock")
    with pytest.raises(fop.ForeignEntryError):
        DirectoryLock(str(ckpt)).acquire()
    assert not os.path.lexists(target)


# -- point 4: restore reads no array data through a symlink ------------------------------


def big_and_small(tmp_path, version=1):
    path = tmp_path / "ckpt"
    tree = {"big": np.arange(300_000, dtype=np.float32), "small": np.ones(4, np.int32)}
    fop.save(path, tree, format_version=version)
    return path, tree


def test_restore_refuses_an_array_directory_linked_to_outside_data(tmp_path):
    path, tree = big_and_small(tmp_path)
    other = {"big": np.zeros(300_000, np.float32), "small": tree["small"]}
    fop.save(tmp_path / "other", other, format_version=1)
    shutil.rmtree(path / "d" / "0")
    os.symlink(tmp_path / "other" / "d" / "0", path / "d" / "0")
    np.testing.assert_array_equal(fop.restore(tmp_path / "other")["big"], 0)
    with pytest.raises(fop.ForeignEntryError, match=r"ckpt/d/0"):
        fop.restore(path)


def test_restore_refuses_a_chunk_file_linked_to_outside(tmp_path):
    path, _ = big_and_small(tmp_path)
    chunks = [
        os.path.join(dirpath, f)
        for dirpath, _, files in os.walk(path / "d" / "0")
        for f in files
        if f != "zarr.json"
    ]
    victim = chunks[0]
    copy = tmp_path / "outside_chunk"
    shutil.copyfile(victim, copy)
    os.remove(victim)
    os.symlink(copy, victim)
    with pytest.raises(fop.ForeignEntryError, match=os.path.relpath(victim, tmp_path)):
        fop.restore(path)


def test_verify_reports_a_step_whose_data_is_linked_from_outside(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    with fop.CheckpointManager(ckpt, async_save=False, format_version=1) as mngr:
        mngr.save(1, {"params": {"big": np.arange(300_000, dtype=np.float32)}})
    chunks = [
        os.path.join(dirpath, f)
        for dirpath, _, files in os.walk(ckpt / "1" / "params" / "d")
        for f in files
        if f != "zarr.json"
    ]
    shutil.copyfile(chunks[0], tmp_path / "outside_chunk")
    os.remove(chunks[0])
    os.symlink(tmp_path / "outside_chunk", chunks[0])
    assert cli.main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr()
    assert os.path.relpath(chunks[0], ckpt) in out.out + out.err


def test_restore_and_verify_refuse_version_2_data_linked_to_outside(tmp_path, capsys):
    """Version 2: a data file, or the whole data folder, replaced by a link to a copy
    outside (the same bytes) is refused, never read through."""
    path, tree = big_and_small(tmp_path, version=2)
    data = path / "data"
    (victim,) = [data / f for f in os.listdir(data) if f.endswith(".bin")]
    shutil.copyfile(victim, tmp_path / "outside.bin")
    os.remove(victim)
    os.symlink(tmp_path / "outside.bin", victim)
    with pytest.raises(fop.CheckpointError, match=r"data/0-0\.bin"):
        fop.restore(path)
    assert not fop.verify(path)[0].ok
    os.remove(victim)
    shutil.copyfile(tmp_path / "outside.bin", victim)
    np.testing.assert_array_equal(fop.restore(path)["big"], tree["big"])
    shutil.copytree(data, tmp_path / "outside_data")
    shutil.rmtree(data)
    os.symlink(tmp_path / "outside_data", data)
    with pytest.raises(fop.CheckpointError, match=r"ckpt/data"):
        fop.restore(path)


def test_restore_refuses_a_symlinked_commit_marker(tmp_path):
    path, _ = big_and_small(tmp_path)
    os.rename(path / "_COMMITTED", tmp_path / "marker")
    os.symlink(tmp_path / "marker", path / "_COMMITTED")
    with pytest.raises(fop.ForeignEntryError, match=r"_COMMITTED"):
        fop.restore(path)


# -- point 9: only regular files are read, JSON with a size cap ------------------------


def run_with_deadline(fn, seconds=20):
    """Runs ``fn`` on a thread; fails the test (instead of hanging it) past ``seconds``."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds}s (a hang)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_a_fifo_metadata_file_is_an_error_not_a_hang(tmp_path):
    path, _ = big_and_small(tmp_path)
    os.remove(path / "_METADATA.json")
    os.mkfifo(path / "_METADATA.json")
    with pytest.raises(fop.ForeignEntryError, match=r"_METADATA\.json.*FIFO"):
        run_with_deadline(lambda: fop.restore(path))
    with pytest.raises(fop.ForeignEntryError, match=r"_METADATA\.json.*FIFO"):
        run_with_deadline(lambda: fop.metadata(path))


def test_metadata_linked_to_dev_zero_is_an_error_not_a_memory_error(tmp_path):
    path, _ = big_and_small(tmp_path)
    os.remove(path / "_METADATA.json")
    os.symlink("/dev/zero", path / "_METADATA.json")
    with pytest.raises(fop.ForeignEntryError, match=r"_METADATA\.json.*symbolic link"):
        run_with_deadline(lambda: fop.restore(path))


def test_an_oversized_metadata_file_is_refused_before_it_is_read(tmp_path):
    path, _ = big_and_small(tmp_path)
    with open(path / "_METADATA.json", "r+b") as f:
        f.truncate(MAX_SMALL_FILE_BYTES + 1)  # sparse: costs no disk
    too_big = rf"_METADATA\.json.*{MAX_SMALL_FILE_BYTES + 1} bytes"
    with pytest.raises(fop.CorruptCheckpointError, match=too_big):
        fop.restore(path)


def test_a_metadata_directory_is_an_error_naming_it(tmp_path):
    path, _ = big_and_small(tmp_path)
    os.remove(path / "_METADATA.json")
    os.mkdir(path / "_METADATA.json")
    with pytest.raises(fop.ForeignEntryError, match=r"_METADATA\.json.*directory"):
        fop.restore(path)


def test_a_symlinked_json_item_is_refused(tmp_path, outside):
    ckpt = tmp_path / "ckpt"
    with fop.CheckpointManager(ckpt, async_save=False) as mngr:
        mngr.save(1, {"params": small_tree()}, extras={"loss": 0.5})
    extras = ckpt / "1" / "extras"
    (json_name,) = [n for n in os.listdir(extras) if n.endswith(".json")]
    (outside / "fake.json").write_text('{"loss": 99.0}')
    os.remove(extras / json_name)
    os.symlink(outside / "fake.json", extras / json_name)
    with pytest.raises(fop.ForeignEntryError, match=json_name):
        fop.CheckpointManager(ckpt, read_only=True).restore(items="extras")


@pytest.mark.parametrize("version", [1, 2])
def test_a_users_link_at_a_name_no_reader_opens_is_left_alone_not_damage(
    tmp_path, outside, version
):
    """A link the user put inside an item (beside the arrays, or in version 2's data/
    under a name no data file has) is never opened: the step restores and verifies.
    Before, the whole step was damage: a resume silently went back to the step before."""
    run = tmp_path / "run"
    with fop.CheckpointManager(run, format_version=version) as mngr:
        for step in (1, 2):
            mngr.save(step, {"params": {"w": np.full(4, step, np.float32)}})
    os.symlink(outside, run / "2" / "params" / "link")
    (run / "2" / "params" / "data").mkdir(exist_ok=True)
    os.symlink(outside, run / "2" / "params" / "data" / "notes")
    like = {"params": {"w": np.zeros(4, np.float32)}}
    with fop.CheckpointManager(run) as mngr:
        np.testing.assert_array_equal(mngr.restore(like=like)["params"]["w"], np.full(4, 2))
        assert mngr.restored_step == 2
    assert all(r.ok for r in fop.verify(run))
    # A link at a name a reader opens is still refused (never followed).
    names = ["d", "b"] if version == 1 else ["data/0.json"]
    target = next(run / "2" / "params" / n for n in names if (run / "2" / "params" / n).exists())
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    os.symlink(outside, target)
    with pytest.raises(fop.ForeignEntryError, match="symbolic link"):
        fop.restore(run / "2" / "params")
