"""Checkpoint events (``on_event=``): their order and threads across a run, figures
checked against the files on disk, a hook that raises, ``jax.monitoring`` and a real
CLU metric writer."""

import collections
import contextlib
import logging
import os
import signal
import threading

import _docs
import jax.monitoring
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import env as _env
from flax_orbax_plugin._manager.events import MONITORING_NAMES

pytest_plugins = ["_servers"]


def tree(value: float = 0.0):
    return {"params": {"w": np.arange(3000.0) + value, "b": np.ones(7, np.float32)}}


class Recorder:
    """An on_event hook noting each event and the thread that delivered it."""

    def __init__(self, fail_on=None):
        self.events, self.threads, self._fail_on = [], [], fail_on

    def __call__(self, event):
        self.events.append(event)
        self.threads.append(threading.current_thread().name)
        if self._fail_on is not None and self._fail_on(event):
            raise RuntimeError(f"hook broke on {type(event).__name__}")

    def kinds(self):
        return [(type(e).__name__, e.step) for e in self.events]


def on_disk(path) -> tuple[int, int]:
    """(files, bytes) under ``path``, walked here."""
    files = size = 0
    for root, _, names in os.walk(path):
        for name in names:
            files += 1
            size += os.lstat(os.path.join(root, name)).st_size
    return files, size


def steps_on_disk(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))  # not the lock


def test_events_arrive_in_order_on_their_threads_across_a_run(tmp_path, monkeypatch):
    """Async saves, a save failing in its background phase (FOP_FAIL_AT), a blocking
    phase failing, then a restore: every event in the documented order and thread."""
    rec = Recorder()
    d = tmp_path / "run"
    with fop.CheckpointManager(d, on_event=rec) as mngr:
        mngr.save(1, tree(1))
        mngr.save(2, tree(2))
        mngr.wait()
        # The 2nd small file write fails: past the staging claim, in the background.
        monkeypatch.setattr(_env, "_HITS", collections.Counter())
        monkeypatch.setenv("FOP_FAIL_AT", "write_small:2")
        mngr.save(3, tree(3))
        with pytest.raises(OSError, match="injected fault at write_small"):
            mngr.wait()
        # The 1st fails: the staging claim, in the blocking phase.
        monkeypatch.setattr(_env, "_HITS", collections.Counter())
        monkeypatch.setenv("FOP_FAIL_AT", "write_small")
        with pytest.raises(OSError, match="injected fault at write_small"):
            mngr.save(4, tree(4))
        monkeypatch.delenv("FOP_FAIL_AT")
        mngr.save(5, tree(5))
        mngr.wait()
        restored = mngr.restore()
    np.testing.assert_array_equal(restored["params"]["w"], tree(5)["params"]["w"])
    assert rec.kinds() == [
        ("SaveStarted", 1),
        ("SaveBlockingDone", 1),
        ("SaveCommitted", 1),
        ("SaveStarted", 2),
        ("SaveBlockingDone", 2),
        ("SaveCommitted", 2),
        ("SaveStarted", 3),
        ("SaveBlockingDone", 3),
        ("SaveFailed", 3),
        ("SaveStarted", 4),
        ("SaveFailed", 4),
        ("SaveStarted", 5),
        ("SaveBlockingDone", 5),
        ("SaveCommitted", 5),
        ("RestoreDone", 5),
    ]
    main = threading.main_thread().name
    for event, thread in zip(rec.events, rec.threads, strict=True):
        background = isinstance(event, fop.SaveCommitted) or (
            isinstance(event, fop.SaveFailed) and event.phase == "background"
        )
        assert thread == ("fop-save" if background else main), (event, thread)
    failed3, failed4 = (e for e in rec.events if isinstance(e, fop.SaveFailed))
    assert (failed3.phase, failed3.error_type) == ("background", "InjectedFault")
    assert "injected fault at write_small" in failed3.message
    assert (failed4.phase, failed4.error_type) == ("blocking", "InjectedFault")
    done = rec.events[-1]
    assert (done.tier, done.items, done.directory) == ("local", ("params",), str(d))
    assert done.seconds > 0
    assert steps_on_disk(d) == ["1", "2", "5"]  # the failed steps left nothing


