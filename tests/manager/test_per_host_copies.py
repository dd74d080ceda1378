"""Each host's own directory is one host's copy of a step, not a whole checkpoint:
verify checks what that copy is meant to hold (its own host's shards) and says the
others live elsewhere, serving from it alone is refused naming where the rest lives,
every host's directory is claimed for the run (another run's steps there are refused,
never adopted nor deleted), and a delete agrees across hosts before removing anything.
Real processes, separate directories, a shared local directory as the persistent tier.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._storage.lease import RUN_FILE

HERE = os.path.dirname(os.path.abspath(__file__))  # this module, for child processes
WAIT_S = 60


def _listing(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.isdigit())


def _error(call) -> str | None:
    try:
        call()
    except fop.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _verify(path: str) -> dict:
    """``fop.verify`` and the CLI's verify of ``path``: each item's verdict and note."""
    from flax_orbax_plugin import cli

    results = fop.verify(path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(["verify", path])
    return {
        "results": {r.item: [r.ok, r.note, r.error] for r in results},
        "cli_rc": rc,
        "cli": out.getvalue(),
    }


def _own_chunks(step_dir: str, item: str) -> list[str]:
    """The chunk files of the item's first array stored on its own (``d/<i>/c/...``)."""
    root = os.path.join(step_dir, item, "d")
    first = sorted(os.listdir(root))[0]
    found = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, first, "c")) for f in fs]
    return sorted(found)


def _copies(ctx, base):
    """One host's directory (its own shards and data position) verified and served
    alone; then one of its own chunks damaged (process 0: a byte flipped; process 1:
    a chunk file removed)."""
    import _files
    import _mp_workers as W

    local = os.path.join(base, f"copy{ctx.process_id}")
    with fop.CheckpointManager(local, persistent=os.path.join(base, "bucket-copy")) as mngr:
        it = fop.StepIndexedIterator(make_batch=lambda i: i)  # each process's own state
        mngr.save(1, W.make_state(ctx, 1), extras={"step": 1}, data_iterator=it)
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
    out = {"healthy": _verify(local), "metadata": sorted(fop.metadata(f"{local}/1/params").leaves)}
    out["serve"] = _error(lambda: fop.restore_params(local))
    out["restore_item"] = _error(lambda: fop.restore(os.path.join(local, "1", "opt_state")))
    ctx.client.wait_at_barrier("copies-checked", 30_000)
    chunk = _own_chunks(os.path.join(local, "1"), "params")[0]
    if ctx.process_id == 0:
        _files.flip_byte(chunk)
    else:
        os.remove(chunk)
    out["damaged"] = _verify(local)
    return out


def _run_b(ctx, directory, bucket):
    """Run B's open; where it is not refused, two steps saved with keep=2."""
    import _mp_workers as W

    with fop.CheckpointManager(directory, keep=2, persistent=bucket) as mngr:
        for step in (10, 11):
            mngr.save(step, W.make_state(ctx, step))


def _other_runs(ctx, base):
    """Run A on directories a0/a1; run B's primary gets a fresh directory, its process
    1 run A's a1 (another run's steps there); then run A's a1 without its run record
    (a directory from before every host recorded the run) reopened by run A."""
    import _mp_workers as W

    mine = os.path.join(base, f"a{ctx.process_id}")
    bucket_a = os.path.join(base, "bucket-a")
    with fop.CheckpointManager(mine, persistent=bucket_a) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, W.make_state(ctx, step))
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
    out = {"recorded": os.path.exists(os.path.join(mine, RUN_FILE))}
    ctx.client.wait_at_barrier("run-a-done", 30_000)
    other = os.path.join(base, "b0") if ctx.process_id == 0 else mine
    t0 = time.monotonic()
    bucket_b = os.path.join(base, "bucket-b")
    out["run_b"] = _error(lambda: _run_b(ctx, other, bucket_b))
    out["run_b_s"] = time.monotonic() - t0
    out["a_steps_after_b"] = _listing(mine)
    ctx.client.wait_at_barrier("run-b-done", 30_000)
    if ctx.process_id == 1 and os.path.exists(os.path.join(mine, RUN_FILE)):
        os.remove(os.path.join(mine, RUN_FILE))
    ctx.client.wait_at_barrier("record-removed", 30_000)
    with fop.CheckpointManager(mine, keep=3, persistent=bucket_a) as mngr:
        out["a_reopened"] = mngr.steps()
        got = mngr.restore(like=W.make_state(ctx, 0))
        out["a_restored"] = mngr.restored_step
        del got
    out["re_recorded"] = os.path.exists(os.path.join(mine, RUN_FILE))
    return out


def _deletes(ctx, base):
    """Steps 1, 2 on every host; process 1's copy of step 2 lost. delete(1, 5) refuses
    (no host holds 5) before removing anything; delete(2) removes it where it is."""
    import _mp_workers as W

    local = os.path.join(base, f"del{ctx.process_id}")
    bucket = os.path.join(base, "bucket-del")
    with fop.CheckpointManager(local, persistent=bucket) as mngr:
        for step in (1, 2):
            mngr.save(step, W.make_state(ctx, step))
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
    ctx.client.wait_at_barrier("del-saved", 30_000)
    if ctx.process_id == 1:
        shutil.rmtree(os.path.join(local, "2"))
    ctx.client.wait_at_barrier("del-lost", 30_000)
    out = {}
    with fop.CheckpointManager(local, persistent=bucket) as mngr:
        out["refused"] = _error(lambda: mngr.delete(1, 5))
        out["after_refused"] = _listing(local)
        out["delete_2"] = _error(lambda: mngr.delete(2))
        out["after_delete"] = _listing(local)
        out["steps"] = mngr.steps()
    return out


