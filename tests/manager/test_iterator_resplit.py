"""A data position saved on N processes resumes on M with the same global sample order
(issue 54 item 1): iterators whose position is a global index (StepIndexedIterator,
grain's ElasticIterator) re-split; others are refused naming why.

Real processes (jax.distributed on 127.0.0.1, gloo): a first job of N processes draws
SAVE_AT global batches and saves; a second job of M processes restores and draws the
rest. Each process records the sample ids it drew; the global batch of each step (the
processes' parts together) is compared with an uninterrupted one-process run's.
"""

from __future__ import annotations

import json
import os

import pytest
from _multiprocess import run_processes

import flax_orbax_plugin as fop

GLOBAL_BATCH = 4  # divisible by 1, 2 and 4 processes
SAVE_AT = 3
TOTAL = 6
SAMPLES = 64


def _sample(k: int) -> int:
    """The k-th sample of the global stream (a fixed shuffle of range(SAMPLES))."""
    return (k * 37 + 11) % SAMPLES


def _make_batch(index: int) -> list[int]:
    """This process's share of global batch ``index``."""
    import jax

    share = GLOBAL_BATCH // jax.process_count()
    first = index * GLOBAL_BATCH + jax.process_index() * share
    return [_sample(k) for k in range(first, first + share)]


def _iterator(kind: str):
    import jax

    if kind == "step_indexed":
        return fop.StepIndexedIterator(_make_batch)
    if kind == "grain_elastic":
        import grain

        ds = grain.MapDataset.range(SAMPLES).map(_sample)
        shard = grain.sharding.ShardOptions(
            shard_index=jax.process_index(), shard_count=jax.process_count()
        )
        return iter(grain.experimental.ElasticIterator(ds, GLOBAL_BATCH, shard))
    if kind == "own":  # a position that is each process's own
        return _OwnPosition()
    raise AssertionError(kind)


class _OwnPosition:
    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        return [self.n]

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.n = state["n"]


def phase(ctx, directory, kind, first, last, save):
    """Draws global batches ``first`` .. ``last - 1`` (restoring the position first when
    ``first`` > 0), saves step ``last`` when ``save``; returns what this process drew."""
    import numpy as np

    it = _iterator(kind)
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        if first:
            try:
                mngr.restore(items=("data_iterator",), data_iterator=it)
            except fop.StructureError as e:
                return {"error": str(e)}
        drawn = [[int(x) for x in np.asarray(next(it)).ravel()] for _ in range(first, last)]
        if save:
            mngr.save(last, {"params": {"w": np.zeros(2, np.float32)}}, data_iterator=it)
    return {"drawn": drawn}


def _job(directory, kind, n, first, last, save):
    run = run_processes(
        "test_iterator_resplit:phase",
        n,
        devices_per_process=1,
        args={"directory": directory, "kind": kind, "first": first, "last": last, "save": save},
        timeout_s=120,
    )
    for p in run.procs:
        assert p.ok, p.describe()
    return [p.result for p in run.procs]


def _global_batches(results) -> list[list[int]]:
    """Each step's global batch: the processes' parts, as a sorted list (grain's elastic
    iterator deals a batch out round robin, StepIndexedIterator in blocks)."""
    steps = len(results[0]["drawn"])
    return [sorted(x for r in results for x in r["drawn"][s]) for s in range(steps)]


def _uninterrupted() -> list[list[int]]:
    stream = [_sample(k) for k in range(TOTAL * GLOBAL_BATCH)]
    return [sorted(stream[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH]) for s in range(TOTAL)]


def _kinds():
    kinds = ["step_indexed"]
    try:
        import grain

        grain.experimental.ElasticIterator  # noqa: B018
        kinds.append("grain_elastic")
    except (ImportError, AttributeError):
        pass
    return kinds


@pytest.mark.parametrize("kind", _kinds())
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4)])
def test_global_position_resumes_on_another_process_count(tmp_path, kind, before, after):
    directory = str(tmp_path / "run")
    first = _job(directory, kind, before, 0, SAVE_AT, True)
    second = _job(directory, kind, after, SAVE_AT, TOTAL, False)
    batches = _global_batches(first) + _global_batches(second)
    assert batches == _uninterrupted()
    drawn = [x for b in batches for x in b]
    assert len(drawn) == len(set(drawn)) == TOTAL * GLOBAL_BATCH  # none repeated or skipped
    # the saved files record the global position beside each process's state
    for p in range(before):
        with open(os.path.join(directory, str(SAVE_AT), "data_iterator", f"process_{p}.json")) as f:
            record = json.load(f)
        expected = SAVE_AT if kind == "step_indexed" else SAVE_AT * GLOBAL_BATCH
        assert record["global_position"] == expected


def test_per_process_position_is_still_refused_naming_why(tmp_path):
    directory = str(tmp_path / "run")
    _job(directory, "own", 2, 0, SAVE_AT, True)
    (result,) = _job(directory, "own", 1, SAVE_AT, TOTAL, False)
    assert "saved by 2 process(es) but 1 are restoring" in result["error"]
    assert "declared no global position" in result["error"]
    assert "StepIndexedIterator" in result["error"]


def _files(*positions):
    return lambda i: {"state": {"index": positions[i]}, "global_position": positions[i]}


def test_processes_that_saved_different_global_positions_are_refused():
    from flax_orbax_plugin._manager.checkpointables import position_across_counts

    it = fop.StepIndexedIterator(_make_batch)
    read = _files(3, 4)
    with pytest.raises(fop.StructureError, match=r"differ \(process 0: 3, process 1: 4\)"):
        position_across_counts("d", it, saved=2, restoring=4, process=1, read=read)
    # process 2 of 4 has no file of its own: process 0's position
    assert position_across_counts("d", it, saved=2, restoring=4, process=2, read=read) == 3


def test_an_iterator_without_set_global_position_cannot_take_a_global_one():
    from flax_orbax_plugin._manager.checkpointables import position_across_counts

    with pytest.raises(fop.StructureError, match="_OwnPosition.*no set_global_position"):
        position_across_counts("d", _OwnPosition(), saved=2, restoring=1, process=0, read=_files(3))


def test_a_damaged_global_position_is_named():
    from flax_orbax_plugin._manager.checkpointables import position_across_counts

    def read(i):
        return {"state": {}, "global_position": -1}

    with pytest.raises(fop.CorruptCheckpointError, match="process_0.json.*non-negative"):
        position_across_counts("d", None, saved=2, restoring=1, process=0, read=read)
