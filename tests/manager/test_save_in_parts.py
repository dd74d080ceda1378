"""A step saved in parts, from several calls, commits once (issue 54 item 4).

``manager.step_parts(step, expect=...)``: each part's blocking phase into one staging
place; the last expected part starts the one commit; a step left unfinished (the
block ended, an error, a SIGKILL of the process) is never listed, counted or restored,
and what it staged goes (at once, or at the next writer's open). Several processes
each save every part and the step commits once, agreed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
from _multiprocess import run_processes
from _proc import child_env, read_line, wait

import flax_orbax_plugin as fop
from flax_orbax_plugin._storage.location import Location


def _commits(events: list) -> list[int]:
    return [e.step for e in events if type(e).__name__ == "SaveCommitted"]


def _entries(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if not n.startswith(".writer"))


def _stores(tmp_path):
    return [str(tmp_path / "run"), f"memory://parts-{uuid.uuid4().hex}/run"]


@pytest.mark.parametrize("store", ["local", "memory"])
def test_parts_from_several_calls_commit_once_and_restore(tmp_path, store):
    directory = _stores(tmp_path)[store == "memory"]
    events: list = []
    with fop.CheckpointManager(directory, on_event=events.append) as mngr:
        mngr.save(1, {"params": {"w": np.zeros(4, np.float32)}})
        mngr.wait()
        parts = mngr.step_parts(2, expect=("params", "opt_state", "extras"))  # no `with`
        w = np.arange(4, dtype=np.float32)
        parts.save("params", {"w": w})
        w += 100  # changed after its part returned: the saved value stays
        # Unfinished: never listed, counted or restored.
        assert mngr.steps() == [1] and mngr.all_steps() == [1]
        assert mngr.latest_step() == 1
        assert mngr.restore(items="params")["w"].tolist() == [0, 0, 0, 0]
        with pytest.raises(fop.CheckpointNotFoundError):
            mngr.restore(step=2)
        parts.save("extras", {"loss": 0.5})
        assert parts.missing == ("opt_state",) and parts.open
        assert _commits(events) == [1]
        parts.save("opt_state", {"mu": np.ones(3, np.float32)})
        assert not parts.open
        mngr.wait()
        assert mngr.steps() == [1, 2] and _commits(events) == [1, 2]
        got = mngr.restore()
    assert got["params"]["w"].tolist() == [0, 1, 2, 3]
    assert got["opt_state"]["mu"].tolist() == [1, 1, 1]
    assert got["extras"] == {"loss": 0.5}
    with fop.CheckpointManager(directory, read_only=True) as again:
        assert again.steps() == [1, 2]


@pytest.mark.parametrize("store", ["local", "memory"])
def test_block_left_with_parts_missing_commits_nothing_and_removes_its_staging(tmp_path, store):
    directory = _stores(tmp_path)[store == "memory"]
    events: list = []
    with fop.CheckpointManager(directory, on_event=events.append) as mngr:
        mngr.save(1, {"params": {"w": np.zeros(2, np.float32)}})
        mngr.wait()
        with pytest.raises(fop.CheckpointError, match=r"parts missing: \['opt_state'\]"):
            with mngr.step_parts(2, expect=("params", "opt_state")) as parts:
                parts.save("params", {"w": np.ones(2, np.float32)})
        assert not parts.open and mngr.steps() == [1] and mngr.latest_step() == 1
        # An error inside the block: that error goes on, the step is given up too.
        with pytest.raises(ZeroDivisionError):
            with mngr.step_parts(2, expect=("params", "opt_state")) as parts:
                parts.save("params", {"w": np.ones(2, np.float32)})
                1 / 0  # noqa: B018
        with pytest.raises(fop.CheckpointError, match="given up"):
            parts.save("opt_state", {"mu": np.ones(2, np.float32)})
        assert _commits(events) == [1]
        failed = [e for e in events if type(e).__name__ == "SaveFailed"]
        assert [e.step for e in failed] == [2, 2]
        # Nothing staged is left: the directory holds step 1 alone.
        root = Location.from_path(directory)
        assert sorted(n for n in root.list_children() if not n.startswith((".", "_"))) == ["1"]
        # The step can be saved again, whole or in parts.
        with mngr.step_parts(2, expect="params") as parts:
            parts.save("params", {"w": np.full(2, 7, np.float32)})
        mngr.wait()
        assert mngr.steps() == [1, 2]
        assert mngr.restore(items="params")["w"].tolist() == [7, 7]


def test_unknown_or_repeated_part_is_a_clear_error_and_changes_nothing(tmp_path):
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        for expect, match in [
            ((), "at least one"),
            (("params", "params"), "more than once"),
            ((1,), "expected strings"),
            (None, "item names"),
        ]:
            with pytest.raises((fop.CheckpointError, TypeError), match=match):
                mngr.step_parts(3, expect=expect)
        with mngr.step_parts(3, expect=("params", "extras")) as parts:
            with pytest.raises(fop.CheckpointError, match=r"expects the parts.*'opt_stat'"):
                parts.save("opt_stat", {"mu": np.ones(2)})
            parts.save("params", {"w": np.ones(2)})
            with pytest.raises(fop.CheckpointError, match="'params' .* saved already"):
                parts.save("params", {"w": np.zeros(2)})
            # Another save of this manager waits for the step's last part.
            with pytest.raises(fop.CheckpointError, match=r"being saved in parts.*'extras'"):
                mngr.save(4, {"params": {"w": np.ones(2)}})
            with pytest.raises(fop.CheckpointError, match="being saved in parts"):
                mngr.step_parts(4, expect="params")
            assert parts.open and parts.saved == ("params",)
            parts.save("extras", {"n": 1})
        mngr.wait()
        assert mngr.steps() == [3]
        assert mngr.restore(items="params")["w"].tolist() == [1, 1]
        with pytest.raises(fop.CheckpointError, match="steps must increase"):
            mngr.step_parts(3, expect="params")


def test_close_with_a_step_open_in_parts_gives_it_up(tmp_path, caplog):
    directory = tmp_path / "run"
    mngr = fop.CheckpointManager(directory)
    parts = mngr.step_parts(1, expect=("params", "extras"))
    parts.save("params", {"w": np.ones(2)})
    mngr.close()
    assert not parts.open and "given up" in caplog.text
    assert _entries(directory) == []


def test_callbacks_manager_saves_in_parts(tmp_path):
    cb = fop.CheckpointCallback(tmp_path / "run", every_steps=10, async_save=False)
    with cb.manager.step_parts(7, expect=("params", "data_iterator")) as parts:
        parts.save("params", {"w": np.arange(3.0)})
        it = fop.StepIndexedIterator(lambda i: [i])
        next(it)
        parts.save("data_iterator", it)
    assert cb.manager.steps() == [7]  # async_save=False: committed on the last part
    cb.close()
    with fop.CheckpointManager(tmp_path / "run", read_only=True) as mngr:
        assert mngr.restore(items="params")["w"].tolist() == [0, 1, 2]


_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import flax_orbax_plugin as fop
    mngr = fop.CheckpointManager(sys.argv[1])
    mngr.save(1, {"params": {"w": np.zeros(4, np.float32)}})
    mngr.wait()
    parts = mngr.step_parts(2, expect=("params", "opt_state"))
    parts.save("params", {"w": np.ones(4, np.float32)})
    mngr.wait_for_save()
    print("between parts", flush=True)
    time.sleep(120)
    """
)


