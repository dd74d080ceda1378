"""A save that fails while writing leaves nothing behind (issue 11, point 10).

The disk filling up is simulated for real: the save runs in a child process whose
file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored) makes the kernel fail every
write past 256 KiB (EFBIG), while many chunk writes are in flight. Before the fix,
writes still running after the failure recreated the ``.partial-`` directory that
the failed save had just removed.
"""

import os
import subprocess
import sys
import textwrap

import _paths
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
