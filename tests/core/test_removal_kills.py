"""A removal of a committed step killed (SIGKILL) at any instant leaves nothing that a
later writer calls someone else's: ownership is provable after every system call of
``removing.remove_step``, and the next writer's open removes what it left.

A fork server pays for the interpreter and the package's import once; each ``go``
forks a real process that removes step 1 of a fresh copy of a run and SIGKILLs itself
just before its n-th mutating system call (open, write, fsync, rename, replace,
unlink, rmdir, mkdir), for every n up to the removal's last call."""

import logging
import os
import shutil
import subprocess
import sys
import textwrap

import _proc
import numpy as np

import flax_orbax_plugin as fop

_SERVER = textwrap.dedent(
    """
    import os, signal, sys, traceback
    from flax_orbax_plugin._core import removing
    from flax_orbax_plugin._storage.location import Location

    CALLS = ("open", "write", "fsync", "rename", "replace", "unlink", "rmdir", "mkdir")
    print("ready", flush=True)
    for line in sys.stdin:
        run, n = line.split()
        pid = os.fork()
        if pid == 0:
            count = [0]

            def counted(real):
                def call(*args, **kwargs):
                    count[0] += 1
                    if count[0] == int(n):
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args, **kwargs)
                return call

            for name in CALLS:
                setattr(os, name, counted(getattr(os, name)))
            code = 1
            try:
                removing.remove_step(Location.from_path(run), 1)
                print("calls", count[0], flush=True)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        print("status", os.waitpid(pid, 0)[1], flush=True)
    """
)

SUSPECT = ("left alone", "proves", "not steps of this library", "did not write")


def state(step: int) -> dict:
    return {"params": {"w": np.arange(16.0) + step}, "opt_state": {"mu": np.ones(3) * step}}


def reopen(run, caplog) -> list[int]:
    """The next writer's open and gc: what it warned of, then the steps it lists."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flax_orbax_plugin"):
        with fop.CheckpointManager(run) as mngr:
            mngr.gc()
            steps = mngr.steps()
            np.testing.assert_array_equal(mngr.restore(step=2)["params"]["w"], np.arange(16.0) + 2)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in said if any(word in m for word in SUSPECT)], said
    return steps


def test_a_removal_killed_at_every_system_call_leaves_nothing_foreign(tmp_path, caplog):
    template = tmp_path / "template"
    with fop.CheckpointManager(template) as mngr:
        mngr.save(1, state(1), extras={"loss": 0.5})
        mngr.save(2, state(2), extras={"loss": 0.25})
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_proc.child_env(JAX_PLATFORMS="cpu"),
        text=True,
    )

    def go(run, n: int) -> tuple[int, int | None]:
        shutil.copytree(template / "1", run / "1")
        shutil.copytree(template / "2", run / "2")
        server.stdin.write(f"{run} {n}\n")
        server.stdin.flush()
        calls = None
        while True:
            word, value = _proc.read_line(server, timeout=60).split()
            if word == "calls":
                calls = int(value)
            elif word == "status":
                return int(value), calls

    try:
        assert _proc.read_line(server, timeout=120) == "ready"
        status, total = go(tmp_path / "whole", 10**9)  # no kill: how many calls it makes
        assert status == 0 and total is not None and total > 5, (status, total)
        assert sorted(os.listdir(tmp_path / "whole")) == ["2"]
        left_behind = set()
        for n in range(1, total + 1):
            run = tmp_path / f"run{n}"
            status, _ = go(run, n)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9, (n, status)
            left = sorted(os.listdir(run))
            left_behind.update(name.split("-")[0] for name in left if name != "2")
            assert reopen(run, caplog) in ([1, 2], [2]), (n, left)
            remains = sorted(set(os.listdir(run)) - {".writer.lock", "1", "2"})
            assert not remains, (n, left, remains)  # every leftover proven ours, removed
    finally:
        server.stdin.close()
        server.kill()
        server.wait()
    # The kills landed before the rename (step 1 intact) and after it (its remains).
    assert {"1", "1.deleting"} <= left_behind, left_behind


def test_a_deleting_place_holding_only_an_empty_marker_file_is_ours(tmp_path, caplog):
    """The remains an earlier version's removal left when killed at the wrong moment:
    ``<step>.deleting-<nonce>/`` holding only ``_PENDING.json.tmp-<hex>`` (0 bytes), which
    every open kept as someone else's; and a claim cut short the same way in a step's
    staging. Both are removed; a staging name holding a user's file is still left."""
    with fop.CheckpointManager(tmp_path) as mngr:
        mngr.save(2, state(2))
    for name in ("1.deleting-0a1b2c3d4e5f", "3.partial-9f8e7d6c5b4a"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "_PENDING.json.tmp-00ff00ff00ff00ff").write_bytes(b"")
    os.makedirs(tmp_path / "4.deleting-abcdef012345")
    (tmp_path / "4.deleting-abcdef012345" / "notes.txt").write_text("mine")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
        with fop.CheckpointManager(tmp_path) as mngr:
            mngr.gc()
    assert sorted(os.listdir(tmp_path)) == [".writer.lock", "2", "4.deleting-abcdef012345"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "1.deleting" not in said and "3.partial" not in said, said
    assert "4.deleting-abcdef012345" in said  # a stranger's file: still left, and said