@pytest.mark.parametrize("format_version", [1, 2])
def test_save_and_restore_counts_are_the_files_on_disk(tmp_path, format_version):
    rec = Recorder()
    d = tmp_path / "run"
    it = fop.StepIndexedIterator(lambda i: i)
    with fop.CheckpointManager(d, format_version=format_version, on_event=rec) as mngr:
        mngr.save(1, tree(1), data_iterator=it, extras={"loss": 0.5})
        mngr.wait()
        mngr.restore(items=("params",))
        mngr.restore(data_iterator=it)
    committed = next(e for e in rec.events if isinstance(e, fop.SaveCommitted))
    assert (committed.files_written, committed.bytes_written) == on_disk(d / "1")
    assert committed.array_bytes == 3000 * 8 + 7 * 4
    assert committed.gigabytes_per_second == pytest.approx(
        committed.bytes_written / committed.background_seconds / 1e9
    )
    assert committed.total_seconds == pytest.approx(
        committed.blocking_seconds + committed.background_seconds
    )
    params_only, everything = (e for e in rec.events if isinstance(e, fop.RestoreDone))
    assert params_only.items == ("params",)
    assert (params_only.files_read, params_only.bytes_read) == on_disk(d / "1" / "params")
    assert set(everything.items) == {"params", "extras", "data_iterator"}
    parts = [on_disk(d / "1" / name) for name in everything.items]
    assert everything.files_read == sum(p[0] for p in parts)
    assert everything.bytes_read == sum(p[1] for p in parts)


def test_an_object_store_step_counts_its_objects(s3_location):
    rec = Recorder()
    with fop.CheckpointManager(s3_location.url, on_event=rec) as mngr:
        mngr.save(1, tree(1))
    committed = next(e for e in rec.events if isinstance(e, fop.SaveCommitted))
    assert committed.files_written == len(s3_location.join("1").keys())
    assert committed.bytes_written is None  # the listing gives no sizes: not guessed
    assert committed.array_bytes == 3000 * 8 + 7 * 4


def test_retention_replication_and_a_restore_from_the_persistent_tier(tmp_path):
    rec = Recorder()
    remote = tmp_path / "remote"
    options = dict(keep=1, persistent=fop.Tier(remote, keep=2), on_event=rec)
    with fop.CheckpointManager(tmp_path / "a", **options) as m:
        for step in (1, 2):
            m.save(step, tree(step))
            m.wait()
            m.persistent.wait()  # replicated: local retention may delete it
        m.save(3, tree(3))
        m.wait()
    removed = [(e.step, e.removed, e.tier) for e in rec.events if isinstance(e, fop.StepsRemoved)]
    assert [r for r in removed if r[2] == "local"] == [(2, (1,), "local"), (3, (2,), "local")]
    assert [r for r in removed if r[2] == "persistent"] == [(3, (1,), "persistent")]
    for event, thread in zip(rec.events, rec.threads, strict=True):
        if isinstance(event, fop.StepsRemoved):
            want = "fop-retention" if event.tier == "local" else "fop-replicate"
            assert thread.startswith(want), (event, thread)
    replicated = [e for e in rec.events if isinstance(e, fop.StepReplicated)]
    assert [e.step for e in replicated] == [1, 2, 3]
    assert rec.threads[rec.events.index(replicated[0])] == "fop-replicate"
    kinds = rec.kinds()
    for step in (1, 2, 3):  # committed here first, then copied
        assert kinds.index(("SaveCommitted", step)) < kinds.index(("StepReplicated", step))
    last = replicated[-1]
    assert last.directory == str(remote)
    assert (last.files_written, last.bytes_written) == on_disk(remote / "3")
    assert 0 < last.bytes_copied <= last.bytes_written
    rec2 = Recorder()
    with fop.CheckpointManager(tmp_path / "b", persistent=remote, on_event=rec2) as m:
        m.restore()
        m.restore()  # copied down by the first: local now
    first, second = (e for e in rec2.events if isinstance(e, fop.RestoreDone))
    assert (first.step, first.tier, second.tier) == (3, "persistent", "local")