def per_host_copies(ctx, base):
    """Every case in one job of 2 processes."""
    return {**_copies(ctx, base), **_other_runs(ctx, base), **_deletes(ctx, base)}


@pytest.fixture(scope="module")
def copies_run(tmp_path_factory):
    """One job of 2 processes for the three tests below (each checks its part)."""
    from _multiprocess import run_processes

    run = run_processes(
        "test_per_host_copies:per_host_copies",
        2,
        devices_per_process=2,
        args={"base": str(tmp_path_factory.mktemp("hosts"))},
        env={"FOP_COORDINATION_TIMEOUT_S": "120", "PYTHONPATH": HERE},
        heartbeat_timeout_s=30,
        timeout_s=150,
    ).check()
    return [proc.result for proc in run.procs]


@pytest.mark.distributed
def test_verify_checks_one_hosts_copy_for_its_own_shards(copies_run):
    """Before: every host's healthy copy was reported damaged (the other host's chunks
    and data iterator state missing), and serving from it raised
    CorruptCheckpointError."""
    for i, r in enumerate(copies_run):
        healthy = r["healthy"]
        verdicts = {k: v[0] for k, v in healthy["results"].items()}
        assert verdicts == {
            "extras": True,
            "params": True,
            "opt_state": True,
            "data_iterator": True,
        }, healthy
        for _, note, _ in healthy["results"].values():
            assert f"process {i}'s own copy" in note and "their own directories" in note, note
        assert healthy["cli_rc"] == 0, healthy["cli"]
        assert "their own directories" in healthy["cli"] and "DAMAGED" not in healthy["cli"]
        assert r["metadata"] == ["b", "w"]
        # Serving from one host's directory: an error naming where the rest lives,
        # never a value made of zeros, nor "damaged".
        for key in ("serve", "restore_item"):
            assert r[key] is not None and r[key].startswith("CheckpointError:"), r[key]
            assert f"process {i}'s own copy of step 1" in r[key], r[key]
            assert "the other hosts' shards live in their own directories" in r[key], r[key]
        # A real damage of this host's own shards is still damage.
        damaged = r["damaged"]["results"]
        assert damaged["params"][0] is False and damaged["opt_state"][0] is True, damaged
        assert damaged["data_iterator"][0] is True, damaged
        assert "'w'" in damaged["params"][2], damaged
        assert r["damaged"]["cli_rc"] != 0 and "DAMAGED  step 1/params" in r["damaged"]["cli"]


@pytest.mark.distributed
def test_every_hosts_directory_is_claimed_for_the_run(copies_run):
    """Before: process 1's directory had no run record, so run B adopted run A's steps
    there (and retention deleted them)."""
    for r in copies_run:
        assert r["recorded"], r
        # Refused on every process, at once (the coordination timeout is 120 s), and
        # run A's steps left as they were.
        assert r["run_b"] is not None and "a1" in r["run_b"] and "run" in r["run_b"], r["run_b"]
        assert r["run_b_s"] < 30, r["run_b_s"]
        assert r["a_steps_after_b"] == ["1", "2", "3"], r
        # A directory of this run without its record (markers of this run): adopted.
        assert r["a_reopened"] == [1, 2, 3] and r["a_restored"] == 3, r
        assert r["re_recorded"], r


@pytest.mark.distributed
def test_a_delete_agrees_across_hosts_before_removing(copies_run):
    """Before: delete(2) with step 2 lost on process 1 removed it on process 0 and
    raised on both."""
    for i, r in enumerate(copies_run):
        # A step no host holds: refused on every process before anything goes.
        assert r["refused"] is not None and "CheckpointNotFoundError" in r["refused"], r
        assert "5" in r["refused"] and "nothing was removed" in r["refused"], r["refused"]
        assert r["after_refused"] == (["1", "2"] if i == 0 else ["1"]), r
        # A step one host lost: removed from every host holding it, no error.
        assert r["delete_2"] is None, r["delete_2"]
        assert r["after_delete"] == ["1"] and r["steps"] == [1], r


def _mark(step_dir: str, held) -> None:
    """Writes a host marker saying this copy holds ``held`` (process 0 of 2)."""
    from flax_orbax_plugin._manager import per_host

    marker = json.loads(per_host.host_marker(1, "ab" * 16, "a layout", None, held))
    marker["process_count"] = 2
    with open(os.path.join(step_dir, per_host.HOST_FILE), "w") as f:
        json.dump(marker, f)


def test_the_held_regions_of_a_marker_are_checked_where_read(tmp_path):
    """A marker's ``held`` names regions of the leaf that verify reads (and a region
    outside the leaf, or a malformed ``held``, is damage named), and a restore of the
    copy alone is refused, naming the leaf held in part."""
    directory = str(tmp_path / "run")
    with fop.CheckpointManager(directory) as mngr:
        mngr.save(1, {"params": {"w": np.arange(32.0).reshape(8, 4), "b": np.ones(3)}})
    step_dir = os.path.join(directory, "1")
    _mark(step_dir, {"sets": [[[[0, 4], [0, 4]]]], "items": {"params": {"w": 0}}})
    (result,) = fop.verify(directory)
    assert result.ok and "process 0's own copy" in result.note, result
    with pytest.raises(fop.CheckpointError, match=r"holds only that process's shards .*'w'"):
        fop.restore_params(directory)
    _mark(step_dir, {"sets": [[[[0, 9], [0, 4]]]], "items": {"params": {"w": 0}}})
    (result,) = fop.verify(directory)
    assert not result.ok and "field held" in result.error and "'w'" in result.error, result
    _mark(step_dir, {"sets": [[[[4, 2], [0, 4]]]], "items": {}})
    (result,) = fop.verify(directory)
    assert not result.ok and result.item is None and "field held" in result.error, result
