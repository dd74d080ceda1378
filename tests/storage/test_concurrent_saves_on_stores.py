"""Two ``fop.save`` calls to one new path on an object store, from two processes: one
wins, the other is refused, and what is there is whole and one save's.

An object store has no rename, so a save writes in place under its pending marker.
Before, both saves wrote there and both returned success: one tree was lost without a
word (or the two mixed). The claim is now a conditional request (no other writer's
marker there), a save that finds a live writer's marker is refused, and a save that
claims after another committed there is refused too; each refused save writes and
removes nothing. The second writer is a real process of this host on the moto server,
paused by the package's own pause points (``FOP_PAUSE_AT``)."""

from __future__ import annotations

import json
import subprocess
import sys

import _proc
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format.layout import PENDING_FILE

pytest_plugins = ["_servers"]

WRITER = """
import sys
import numpy as np
import flax_orbax_plugin as fop

try:
    fop.save(sys.argv[1], {"w": np.full((256,), 1.0, np.float32)})
except fop.CheckpointError as e:
    print("REFUSED", type(e).__name__, e, flush=True)
else:
    print("SAVED", flush=True)
"""


def _start(s3_location, pause_at: str, pause_s: str) -> subprocess.Popen:
    """The other writer, its save paused at ``pause_at`` once it reached it."""
    env = _proc.child_env(FOP_PAUSE_AT=pause_at, FOP_PAUSE_S=pause_s, **s3_location.env)
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, s3_location.url],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    err = b""
    while b"FOP_PAUSED" not in err:
        line = proc.stderr.readline()
        assert line, (proc.wait(timeout=60), err.decode()[-3000:])
        err += line
    return proc


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()[-3000:]
    return out.decode()


def _only(s3_location, value: float) -> None:
    """The path holds one whole checkpoint, all of it ``value``, and no claim."""
    np.testing.assert_array_equal(fop.restore(s3_location.url)["w"], np.full((256,), value))
    assert all(r.ok for r in fop.verify(s3_location.url))
    assert s3_location.read(PENDING_FILE) is None


def test_a_save_into_a_place_a_live_writer_holds_is_refused(s3_location):
    other = _start(s3_location, "before_commit", "2")  # claimed, written, not committed
    with pytest.raises(fop.DirectoryLockedError, match=r"another save or removal \(pid \d+"):
        fop.save(s3_location.url, {"w": np.full((256,), 2.0, np.float32)})
    assert "SAVED" in _finish(other)  # its files were left alone: it committed whole
    _only(s3_location, 1.0)


def test_a_save_that_claims_after_another_committed_is_refused(s3_location):
    other = _start(s3_location, "before_claim", "2")  # looked (empty), not claimed yet
    fop.save(s3_location.url, {"w": np.full((256,), 2.0, np.float32)})
    said = _finish(other)
    assert "REFUSED CheckpointError" in said and "committed a checkpoint there" in said, said
    _only(s3_location, 2.0)


def test_two_saves_that_both_found_the_place_empty_do_not_both_write(s3_location, monkeypatch):
    other = _start(s3_location, "before_claim", "2")  # looked (empty), not claimed yet
    monkeypatch.setenv("FOP_PAUSE_AT", "before_commit")  # this one claims, then waits
    monkeypatch.setenv("FOP_PAUSE_S", "4")
    handle = fop.save_async(s3_location.url, {"w": np.full((256,), 2.0, np.float32)})
    said = _finish(other)  # it woke while this save held the place
    assert "REFUSED DirectoryLockedError" in said and "another save or removal" in said, said
    handle.wait()
    _only(s3_location, 2.0)


def test_another_hosts_save_in_the_place_is_refused_unless_replacing(s3_location):
    """A marker naming a writer of another host (its life cannot be told from here) was
    taken for a dead save's remains: the place was cleared under that save, and both
    reported success over a damaged checkpoint. Refused now; force=True replaces it."""
    doc = {"library": "flax_orbax_plugin", "kind": "pending", "nonce": "0123456789ab"}
    marker = json.dumps({**doc, "host": "another-host", "pid": 4242}).encode()
    s3_location.kvstore().write(PENDING_FILE, marker).result()
    s3_location.kvstore().write("data/0-0.bin", b"its bytes").result()
    with pytest.raises(fop.DirectoryLockedError, match=r"pid 4242 on another-host.*force=True"):
        fop.save(s3_location.url, {"w": np.full((256,), 2.0, np.float32)})
    assert s3_location.read(PENDING_FILE) == marker
    assert s3_location.read("data/0-0.bin") == b"its bytes"
    fop.save(s3_location.url, {"w": np.full((256,), 2.0, np.float32)}, force=True)
    _only(s3_location, 2.0)
