"""``verify`` holds a bounded amount of checkpoint data, whatever the checkpoint's size.

A child process verifies a ~256 MiB checkpoint (large arrays in many chunks and a batch
of small leaves); its peak resident memory (``VmHWM``, reset just before the verify:
importing jax peaks higher than the steady state) may grow by far less than the
checkpoint during the verify (Linux: ``/proc/self/clear_refs``). Holding the whole
checkpoint (as a full restore does) grows it by about the checkpoint's size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import flax_orbax_plugin as fop

CHILD = textwrap.dedent(
    """
    import json, sys
    import flax_orbax_plugin as fop

    def status(key):  # kB, from the kernel's accounting of this process
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])

    small, big = sys.argv[1:3]
    assert all(r.ok for r in fop.verify(small))  # imports, thread pools, caches warmed
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM) to the current resident size
    before = status("VmRSS")
    results = fop.verify(big)
    print(json.dumps({"ok": [r.ok for r in results], "grew_kib": status("VmHWM") - before}))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux peak reset")
def test_verify_memory_is_bounded_whatever_the_checkpoint_size(tmp_path):
    rng = np.random.default_rng(0)
    tree = {f"w{i}": rng.standard_normal((2048, 4096), np.float32) for i in range(8)}
    tree["small"] = {f"s{i}": np.full((1000,), i, np.float32) for i in range(200)}
    total = sum(x.nbytes for x in tree.values() if isinstance(x, np.ndarray))
    assert total >= 256 << 20
    fop.save(tmp_path / "big", tree)
    del tree
    fop.save(tmp_path / "small", {"w": np.ones((1024, 1024), np.float32), "s": np.ones(3)})
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "small"), str(tmp_path / "big")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] == [True]
    assert out["grew_kib"] * 1024 < 64 << 20, f"verify grew by {out['grew_kib']} KiB"


def test_verify_still_finds_damage_in_a_late_chunk(tmp_path):
    """Reading a part at a time still reads every chunk: a flipped byte in the last
    chunk file of a many-chunk array is found and names its leaf."""
    tree = {"w": np.arange(8 << 20, dtype=np.float32).reshape(2048, 4096), "b": np.ones(4)}
    fop.save(tmp_path / "c", tree, format_version=1)  # its last chunk file damaged
    chunks = sorted(
        (os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "c" / "d") for f in fs),
        key=lambda p: [int(x) for x in p.split("/c/")[-1].split("/") if x.isdigit()],
    )
    chunks = [c for c in chunks if not c.endswith("zarr.json")]
    assert len(chunks) > 4
    with open(chunks[-1], "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    (result,) = fop.verify(tmp_path / "c")
    assert not result.ok and "'w'" in result.error


def test_verify_finds_bytes_appended_to_a_data_file(tmp_path):
    """Appended bytes change no value a read returns, but the file is not the one
    committed: verify names it; restore still reads the values."""
    fop.save(tmp_path / "c", {"w": np.arange(1000.0), "b": np.ones(3)})
    (data,) = (tmp_path / "c" / "data").glob("*.bin")
    with open(data, "ab") as f:
        f.write(b"xyz")
    (result,) = fop.verify(tmp_path / "c")
    assert not result.ok and f"data/{data.name}" in result.error and "found" in result.error
    np.testing.assert_array_equal(fop.restore(tmp_path / "c")["w"], np.arange(1000.0))
