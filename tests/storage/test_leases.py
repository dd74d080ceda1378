"""An open on a bucket waits out another host's lease that is no longer renewed: a job
rescheduled onto a new machine after its old one died (SIGKILL, a lost VM: its lease
left live for up to its length) resumes rather than failing at open. A lease renewed
meanwhile is a live writer's: refused at once; one far from its end is refused without
waiting. The other host's record is written as that host's run would write it."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._storage.lease import MAX_WAIT_SECONDS, RUN_FILE, RunRecord
from flax_orbax_plugin._storage.location import Location

pytest_plugins = ["_servers"]

RUN = "0123456789abcdef0123456789abcdef"


def _held_elsewhere(loc: Location, seconds: float) -> RunRecord:
    rec = RunRecord(RUN, "another-host", 4242, "feedfacefeedface", time.time() + seconds)
    loc.write_bytes(RUN_FILE, rec.to_bytes())
    return rec


def _state(step: int) -> dict:
    return {"params": {"w": np.full(8, float(step), np.float32)}}


def test_a_lease_no_longer_renewed_is_waited_out_and_the_run_resumes(s3_location, caplog):
    url = s3_location.url
    with fop.CheckpointManager(url) as mngr:  # the run, before its host died
        mngr.save(1, _state(1))
    _held_elsewhere(Location.from_path(url), 2.5)  # its last renewal, then the host died
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
        with fop.CheckpointManager(url) as mngr:
            waited = time.monotonic() - start
            assert mngr.steps() == [1]
            mngr.save(2, _state(2))
    assert 2.0 < waited < 15, waited
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "waiting for it" in said and "taking over" in said and "another-host" in said
    with fop.CheckpointManager(url, read_only=True) as reader:
        assert reader.steps() == [1, 2]


def test_a_lease_renewed_while_waiting_is_refused_at_once(s3_location):
    loc = Location.from_path(s3_location.url)
    rec = _held_elsewhere(loc, 30)

    def renew() -> None:  # the other host's renewal thread: it is alive
        time.sleep(1.0)
        renewed = RunRecord(rec.run, rec.host, rec.pid, rec.holder, time.time() + 30)
        loc.write_bytes(RUN_FILE, renewed.to_bytes())

    threading.Thread(target=renew, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(
        fop.DirectoryLockedError, match=r"is held by run .* \(pid 4242 on another-host"
    ):
        fop.CheckpointManager(s3_location.url)
    assert time.monotonic() - start < 10


def test_a_lease_far_from_its_end_is_refused_without_waiting(s3_location):
    loc = Location.from_path(s3_location.url)
    _held_elsewhere(loc, MAX_WAIT_SECONDS + 600)
    start = time.monotonic()
    with pytest.raises(fop.DirectoryLockedError, match="another-host"):
        fop.CheckpointManager(s3_location.url)
    assert time.monotonic() - start < 5
    assert loc.read_bytes(RUN_FILE) is not None  # nothing taken over, nothing written


def test_a_writer_that_lost_its_lease_commits_nothing(s3_location):
    """A writer stopped past its lease (SIGSTOP, a hung host) while another took the
    directory: its save in flight committed over the new holder's step when it went on
    (the loss was only logged). The lease is renewed right before each commit now: the
    save fails, nothing is committed, and the other holder's record and steps stay."""
    url = s3_location.url
    loc = Location.from_path(url)
    mngr = fop.CheckpointManager(url, async_save=False)
    mngr.save(1, _state(1))
    theirs = _held_elsewhere(loc, 300)  # taken over meanwhile by another host's run
    with pytest.raises(fop.CheckpointError, match=r"not committed.*lost .* to run .*another-host"):
        mngr.save(2, _state(2))
    mngr.close()
    assert loc.read_bytes(RUN_FILE) == theirs.to_bytes()  # never released over theirs
    with fop.CheckpointManager(url, read_only=True) as reader:
        assert reader.steps() == [1]
