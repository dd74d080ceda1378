"""A run owns its places (``_run_owner``): a tiered manager's local directory and its
persistent path record one run; a second live run on the persistent path is refused at
open (a lock on filesystems, a lease on the S3 server, held by another real process)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import _proc
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._storage.lease import RUN_FILE, RunRecord, read_record
from flax_orbax_plugin._storage.location import Location

pytest_plugins = ["_servers"]

WAIT_S = 60


def state(step):
    return {"params": {"w": np.arange(64, dtype=np.float32) + step}}


def record(url):
    return read_record(Location.from_path(url))


@pytest.fixture(params=["s3", "fs"])
def persistent(request, tmp_path):
    if request.param == "fs":
        return str(tmp_path / "persistent")
    return request.getfixturevalue("s3_location").url


def test_a_second_manager_on_the_persistent_path_is_refused_until_the_first_closes(
    persistent, tmp_path
):
    first = fop.CheckpointManager(tmp_path / "a", persistent=persistent)
    try:
        first.save(1, state(1))
        first.wait()
        assert first.persistent.wait(WAIT_S)
        with pytest.raises(fop.DirectoryLockedError, match="live writer|is held by run"):
            fop.CheckpointManager(tmp_path / "b", persistent=persistent)
        assert not os.path.exists(tmp_path / "b" / RUN_FILE)  # nothing recorded for it
    finally:
        first.close()
    run = first.persistent.run_id
    with fop.CheckpointManager(tmp_path / "b", persistent=persistent) as second:
        # An empty local directory (a restart on a new disk) continues the run.
        assert second.persistent.run_id == run
        assert record(tmp_path / "b").run == run == record(persistent).run
        np.testing.assert_array_equal(second.restore()["params"]["w"], state(1)["params"]["w"])


def test_places_of_two_runs_are_never_mixed(persistent, tmp_path, s3_location):
    other = s3_location.join("other").url if persistent.startswith("s3") else persistent + "-2"
    with fop.CheckpointManager(tmp_path / "a", persistent=persistent) as mngr:
        mngr.save(1, state(1))
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
        run_a = mngr.persistent.run_id
    with fop.CheckpointManager(tmp_path / "b", persistent=other) as mngr:
        run_b = mngr.persistent.run_id
    assert run_a != run_b
    # Run b's local directory on run a's persistent path: refused, naming both runs.
    with pytest.raises(fop.CheckpointError, match=rf"belongs to run {run_b}.*run {run_a}"):
        fop.CheckpointManager(tmp_path / "b", persistent=persistent)
    assert record(tmp_path / "b").run == run_b and record(persistent).run == run_a


def test_a_place_holding_steps_without_a_record_never_joins_another_run(persistent, tmp_path):
    """Every run records itself in both places when it opens: a directory that holds
    steps but no record was never this run's. Before, it adopted the persistent path's
    run; its steps were copied up, and a resume of the other run restored them."""
    with fop.CheckpointManager(tmp_path / "a", persistent=persistent) as mngr:
        mngr.save(1, state(1))
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
    with fop.CheckpointManager(tmp_path / "b") as mngr:  # another run, no tier
        mngr.save(5, state(5))
    with pytest.raises(fop.CheckpointError, match=r"holds steps \[5\] but no run record"):
        fop.CheckpointManager(tmp_path / "b", persistent=persistent)
    assert not os.path.exists(tmp_path / "b" / RUN_FILE)
    with fop.CheckpointManager(tmp_path / "a2", persistent=persistent) as mngr:  # new disk
        assert mngr.latest_step(include_persistent=True) == 1  # nothing of run b came up


def test_copy_down_refuses_a_persistent_path_another_run_took_over(persistent, tmp_path):
    with fop.CheckpointManager(tmp_path / "a", persistent=persistent) as mngr:
        mngr.save(1, state(1))
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
    with fop.CheckpointManager(tmp_path / "b", persistent=persistent) as mngr:
        # Another writer replaces the owner record while this manager is open.
        intruder = RunRecord("ab" * 16, "elsewhere", 1, "cd" * 8, None)
        Location.from_path(persistent).write_bytes(RUN_FILE, intruder.to_bytes())
        with pytest.raises(fop.CheckpointError, match=f"holds a record of run {'ab' * 16}"):
            mngr.restore()
        assert mngr.steps() == []  # nothing was copied down


def test_a_malformed_owner_record_is_refused_naming_the_field(persistent, tmp_path):
    loc = Location.from_path(persistent)
    loc.makedirs()
    doc = {"library": "flax_orbax_plugin", "kind": "run", "run": "not hex", "host": "h"}
    loc.write_bytes(RUN_FILE, json.dumps(doc).encode())
    with pytest.raises(fop.CorruptCheckpointError, match=rf"{RUN_FILE}: field run: expected"):
        fop.CheckpointManager(tmp_path / "a", persistent=persistent)
    assert json.loads(loc.read_bytes(RUN_FILE)) == doc  # left as it was


HOLDER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import flax_orbax_plugin as fop
    m = fop.CheckpointManager(
        sys.argv[1], persistent=fop.Tier(sys.argv[2], lease_seconds=float(sys.argv[3]))
    )
    m.save(1, {"params": {"w": np.arange(64, dtype=np.float32) + 1}})
    m.wait()
    assert m.persistent.wait(60)
    print("open", m.persistent.run_id, flush=True)
    for line in sys.stdin:
        if line.strip() == "save":
            m.save(2, {"params": {"w": np.arange(64, dtype=np.float32) + 2}})
            m.wait()
            try:
                m.persistent.wait(60)
                print("saved", flush=True)
            except fop.ReplicationError as e:
                print("refused", str(e).replace("\\n", " "), flush=True)
        elif line.strip() == "close":
            try:
                m.close()
            except fop.CheckpointError:
                pass
            print("closed", flush=True)
            break
    """
)