def test_a_failed_replication_is_an_event(tmp_path, monkeypatch):
    """FOP_FAIL_AT=replicate_file: every copy attempt fails; once the retries are spent
    the tier reports SaveFailed (phase "replication") and wait() raises as before."""
    rec = Recorder()
    monkeypatch.setattr(_env, "_HITS", collections.Counter())
    monkeypatch.setenv("FOP_FAIL_AT", "replicate_file")
    monkeypatch.setattr("flax_orbax_plugin._manager.tiers.replicator.RETRY_DELAY_S", 0.0)
    m = fop.CheckpointManager(tmp_path / "a", persistent=tmp_path / "remote", on_event=rec)
    m.save(1, tree(1))
    m.wait()
    with pytest.raises(fop.ReplicationError):
        m.persistent.wait()
    monkeypatch.delenv("FOP_FAIL_AT")
    m.close()
    (failed,) = [e for e in rec.events if isinstance(e, fop.SaveFailed)]
    assert (failed.step, failed.phase, failed.error_type) == (1, "replication", "ReplicationError")
    assert failed.directory == str(tmp_path / "remote")
    assert "injected fault at replicate_file" in failed.message


def test_a_hook_that_raises_loses_no_step_and_is_raised_at_the_next_call(tmp_path, caplog):
    rec = Recorder(fail_on=lambda e: isinstance(e, fop.SaveCommitted) and e.step == 1)
    d = tmp_path / "run"
    mngr = fop.CheckpointManager(d, on_event=rec)
    with caplog.at_level(logging.ERROR, logger="flax_orbax_plugin"):
        mngr.save(1, tree(1))
        with pytest.raises(fop.EventHookError, match="SaveCommitted of step 1") as info:
            mngr.wait()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert isinstance(info.value.event, fop.SaveCommitted)
    assert any("on_event hook raised RuntimeError" in r.getMessage() for r in caplog.records)
    assert mngr.steps() == [1]  # committed all the same
    mngr.wait()  # raised once
    mngr.save(2, tree(2))  # the run goes on
    mngr.close()
    assert steps_on_disk(d) == ["1", "2"]
    assert [k for k in rec.kinds() if k[0] == "SaveCommitted"] == [
        ("SaveCommitted", 1),
        ("SaveCommitted", 2),
    ]


def test_a_hook_error_is_raised_by_the_next_save_and_by_close_once_closed(tmp_path):
    rec = Recorder(fail_on=lambda e: isinstance(e, fop.SaveCommitted))
    d, remote = tmp_path / "run", tmp_path / "remote"
    mngr = fop.CheckpointManager(d, persistent=remote, every_steps=2, on_event=rec)
    mngr.save(2, tree(2))
    mngr.pending_save.wait()  # committed; the hook raised on the save's thread
    mngr.persistent.wait()  # replicated (a queued step 2 is superseded by step 4)
    assert mngr.save(3, tree(3)) is False  # not saved by the policy: nothing raised
    with pytest.raises(fop.EventHookError, match="step 2"):
        mngr.save(4, tree(4))  # raised as it returns: step 4 is being saved all the same
    assert mngr.save_in_flight or mngr.last_save.step == 4
    with pytest.raises(fop.EventHookError, match="step 4"):
        mngr.close()  # raised once the tier replicated and the lock was released
    assert fop.CheckpointManager(remote, read_only=True).steps() == [2, 4]
    fop.CheckpointManager(d).close()  # the directory is free again


def test_a_hook_exiting_on_the_save_thread_still_lets_the_step_replicate(tmp_path):
    """SystemExit from the hook on the save's thread: kept like any error, so the
    commit's bookkeeping goes on (the tier copies the step, retention runs)."""

    def hook(event):
        if isinstance(event, fop.SaveCommitted):
            raise SystemExit(3)

    remote = tmp_path / "remote"
    mngr = fop.CheckpointManager(tmp_path / "a", keep=1, persistent=remote, on_event=hook)
    mngr.save(1, tree(1))
    with pytest.raises(fop.EventHookError) as info:
        mngr.wait()
    assert isinstance(info.value.__cause__, SystemExit)
    mngr.persistent.wait()
    assert fop.CheckpointManager(remote, read_only=True).steps() == [1]
    mngr.close()  # raised once, by wait()


