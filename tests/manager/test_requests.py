"""Every item gets the step's modes as its request, through the public protocol: a
custom checkpointable as the built-ins (no special case for a built-in)."""

import warnings

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._core import restore as _core_restore
from flax_orbax_plugin._manager.checkpointables import PytreeCheckpointable


class Recording:
    """A pytree item that records the requests it is handed, then does what the
    built-in does with them."""

    kind = "pytree"

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self.saves: list = []
        self.reads: list = []
        self._inner = PytreeCheckpointable()

    def save(self, directory, value, request):
        self.saves.append(request)
        return self._inner.save(directory, value, request)

    def restore(self, directory, like, request):
        self.reads.append(request)
        return self._inner.restore(directory, like, request)


def _state(x: float):
    return {"params": {"w": np.full((4,), x, np.float32)}, "mine": {"v": np.arange(3.0) + x}}


@pytest.mark.parametrize("incremental", [False, True], ids=["plain", "incremental"])
def test_a_custom_item_gets_the_save_request(tmp_path, incremental):
    item = Recording(incremental=True)
    with fop.CheckpointManager(
        tmp_path, async_save=False, incremental=incremental, checkpointables={"mine": item}
    ) as mngr:
        mngr.save(1, _state(1.0))
        mngr.save(2, _state(2.0))
    first, second = item.saves
    assert isinstance(first, fop.SaveRequest) and not first.own_copy
    if incremental:  # the previous step's same item, to reuse from
        assert first.reuse.item == "mine" and first.reuse.previous_step is None
        assert second.reuse.previous_step.name == "1"
    else:
        assert first.reuse is None and second.reuse is None


def test_reuse_goes_only_to_an_item_that_takes_it(tmp_path):
    item = Recording(incremental=False)
    with fop.CheckpointManager(
        tmp_path, async_save=False, incremental=True, checkpointables={"mine": item}
    ) as mngr:
        mngr.save(1, _state(1.0))
    assert item.saves[0].reuse is None


def test_a_changed_model_restore_reaches_a_custom_item(tmp_path):
    """The changes of a restore into a changed model (here partial=True) are in the
    request of every item, a custom one too (they went to the built-in alone)."""
    item = Recording(incremental=False)
    with fop.CheckpointManager(tmp_path, async_save=False, checkpointables={"mine": item}) as m:
        m.save(1, _state(1.0))
        like = {"params": {"w": np.zeros(4, np.float32)}, "mine": {"v": np.zeros(3)}}
        out = m.restore(like=like, partial=True, missing="keep")
    (read,) = item.reads
    assert isinstance(read, fop.ReadRequest)
    assert read.changes.partial and read.changes.missing == "keep"
    np.testing.assert_array_equal(out["mine"]["v"], np.arange(3.0) + 1.0)
    np.testing.assert_array_equal(out["params"]["w"], np.full((4,), 1.0, np.float32))


def test_a_two_argument_checkpointable_still_works_and_is_deprecated(tmp_path):
    class Old:
        kind = "notes"

        def save(self, directory, value):
            class Done:
                def wait(self):
                    directory.write_bytes("notes.txt", value.encode())

            return Done()

        def restore(self, directory, like):
            return directory.read_bytes("notes.txt").decode()

    with fop.CheckpointManager(tmp_path, async_save=False, checkpointables={"notes": Old()}) as m:
        with pytest.warns(DeprecationWarning, match="checkpointable Old: save") as caught:
            m.save(1, {"notes": "hello", **_state(1.0)})
        assert caught[0].filename == __file__  # names the user's call
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            assert m.restore(step=1, items="notes") == "hello"


def test_the_cast_policy_is_the_reads_own(tmp_path):
    """Two reads of one checkpoint with different cast policies, interleaved on one
    thread: each keeps its own (the policy is the request's, not the thread's)."""
    fop.save(tmp_path / "c", {"x": np.array([1.5, 300.0], np.float32)})
    unsafe = fop.ReadRequest(cast="unsafe")
    safe = fop.ReadRequest()
    like = {"x": np.zeros(2, np.int8)}
    out = _core_restore.restore_with(tmp_path / "c", like, unsafe)
    assert out["x"].dtype == np.int8
    with pytest.raises(fop.StructureError, match="float to integer"):
        _core_restore.restore_with(tmp_path / "c", like, safe)
    with pytest.raises(ValueError, match="cast must be one of"):
        fop.ReadRequest(cast="maybe")


def test_requests_are_frozen():
    with pytest.raises(AttributeError):
        fop.SaveRequest().own_copy = True
    with pytest.raises(ValueError, match="own_copy needs created_at"):
        fop.SaveRequest(own_copy=True)