def start_holder(local, url, env, lease):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(local), url, str(lease)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_proc.child_env(**env),
    )
    line = _proc.read_line(proc, timeout=90)
    assert line.startswith("open "), line
    return proc, line.split()[1]


def tell(proc, what):
    proc.stdin.write(what + "\n")
    proc.stdin.flush()


def test_s3_lease_of_another_process_refuses_the_open_until_it_closes(s3_location, tmp_path):
    proc, run = start_holder(tmp_path / "a", s3_location.url, s3_location.env, 60)
    try:
        rec = record(s3_location.url)
        assert rec.run == run and rec.pid == proc.pid and rec.lease_expires > time.time()
        with pytest.raises(
            fop.DirectoryLockedError, match=rf"held by run {run} \(pid {proc.pid} on .*expires at"
        ):
            fop.CheckpointManager(tmp_path / "b", persistent=s3_location.url)
        tell(proc, "close")
        assert _proc.read_line(proc, timeout=60) == "closed"
        assert _proc.wait(proc, timeout=60) == 0
    finally:
        proc.kill()
    assert record(s3_location.url).lease_expires == 0  # released, the run id kept
    with fop.CheckpointManager(tmp_path / "b", persistent=s3_location.url) as mngr:
        assert mngr.persistent.run_id == run
        assert mngr.restore()["params"]["w"][0] == 1


def test_s3_an_expired_lease_is_taken_over_and_its_holder_commits_nothing_more(
    s3_location, tmp_path, caplog
):
    proc, run = start_holder(tmp_path / "a", s3_location.url, s3_location.env, 1.5)
    try:
        proc.send_signal(signal.SIGSTOP)  # alive but hung: it renews no more
        expires = record(s3_location.url).lease_expires
        deadline = time.monotonic() + 30
        while time.time() <= expires + 0.1:  # wait for the recorded expiry itself
            assert time.monotonic() < deadline
            time.sleep(0.1)
        mngr = fop.CheckpointManager(tmp_path / "b", persistent=s3_location.url)
        assert any("taking over" in r.message and run in r.message for r in caplog.records)
        assert record(s3_location.url).pid == os.getpid()
        proc.send_signal(signal.SIGCONT)
        tell(proc, "save")  # the old holder's next replication finds the place taken
        answer = _proc.read_line(proc, timeout=90)
        assert answer.startswith("refused") and "lost" in answer, answer
        tell(proc, "close")
        assert _proc.read_line(proc, timeout=60) == "closed"
        _proc.wait(proc, timeout=60)
        assert record(s3_location.url).pid == os.getpid()  # the close released nothing of ours
        mngr.close()
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    assert fop.CheckpointManager(s3_location.url, read_only=True).steps() == [1]


