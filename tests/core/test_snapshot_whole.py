"""One Snapshot that is not the Plan (issue 52, item 3): ``Plan.build`` makes a frozen
plan, ``Plan.snapshot`` a frozen Snapshot (this process's host copy) that the
background phase writes once; nothing is set into either after it is built."""

import dataclasses

import numpy as np
import pytest

from flax_orbax_plugin._base.host_memory import BufferPool
from flax_orbax_plugin._core import plan as _plan
from flax_orbax_plugin._core.formats import SaveRequest
from flax_orbax_plugin._storage.location import Location


def test_the_plan_snapshots_into_a_frozen_snapshot_that_hands_its_copy_on(tmp_path):
    tree = {"w": np.arange(1 << 19, dtype=np.float32), "b": np.float32(2.0), "s": "text"}
    pool = BufferPool()
    plan = _plan.Plan.build(tree, SaveRequest(buffers=pool))
    snap = plan.snapshot()
    assert type(snap) is _plan.Snapshot and not isinstance(snap, _plan.Plan)
    for built, field in ((plan, "digest"), (snap, "write_first"), (snap, "batch_data")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(built, field, None)
    assert (snap.leaves, snap.digest, snap.format) == (plan.leaves, plan.digest, plan.format)
    assert snap.batch_data and snap.pooled and not snap.write_first  # the pool's buffers
    assert str(snap.staging) == "none" and not snap.data_written.is_set()

    (tmp_path / "ckpt").mkdir()
    written = snap.write(Location.from_path(tmp_path / "ckpt"))
    assert snap.data_written.is_set() and written.bytes_written >= tree["w"].nbytes
    assert (tmp_path / "ckpt" / "_METADATA.json").is_file()
    # what it held is handed on: batches taken, buffers given back, views dropped
    assert not snap.batch_data and not snap.pooled
    assert all(not leaf.writes for leaf in snap.leaves)
