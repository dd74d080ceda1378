"""Each host's own directory is one host's copy of a step, not a whole checkpoint:
verify checks what that copy is meant to hold (its own host's shards) and says the
others live elsewhere, and serving from it alone is refused naming where the rest lives.
Real processes, separate directories, a shared local directory as the persistent tier.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import numpy as np
import pytest

import flax_orbax_plugin as fop

HERE = os.path.dirname(os.path.abspath(__file__))  # this module, for child processes
WAIT_S = 60


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


def per_host_copies(ctx, base):
    """Every case in one job of 2 processes."""
    return _copies(ctx, base)


@pytest.fixture(scope="module")
def copies_run(tmp_path_factory):
    """One job of 2 processes for the tests below (each checks its part)."""
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