@pytest.mark.parametrize(
    "expires, found",
    [(1e300, "1e+300"), (253402300800.0, "253402300800"), (-1, "-1"), (10**400, "1000")],
)
def test_s3_a_lease_time_no_date_can_hold_is_refused_naming_the_field(
    s3_location, tmp_path, expires, found
):
    """A record's lease past year 9999 (or before 1970) is damage named at parse time,
    not a raw OverflowError/ValueError when the open formats it."""
    doc = {"library": "flax_orbax_plugin", "kind": "run", "run": "ab" * 16, "host": "h"}
    doc.update(pid=1, holder="cd" * 8, lease_expires=expires)
    Location.from_path(s3_location.url).write_bytes(RUN_FILE, json.dumps(doc).encode())
    with pytest.raises(
        fop.CorruptCheckpointError, match=rf"{RUN_FILE}: field lease_expires.*{re.escape(found)}"
    ):
        fop.CheckpointManager(tmp_path / "a", persistent=s3_location.url)


def test_a_lease_no_reader_could_format_is_never_written(s3_location, tmp_path):
    with pytest.raises(ValueError, match="persistent_lease_seconds"):  # the deprecated form
        fop.CheckpointManager(
            tmp_path / "a", persistent=s3_location.url, persistent_lease_seconds=1e300
        )
    with pytest.raises(ValueError, match="^lease_seconds must be a number of seconds >= 1 "):
        fop.CheckpointManager(
            tmp_path / "a", persistent=fop.Tier(s3_location.url, lease_seconds=1e300)
        )
    assert Location.from_path(s3_location.url).read_bytes(RUN_FILE) is None
    with pytest.raises(ValueError, match="lease_expires.*year 9999"):
        RunRecord("ab" * 16, "h", 1, "cd" * 8, lease_expires=1e300).to_bytes()


def test_a_record_nested_deeply_is_damage_naming_the_file(persistent, tmp_path):
    loc = Location.from_path(persistent)
    loc.makedirs()
    loc.write_bytes(RUN_FILE, b'{"library": ' + b"[" * 1500 + b"]" * 1500 + b"}")
    with pytest.raises(fop.CorruptCheckpointError, match=rf"{RUN_FILE}: nested 1501 levels"):
        fop.CheckpointManager(tmp_path / "a", persistent=persistent)


def test_a_persistent_path_holding_another_librarys_run_is_refused(tmp_path):
    """Before: the tier wrote its run record and steps inside an Orbax run."""
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path / "orbax") as mngr:
        mngr.save(5, args=ocp.args.StandardSave({"w": np.ones(3, np.float32)}))
        mngr.wait_until_finished()
    with pytest.raises(fop.CheckpointError, match=r"persistent path .* holds an Orbax run"):
        fop.CheckpointManager(tmp_path / "local", persistent=str(tmp_path / "orbax"))
    assert sorted(os.listdir(tmp_path / "orbax")) == ["5"]


def test_a_plain_writer_on_a_leased_persistent_path_is_refused(s3_location, tmp_path):
    """Before: a manager (or gc) opened the bucket path a tiered run held, saved its own
    step there and removed the run's steps."""
    url = s3_location.url
    with fop.CheckpointManager(tmp_path / "a", persistent=url) as tiered:
        tiered.save(1, state(1))
        tiered.wait()
        assert tiered.persistent.wait(WAIT_S)
        with pytest.raises(fop.DirectoryLockedError, match=r"held by run .*: this process"):
            fop.CheckpointManager(url)
        with fop.CheckpointManager(url, read_only=True) as reader:  # reading is fine
            assert reader.steps() == [1]
    with fop.CheckpointManager(url) as after:  # its lease given back at close
        assert after.steps() == [1]