def test_sigkill_between_parts_leaves_nothing_listed_and_next_open_cleans_up(tmp_path):
    directory = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert read_line(proc, 60) == "between parts"
        staged = [n for n in _entries(directory) if n.startswith("2.")]
        assert staged, _entries(directory)  # the step is staged, under its pending marker
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        wait(proc, 30)
    with fop.CheckpointManager(directory, read_only=True) as reader:
        assert reader.steps() == [1] and reader.latest_step() == 1
        assert reader.restore(items="params")["w"].tolist() == [0, 0, 0, 0]
    with fop.CheckpointManager(directory) as mngr:  # the next writer's open
        assert _entries(directory) == ["1"]
        assert mngr.steps() == [1]
        mngr.save(2, {"params": {"w": np.full(4, 2, np.float32)}})
    assert _entries(directory) == ["1", "2"]


def parts_on_each_process(ctx, directory):
    """Every process saves both parts of step 3, in two calls, a global array sharded
    over the processes among them; returns what each saw."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    full = np.arange(8, dtype=np.float32)
    sharded = NamedSharding(ctx.mesh, P(ctx.mesh.axis_names[0]))
    w = jax.make_array_from_callback(full.shape, sharded, lambda idx: full[idx])
    events: list = []
    with fop.CheckpointManager(directory, on_event=events.append) as mngr:
        with mngr.step_parts(3, expect=("params", "extras")) as parts:
            parts.save("params", {"w": w})
            listed_between = mngr.steps()
            parts.save("extras", {"process_count": jax.process_count()})
        mngr.wait()
        like = {"params": {"w": jax.ShapeDtypeStruct(full.shape, jnp.float32, sharding=sharded)}}
        got = mngr.restore(like, items=("params", "extras"))
        total = float(jax.jit(jnp.sum)(got["params"]["w"]))
        return {
            "between": listed_between,
            "steps": mngr.steps(),
            "commits": _commits(events),
            "total": total,
            "extras": got["extras"],
        }


def test_two_processes_each_saving_the_parts_commit_once(tmp_path):
    directory = str(tmp_path / "run")
    run = run_processes(
        "test_save_in_parts:parts_on_each_process",
        2,
        devices_per_process=1,
        args={"directory": directory},
        timeout_s=120,
    )
    for p in run.procs:
        assert p.ok, p.describe()
    results = [p.result for p in run.procs]
    for r in results:
        assert r["between"] == [] and r["steps"] == [3]
        assert r["commits"] == [3]  # one commit, seen by each
        assert r["total"] == float(np.arange(8).sum()) and r["extras"] == {"process_count": 2}
    manifest = Location.from_path(directory).child("3")
    assert sorted(n for n in manifest.list_children() if not n.startswith("_")) == [
        "extras",
        "params",
    ]
    assert _entries(directory) == ["3"]
