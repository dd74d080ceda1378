"""What a heartbeat says a process is doing (``_base/host.py``, read by
``_base/liveness.py``), on one process.

The waits themselves (a slow process waited for and named, a dead one detected, two
waiting for each other) need several processes: tests/end_to_end/test_liveness.py.
"""

import json
import threading
import time

import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import host, liveness


def test_activities_name_each_threads_innermost_work_with_its_bytes():
    acts = host.Activities()
    inner_ready, release = threading.Event(), threading.Event()

    def writer():
        with acts.doing("manager-save (operation 3)"):
            with acts.doing("writing this process's data", moving=True) as progress:
                progress.total, progress.done = 8 << 20, 3 << 20
                inner_ready.set()
                release.wait(10)

    t = threading.Thread(target=writer)
    t.start()
    inner_ready.wait(10)
    with acts.doing("waiting for 'fop/x' from process 1"):
        lines = liveness.activity_lines(acts)
    release.set()
    t.join()
    assert len(lines) == 2, lines
    saving = next(line for line in lines if line.startswith("manager-save"))
    assert " > writing this process's data (" in saving
    assert "3.0 MiB done, 5.0 MiB left" in saving
    assert liveness.activity_lines(acts) == []  # every activity ended with its body
    assert liveness._only_waiting([line for line in lines if line.startswith("waiting")])
    assert not liveness._only_waiting(lines)  # one thread still works: progress


def test_an_activity_ends_when_its_body_raises():
    acts = host.Activities()
    try:
        with acts.doing("reading s3://b/run/1/params", moving=True):
            raise OSError("EIO")
    except OSError:
        pass
    assert liveness.activity_lines(acts) == []
    entry = acts.begin("begun without a with block")
    assert liveness.activity_lines(acts)[0].startswith("begun without a with block (")
    acts.end(entry)
    assert liveness.activity_lines(acts) == []


def test_the_progress_signature_moves_with_bytes_and_activities_not_with_time():
    """What the heartbeat's progress counter follows (a stall: the signature unchanged)."""
    acts = host.Activities()
    with acts.doing("manager-save (operation 1)"):
        with acts.doing("writing this process's data", moving=True) as progress:
            progress.total = 4 << 20
            first = liveness.progress_signature(acts)
            threading.Event().wait(0.05)  # time passes, nothing moves: the same
            assert liveness.progress_signature(acts) == first
            progress.done = 1 << 20  # bytes moved
            moved = liveness.progress_signature(acts)
            assert moved != first
        assert liveness.progress_signature(acts) not in (first, moved)  # an activity ended
    assert liveness.progress_signature(acts) == ()


class _Heartbeats:
    """The coordination service's key-value store as a wait reads heartbeats from it."""

    def __init__(self):
        self.values = {}
        self.reads = 0

    def beat(self, process, n):
        self.values[f"{liveness.ALIVE}/{process}"] = json.dumps(
            {"beat": n, "moved": n, "doing": ["manager-save (operation 2)"]}
        )

    def key_value_try_get(self, key):
        self.reads += 1
        return self.values[key]


def _named_dead(watch, process, within_s):
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            watch.look(process)
        except fop.CoordinationError as e:
            return str(e)
        time.sleep(0.01)
    return None


def test_a_process_named_dead_is_remembered_until_it_beats_again(monkeypatch):
    """The next wait on a process an earlier wait named dead raises at its first look,
    in that session only; once its heartbeat moves again it is judged afresh."""
    monkeypatch.setattr(liveness, "_DEAD", {}, raising=False)  # (fresh: this test's own)
    monkeypatch.setattr(liveness, "PEER_SILENT_S", 0.5)
    monkeypatch.setattr(liveness, "LOOK_S", 0.05)
    service, other = _Heartbeats(), _Heartbeats()
    service.beat(1, 7)
    other.beat(1, 7)

    def watch(client):
        return liveness.PeerWatch(client, 0, "'k' from process 1", stall_s=60, late=lambda: [1])

    first = _named_dead(watch(service), 1, within_s=10)
    assert first is not None and "process 1 is dead: its heartbeat stopped" in first
    with pytest.raises(fop.CoordinationError, match="named dead by an earlier wait"):
        watch(service).look(1)  # at once: no look interval, no silence waited out again
    watch(other).look(1)  # another session's process 1: judged on its own
    service.beat(1, 8)  # it was only frozen: it beats again
    again = watch(service)
    again.look(1)
    assert liveness._DEAD == {}  # forgotten: a later silence is timed afresh
    assert _named_dead(again, 1, within_s=0.3) is None


def test_a_wait_reads_the_heartbeat_at_its_first_look_so_a_silence_counts_from_then(
    monkeypatch,
):
    """The first look reads the awaited process's heartbeat at once (was: once the wait
    had lasted LOOK_S), so a silent process is named dead after FOP_PEER_SILENT_S and a
    look, not a second later."""
    monkeypatch.setattr(liveness, "_DEAD", {}, raising=False)
    monkeypatch.setattr(liveness, "PEER_SILENT_S", 0.5)
    service = _Heartbeats()
    service.beat(1, 3)  # its last beat: it never beats again
    t = time.monotonic()
    watch = liveness.PeerWatch(service, 0, "'k' from process 1", stall_s=60, late=lambda: [1])
    watch.look(1)
    assert service.reads == 1  # at once
    error = _named_dead(watch, 1, within_s=10)
    took = time.monotonic() - t
    assert error is not None and "process 1 is dead: its heartbeat stopped" in error
    assert took < liveness.LOOK_S + 0.6, took  # one look after the first (was: two)
