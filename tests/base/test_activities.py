"""What a heartbeat says a process is doing (``_base/host.py``, read by
``_base/liveness.py``), on one process.

The waits themselves (a slow process waited for and named, a dead one detected, two
waiting for each other) need several processes: tests/end_to_end/test_liveness.py.
"""

import threading

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
