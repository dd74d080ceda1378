"""A save that fails while writing leaves nothing behind (issue 11, point 10), nor one
that an exception interrupts while it waits (issue 32).

The disk filling up is simulated for real: the save runs in a child process whose
file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored) makes the kernel fail every
write past 256 KiB (EFBIG), while many chunk writes are in flight. Before the fix,
writes still running after the failure recreated the ``.partial-`` directory that
the failed save had just removed.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import _paths
import _proc
import numpy as np

import flax_orbax_plugin as fop

REPO = _paths.REPO

CHILD = textwrap.dedent(
    """
    import resource, signal, sys
    import numpy as np
    import flax_orbax_plugin as fop

    directory = sys.argv[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))
    tree = {f"l{i:02d}": np.full((600_000,), i, np.float32) for i in range(48)}
    tree["small"] = np.ones(1000, np.float32)
    try:
        fop.save(f"{directory}/2", tree)
    except Exception as e:
        print("save failed:", type(e).__name__, e)
        sys.exit(3)
    print("save succeeded")
    """
)


def test_a_save_failing_on_a_full_disk_leaves_no_partial_directory(tmp_path):
    earlier = {"w": np.arange(1000, dtype=np.float32), "step": 1}
    fop.save(tmp_path / "1", earlier)
    before = sorted(os.listdir(tmp_path))
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "File too large" in proc.stdout
    assert sorted(os.listdir(tmp_path)) == before  # no 2.partial-*, no 2
    out = fop.restore(tmp_path / "1")
    np.testing.assert_array_equal(out["w"], earlier["w"])
    assert out["step"] == 1


SIGTERM_CHILD = textwrap.dedent(
    """
    import signal, sys
    import numpy as np
    import flax_orbax_plugin as fop

    def stop(signum, frame):  # a program's own handler: any exception, not only Ctrl-C
        sys.exit(3)

    signal.signal(signal.SIGTERM, stop)
    tree = {f"l{i}": np.full((20_000,), i, np.float32) for i in range(4)}
    fop.save(f"{sys.argv[1]}/2", tree)
    print("save succeeded")
    """
)


def test_any_exception_raised_into_a_waiting_save_removes_its_staging(tmp_path):
    """A SystemExit from the program's SIGTERM handler while ``fop.save`` waits for its
    background write (paused there: FOP_PAUSE_AT) cancels the save: the background
    phase stops before committing and removes its ``.partial-`` directory. Before, the
    cut-short wait marked the save's thread finished and the interpreter exited under
    it, leaving the directory behind."""
    fop.save(tmp_path / "1", {"w": np.arange(1000, dtype=np.float32), "step": 1})
    env = _proc.child_env(FOP_PAUSE_AT="mid_write", FOP_PAUSE_S="3", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_CHILD, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:  # its stderr is small: read to the pause
            if line.startswith("FOP_PAUSED"):
                break
        time.sleep(0.3)  # the main thread is in the wait by now
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 3, out + err
    assert "save succeeded" not in out
    assert sorted(os.listdir(tmp_path)) == ["1"]  # no 2.partial-*, no 2
    assert fop.restore(tmp_path / "1")["step"] == 1


def test_a_cancelled_save_leaves_nothing_on_memory_and_local_disk(tmp_path, monkeypatch):
    """``SaveHandle.cancel`` (what a Ctrl-C in the caller's wait does) while the background
    phase writes (held there: FOP_PAUSE_AT): nothing stays on ``memory://`` (written in
    place, removed as ours) nor on local disk (the staging directory), and the earlier
    checkpoint beside it is untouched."""
    from flax_orbax_plugin._storage.location import Location

    monkeypatch.setenv("FOP_PAUSE_AT", "mid_write")
    monkeypatch.setenv("FOP_PAUSE_S", "0.3")
    tree = {f"l{i}": np.full((20_000,), i, np.float32) for i in range(4)}
    for root in ("memory://cancelled", str(tmp_path)):
        fop.save(f"{root}/1", {"w": np.arange(10.0)})
        handle = fop.save_async(f"{root}/2", tree)
        handle.cancel()
        assert handle.done()
        assert Location.from_path(root).list_children() == ["1"], root
        np.testing.assert_array_equal(fop.restore(f"{root}/1")["w"], np.arange(10.0))