def test_the_callback_raises_a_hook_error_at_the_next_step_and_keeps_every_step(tmp_path):
    rec = Recorder(fail_on=lambda e: isinstance(e, fop.SaveCommitted))
    d = tmp_path / "run"
    cb = fop.CheckpointCallback(d, every_steps=2, keep=None, on_event=rec)
    cb.on_step_end(1, tree(1))
    cb.on_step_end(2, tree(2))  # committed; the hook raised on it
    cb.on_step_end(3, tree(3))  # not saved: nothing raised
    with pytest.raises(fop.EventHookError, match="SaveCommitted of step 2"):
        cb.on_step_end(4, tree(4))  # step 4 saved, then raised
    with pytest.raises(fop.EventHookError, match="SaveCommitted of step 4"):
        cb.on_train_end(tree(5), step=5)  # the last step saved, then raised once closed
    assert steps_on_disk(d) == ["2", "4", "5"]
    fop.CheckpointManager(d).close()  # released


def test_a_hook_error_never_stops_the_exit_on_sigterm(tmp_path):
    rec = Recorder(fail_on=lambda e: isinstance(e, fop.SaveCommitted))
    d = tmp_path / "run"
    mngr = fop.CheckpointManager(d, every_steps=1000, handle_sigterm=True, on_event=rec)
    # The hook raises on the commit: here already when the commit came first, else later.
    with contextlib.suppress(fop.EventHookError):
        mngr.save(1000, tree(1))
    if mngr.pending_save is not None:
        mngr.pending_save.wait()
    os.kill(os.getpid(), signal.SIGTERM)  # a real notice, to the manager's handler
    with pytest.raises(SystemExit) as info:
        mngr.save(1001, tree(2))  # saved whatever the policy, closed, exits
    assert info.value.code == 143
    assert steps_on_disk(d) == ["1000", "1001"]
    fop.CheckpointManager(d).close()  # closed and released


def test_jax_monitoring_listeners_receive_the_events(tmp_path):
    seen = []

    def on_event(event, **kw):
        seen.append(("event", event, None, kw))

    def on_duration(event, duration, **kw):
        seen.append(("duration", event, duration, kw))

    def on_scalar(event, value, **kw):
        seen.append(("scalar", event, value, kw))

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_scalar_listener(on_scalar)
    try:
        with fop.CheckpointManager(tmp_path / "run", keep=1) as mngr:  # no hook needed
            mngr.save(1, tree(1))
            mngr.save(2, tree(2))
            mngr.wait()
            mngr.restore()
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_scalar_listener(on_scalar)
    ours = [s for s in seen if s[1].startswith("/flax_orbax_plugin/")]
    n = MONITORING_NAMES
    names = [(kind, name, kw["step"]) for kind, name, _, kw in ours]
    for step in (1, 2):
        assert names.index(("event", n["save_started"], step)) < names.index(
            ("duration", n["save_blocking_secs"], step)
        )
        assert ("event", n["save_committed"], step) in names
        assert ("duration", n["save_background_secs"], step) in names
    assert ("event", n["step_removed"], 1) in names
    assert ("duration", n["restore_secs"], 2) in names
    files, size = on_disk(tmp_path / "run" / "2")
    values = {(name, kw["step"]): value for kind, name, value, kw in ours if kind == "scalar"}
    assert values[(n["save_bytes"], 2)] == size
    assert values[(n["save_files"], 2)] == files


def test_options_are_checked(tmp_path):
    with pytest.raises(fop.OptionTypeError, match="on_event"):
        fop.CheckpointManager(tmp_path / "a", on_event="print")
    with pytest.raises(fop.OptionTypeError, match="on_event"):
        fop.CheckpointCallback(tmp_path / "b", on_event=3)
    with pytest.raises(fop.OptionError, match="on_event"):
        fop.CheckpointCallback(tmp_path / "c", manager_options={"on_event": print})
    with pytest.raises(TypeError, match="write_scalars"):
        fop.MetricWriterEvents(object())


