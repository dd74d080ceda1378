"""A user's checkpointable where its values enter the manager: the object (at open),
what its ``save`` returns (at the save), what its ``Pending.wait()`` returns (at the
commit), and the kind a step recorded for it (at a restore by a manager that lacks it:
a configuration error, never damage)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import flax_orbax_plugin as fop


class Done:
    def __init__(self, fn):
        self.fn = fn

    def wait(self):
        return self.fn()


class Notes:
    """A JSON note, written by the documented protocol."""

    kind = "notes"

    def save(self, directory, value, request):
        data = json.dumps(value).encode()

        def write():
            directory.makedirs()
            directory.write_bytes("notes.json", data, durable=False)
            return fop.Written(len(data), {})

        return Done(write)

    def restore(self, directory, like, request):
        return json.loads(directory.read_bytes("notes.json"))


def _state(step):
    return {"params": {"w": np.full(3, step, np.float32)}, "notes": {"step": step}}


def test_a_restart_without_the_checkpointable_sets_nothing_aside(tmp_path):
    with fop.CheckpointManager(tmp_path, checkpointables={"notes": Notes()}) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, _state(step))
    with fop.CheckpointManager(tmp_path) as mngr:  # the option forgotten on restart
        with pytest.raises(
            fop.CheckpointError, match=r"item 'notes' of step 3 .* kind 'notes'"
        ) as e:
            mngr.restore()
        assert not isinstance(e.value, fop.CorruptCheckpointError)
        assert "checkpointables={'notes': " in str(e.value)
        np.testing.assert_array_equal(mngr.restore(items="params")["w"], np.full(3, 3))
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["1", "2", "3"]
    with fop.CheckpointManager(tmp_path, checkpointables={"notes": Notes()}) as mngr:
        assert mngr.restore()["notes"] == {"step": 3}


class ReturnsNone(Notes):
    def save(self, directory, value, request):
        super().save(directory, value, request).wait()


class WaitReturnsDict(Notes):
    def save(self, directory, value, request):
        inner = super().save(directory, value, request)
        return Done(lambda: (inner.wait(), {"bytes": 3})[1])


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_save_that_returns_no_pending_is_refused_at_the_save(tmp_path, async_save):
    with fop.CheckpointManager(
        tmp_path, async_save=async_save, checkpointables={"notes": ReturnsNone()}
    ) as mngr:
        with pytest.raises(
            fop.CheckpointError, match=r"item 'notes': ReturnsNone.save returned No"
        ):
            mngr.save(1, _state(1))
        assert mngr.steps() == []


def test_a_wait_that_returns_another_type_is_refused_at_the_commit(tmp_path):
    with fop.CheckpointManager(
        tmp_path, async_save=False, checkpointables={"notes": WaitReturnsDict()}
    ) as mngr:
        with pytest.raises(
            fop.CheckpointError, match=r"item 'notes': Pending.wait\(\) returned di"
        ):
            mngr.save(1, _state(1))
        assert mngr.steps() == []


def test_a_kind_that_is_no_string_is_refused_at_open(tmp_path):
    bad = Notes()
    bad.kind = 3
    with pytest.raises(
        TypeError, match=r"checkpointables\[.notes.\]: expected a Checkpointable .*found kind int 3"
    ):
        fop.CheckpointManager(tmp_path, checkpointables={"notes": bad})


def test_a_closed_manager_is_said_closed_where_it_is_reused(tmp_path):
    mngr = fop.CheckpointManager(tmp_path)
    mngr.close()
    mngr.close()  # twice: fine
    with pytest.raises(fop.CheckpointError, match=r"manager on .* is closed"):
        with mngr:
            pass
    with pytest.raises(fop.CheckpointError, match=r"is closed"):
        mngr.save(1, _state(1))


def test_extras_that_are_no_dict_are_refused_at_the_save(tmp_path):
    with fop.CheckpointManager(tmp_path, async_save=False) as mngr:
        with pytest.raises(fop.OptionTypeError, match=r"expected a dict .*found list"):
            mngr.save(1, {"params": {"w": np.ones(2)}}, extras=[1, 2])
        with pytest.raises(fop.OptionTypeError, match=r"found str"):
            mngr.save(1, {"params": {"w": np.ones(2)}}, extras=lambda: "loss=1")
        assert mngr.save(1, {"params": {"w": np.ones(2)}}, extras=lambda: {"loss": 1.0})


class CoreTree:
    """A user's checkpointable whose save and restore are ``fop.save`` and ``fop.restore``:
    public collective calls made inside a manager's save and restore (each draws a
    collective region of its own, ``_base/regions.py``)."""

    kind = "core-tree"

    def save(self, directory, value, request):
        fop.save(f"{directory}/tree", value)
        return Done(lambda: None)

    def restore(self, directory, like, request):
        return fop.restore(f"{directory}/tree", like)


def nested_public_calls(ctx, directory):
    """Two processes: a manager step whose item is saved and restored by ``CoreTree``."""
    import numpy as np
    from _mp_workers import make_state

    state = make_state(ctx, 1)
    with fop.CheckpointManager(directory, checkpointables={"tree": CoreTree()}) as mngr:
        mngr.save(1, {"tree": state["params"]})
        mngr.wait()
        got = mngr.restore({"tree": state["params"]})["tree"]
    same = all(
        np.array_equal(np.asarray(a.data), np.asarray(b.data))
        for name, saved in state["params"].items()
        for a, b in zip(got[name].addressable_shards, saved.addressable_shards, strict=True)
    )
    return {"same": same}


def test_a_checkpointable_may_call_public_collectives_with_several_processes(tmp_path):
    from _multiprocess import run_processes

    started = time.perf_counter()
    result = run_processes(
        "test_custom_checkpointables:nested_public_calls",
        2,
        args={"directory": str(tmp_path / "run")},
        env={"FOP_COORDINATION_TIMEOUT_S": "120"},
        timeout_s=120,
    ).check()
    assert [r["same"] for r in result.results] == [True, True]
    assert time.perf_counter() - started < 60  # no wait ran to its stall timeout
