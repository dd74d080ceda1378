"""The manager's methods pass one entry each (``_base.distributed.public``: on the class,
and on each collective method with its kind): a misspelt keyword names the one meant,
a collective method's region takes the manager's stall timeout and scope, the hook
guard runs before any region, and a user's subclass of the manager still works."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import distributed as _distributed


def _state(v):
    return {"params": {"w": np.full((4,), float(v), np.float32)}}


def test_a_users_subclass_of_the_manager_still_works(tmp_path):
    class Counting(fop.CheckpointManager):
        saves = 0

        def save(self, step, state=None, **kwargs):
            Counting.saves += 1
            return super().save(step, state, **kwargs)

    with Counting(tmp_path / "run", keep=2, async_save=False) as mngr:
        assert mngr.save(1, _state(1))
        with pytest.raises(TypeError, match=r"save\(\) got .* 'overwrit': did you mean overwrite="):
            mngr.save(2, _state(2), overwrit=True)
        assert mngr.save(2, _state(2))
        assert mngr.steps() == [1, 2]
        np.testing.assert_array_equal(mngr.restore(step=1)["params"]["w"], np.ones(4))
        with pytest.raises(TypeError, match=r"wrap_step\(\) got .* did you mean donate_argnums="):
            mngr.wrap_step(lambda s: s, donate_argnum=0)
    assert Counting.saves == 3


def test_a_collective_method_draws_its_region_with_the_managers_stall_and_scope(
    tmp_path, monkeypatch
):
    drawn = []

    @contextlib.contextmanager
    def recording(kind, *, spans=True, stall_s=None, scope=None):
        drawn.append((kind, stall_s, scope))
        yield _distributed.Region(kind)  # one process: a region that spans nothing

    with fop.CheckpointManager(tmp_path / "run", stall_timeout=7.5, async_save=False) as mngr:
        monkeypatch.setattr(_distributed, "collective", recording)
        mngr.save(1, _state(1))
        mngr.restore(step=1)
        mngr.wait()
        mngr.delete(1)
        with pytest.raises(TypeError, match="did you mean step="):
            mngr.restore(stepp=1)  # refused inside the region of the call
        monkeypatch.undo()
    kinds = [kind for kind, _, _ in drawn]
    assert kinds[:4] == ["manager-save", "manager-restore", "manager-wait", "manager-delete"]
    assert kinds[-1] == "manager-restore"
    assert {(stall, scope) for _, stall, scope in drawn} == {(7.5, None)}


def test_the_hook_guard_runs_before_any_region(tmp_path, monkeypatch):
    drawn, refused = [], []

    @contextlib.contextmanager
    def recording(kind, **_):
        drawn.append(kind)
        yield _distributed.Region(kind)

    def hook(event):
        if isinstance(event, fop.SaveCommitted) and not refused:
            monkeypatch.setattr(_distributed, "collective", recording)
            try:
                mngr.save(event.step + 1, _state(0), ignore_policy=True)
            except fop.HookReentryError as e:
                refused.append(str(e))

    with fop.CheckpointManager(tmp_path / "run", on_event=hook, async_save=False) as mngr:
        mngr.save(1, _state(1))
        monkeypatch.undo()
    assert refused and "manager.save()" in refused[0]
    assert drawn == []  # no region drawn on the hook's thread