def readme_snippet(containing: str) -> str:
    """docs/events.md's block this test is named for."""
    code = _docs.run_by(
        "tests/manager/test_events.py::test_clu_summary_writer_gets_the_figures_beside_the_loss"
    )
    assert containing in code
    return code


def test_clu_summary_writer_gets_the_figures_beside_the_loss(tmp_path, caplog):
    """docs/events.md's snippet, verbatim: the callback's events through the adapter into a
    real CLU SummaryWriter; the TensorBoard event file read back with TensorFlow's own
    reader. The save's thread writes to the writer while the loop writes the loss."""
    # Imported here: TensorFlow takes seconds to import, and only this test needs it.
    import tensorflow as tf

    logdir, directory = tmp_path / "logs", tmp_path / "run"
    names = dict(fop=fop, logdir=str(logdir), directory=str(directory), num_steps=200)
    names.update(state=tree(0), train_step=lambda state, step: (state, 1.0 / step))
    with caplog.at_level(logging.DEBUG, logger="flax_orbax_plugin"):
        exec(compile(readme_snippet("MetricWriterEvents"), "docs/events.md", "exec"), names)
    committed_lines = [r for r in caplog.records if "committed step" in r.getMessage()]
    assert committed_lines and {r.levelno for r in committed_lines} == {logging.DEBUG}
    found = {}
    for path in logdir.iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                found[(value.tag, event.step)] = float(tf.make_ndarray(value.tensor))
    for step in (100, 200):
        assert found[("loss", step)] == pytest.approx(1.0 / step)
        assert found[("checkpoint/save_blocking_seconds", step)] > 0
        assert found[("checkpoint/save_background_seconds", step)] > 0
        assert found[("checkpoint/save_gbytes_per_sec", step)] > 0
        files, size = on_disk(directory / str(step))
        assert found[("checkpoint/save_bytes", step)] == size
        assert found[("checkpoint/save_files", step)] == files
    assert ("checkpoint/save_bytes", 199) not in found


def events_in_two_processes(ctx, directory):
    """Both processes save steps 1 and 2 (async); process 1's hook raises on step 1's
    commit. Returns what each process received and raised."""
    rec = Recorder(
        fail_on=lambda e: ctx.process_id == 1 and isinstance(e, fop.SaveCommitted) and e.step == 1
    )
    raised = []
    mngr = fop.CheckpointManager(directory, on_event=rec)
    mngr.save(1, tree(1))
    try:
        mngr.wait()
    except fop.EventHookError as e:
        raised.append(str(e))
    mngr.save(2, tree(2))  # the run goes on, on both
    mngr.close()
    counts = [
        [e.step, e.files_written, e.bytes_written]
        for e in rec.events
        if isinstance(e, fop.SaveCommitted)
    ]
    return {"kinds": [list(k) for k in rec.kinds()], "counts": counts, "raised": raised}


@pytest.mark.distributed
def test_each_process_gets_its_events_and_a_hook_error_is_raised_on_every_process(tmp_path):
    """The primary counts the committed step's files; the other process reports None.
    A hook error on one process is raised by wait() on every process (agreed: none
    waits for a peer that stopped), and both go on."""
    from _multiprocess import run_processes

    d = tmp_path / "run"
    run = run_processes(
        "test_events:events_in_two_processes",
        2,
        args={"directory": str(d)},
        env={"FOP_COORDINATION_TIMEOUT_S": "20"},
        heartbeat_timeout_s=30,
        timeout_s=90,
    ).check()
    r0, r1 = run[0].result, run[1].result
    for r in (r0, r1):
        assert r["kinds"] == [
            ["SaveStarted", 1],
            ["SaveBlockingDone", 1],
            ["SaveCommitted", 1],
            ["SaveStarted", 2],
            ["SaveBlockingDone", 2],
            ["SaveCommitted", 2],
        ]
    assert r0["counts"] == [[1, *on_disk(d / "1")], [2, *on_disk(d / "2")]]
    assert r1["counts"] == [[1, None, None], [2, None, None]]
    (own,) = r1["raised"]
    (peer,) = r0["raised"]
    assert "hook broke on SaveCommitted" in own
    assert "process 1 failed: EventHookError" in peer
    assert steps_on_disk(d) == ["1", "2"]
