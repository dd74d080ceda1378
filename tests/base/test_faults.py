"""A real saving process SIGKILLed at each named phase of a save (``FOP_KILL_AT``).

For every phase (``_env.kill_point`` calls in the package) a child process opens
a manager on a directory holding committed steps 1 and 2 and saves step 3 (or, for
the forced-replacement phase, replaces step 2); the child's save path SIGKILLs it at
that phase. The parent then checks every invariant: the child died of SIGKILL at
that point (it never finished); only committed steps are listed, each restoring
bit-exact; earlier steps are untouched; a new writer opens, removes every leftover
and resumes from the latest committed step.

The timed sweep (kills after measured delays) stays in ``test_save.py``.
"""

import os
import re
import signal
import subprocess
import sys

import numpy as np

STEPS_BEFORE = (1, 2)


def state(step: int, version: int = 0) -> dict:
    """The items saved as ``step``: big leaves (several chunks), small ones, JSON."""
    rng = np.random.default_rng([step, version])
    return {
        "params": {
            **{f"w{i}": rng.standard_normal((512, 1024)).astype(np.float32) for i in range(3)},
            "b": rng.standard_normal((64,)).astype(np.float32),
        },
        "opt_state": {
            "mu": rng.standard_normal((512, 1024)).astype(np.float32),
            "count": np.int32(step),
        },
        "extras": {"step": step, "version": version},
    }


def child_main(directory: str, scenario: str) -> None:
    import flax_orbax_plugin as fop

    if scenario == "core-replace":  # fop.save over a committed checkpoint, forced
        fop.save(directory, state(1, version=1)["params"], force=True)
        print("finished", flush=True)
        return
    with fop.CheckpointManager(directory, keep=2) as mngr:
        if scenario == "new":
            mngr.save(3, state(3))
        else:  # replace step 2 by a new version of it
            mngr.save(2, state(2, version=1), ignore_policy=True, overwrite=True)
    print("finished", flush=True)


if __name__ == "__main__":
    child_main(*sys.argv[1:])
    sys.exit(0)


import _paths  # noqa: E402
import _proc  # noqa: E402
import pytest  # noqa: E402

import flax_orbax_plugin as fop  # noqa: E402

pytest_plugins = ["_servers"]

# The phases of a save, in order (see flax_orbax_plugin/_base/env.py).
PHASES = (
    "after_snapshot",  # the blocking phase copied every byte to host memory
    "mid_write",  # a first chunk write completed, others may be pending
    "after_sync",  # this process's files are durable
    "after_metadata",  # _METADATA.json written
    "after_marker",  # the marker (the step's manifest) written, not yet renamed
    "mid_rename",  # forced replacement: the old one moved aside, the new not yet in place
    "mid_retention",  # an old step renamed away (or uncommitted), not yet removed
)

# Phase -> (scenario, steps a reader lists right after the kill, steps after a writer
# opened, {step: versions allowed there}).
EXPECTED = {
    **{p: ("new", [1, 2], [1, 2], {}) for p in PHASES[:4]},
    # The step's manifest is whole but the rename did not happen: not a step for
    # readers; a writer finishes the commit (rolls it forward), exact.
    "after_marker": ("new", [1, 2], [1, 2, 3], {}),
    # Killed in the middle of replacing step 2: readers still find step 2 (never a
    # window without it), one version or the other, whole; so does a writer. (Found
    # missing, and lost by the next writer, until the replacement became one
    # renameat2(RENAME_EXCHANGE) in main.)
    "mid_rename": ("replace", [1, 2], [1, 2], {2: (0, 1)}),
    # Step 3 committed; step 1 renamed away by retention is no longer a step.
    "mid_retention": ("new", [2, 3], [2, 3], {}),
}


def test_every_kill_point_of_the_package_is_exercised():
    package = os.path.dirname(fop.__file__)
    called = set()
    for root, _, names in os.walk(package):  # every wing of the package
        for name in names:
            if name.endswith(".py"):
                with open(os.path.join(root, name)) as f:
                    called |= set(re.findall(r"kill_point\(\"([a-z_]+)\"\)", f.read()))
    # the persistent tier's own kill test
    elsewhere = {"mid_replication": "manager/test_tiers.py"}
    assert called == set(PHASES) | set(elsewhere)
    for phase, test_file in elsewhere.items():
        with open(os.path.join(_paths.TESTS, test_file)) as f:
            assert f'FOP_KILL_AT"] = "{phase}' in f.read(), (phase, test_file)


def _assert_items_equal(restored: dict, expected: dict) -> None:
    assert set(restored) == set(expected), (sorted(restored), sorted(expected))
    assert restored["extras"] == expected["extras"]
    for item in ("params", "opt_state"):
        assert set(restored[item]) == set(expected[item])
        for name, want in expected[item].items():
            got = np.asarray(restored[item][name])
            assert got.dtype == np.asarray(want).dtype and got.shape == np.shape(want)
            assert got.tobytes() == np.asarray(want).tobytes(), (item, name)


def _matches_a_version(restored: dict, step: int, versions) -> int:
    for v in versions:
        try:
            _assert_items_equal(restored, state(step, v))
            return v
        except AssertionError:
            continue
    raise AssertionError(f"step {step} matches none of versions {versions}: {restored['extras']}")


def _run_child(tmp_path, directory, scenario, phase) -> None:
    """Runs the child until its SIGKILL at ``phase``; raises if it exits any other way."""
    stderr = tmp_path / "child.stderr"
    with open(stderr, "w") as err:
        child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(directory), scenario],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=_proc.child_env(JAX_PLATFORMS="cpu", XLA_FLAGS="", FOP_KILL_AT=phase),
        )
        code = _proc.wait(child, timeout=180)
    out = child.stdout.read().decode()
    child.stdout.close()
    if code != -signal.SIGKILL or "finished" in out:
        raise RuntimeError(f"child not killed at {phase}: {code} {out!r}\n{stderr.read_text()}")


def _prepare(tmp_path):
    directory = tmp_path / "run"
    with fop.CheckpointManager(directory, keep=2) as mngr:
        for s in STEPS_BEFORE:
            mngr.save(s, state(s))
    return directory, {s: sorted(os.listdir(directory / str(s))) for s in STEPS_BEFORE}


def _assert_step(restored, step, versions):
    if step in versions:
        _matches_a_version(restored, step, versions[step])
    else:
        _assert_items_equal(restored, state(step))


@pytest.mark.parametrize("phase", [*PHASES, "mid_write:2"])  # :2, the second item's write
def test_sigkill_at_phase_leaves_only_committed_steps(tmp_path, phase):
    scenario, listed, reopened, versions = EXPECTED[phase.partition(":")[0]]
    directory, before = _prepare(tmp_path)

    _run_child(tmp_path, directory, scenario, phase)

    # A reader (no cleanup) lists only committed steps, each exact; earlier steps
    # not being replaced are untouched, file for file.
    with fop.CheckpointManager(directory, read_only=True) as reader:
        assert reader.steps() == listed, os.listdir(directory)
        for s in reader.steps():
            _assert_step(reader.restore(step=s), s, versions)
    for s in set(STEPS_BEFORE) - set(versions) - {1 if phase == "mid_retention" else None}:
        assert sorted(os.listdir(directory / str(s))) == before[s]

    # A new writer cleans up (nothing but steps left), and resumes from the latest
    # committed step, exact.
    with fop.CheckpointManager(directory, keep=2) as mngr:
        assert sorted(os.listdir(directory)) == sorted([*map(str, reopened), ".writer.lock"])
        assert mngr.steps() == reopened and mngr.latest_step() == reopened[-1]
        latest = mngr.restore()
        _assert_step(latest, reopened[-1], versions)
        params = fop.restore_params(directory)
        assert params.keys() == latest["params"].keys()
        for name, want in latest["params"].items():
            assert np.asarray(params[name]).tobytes() == np.asarray(want).tobytes()
        # and the interrupted save can be made for real
        mngr.save(4, state(4))
        mngr.wait()
        _assert_items_equal(mngr.restore(step=4), state(4))


@pytest.mark.parametrize("phase", PHASES[:6])
def test_sigkill_during_a_forced_core_save_keeps_old_or_new(tmp_path, phase):
    """fop.save(force=True) over a committed checkpoint, killed at each core phase:
    the path holds the old or the new tree, whole, and a later save there works.
    (mid_rename was found leaving neither until the replacement became one exchange.)

    (The killed save's ``ckpt.partial-*`` sibling stays: the core takes no lock, so
    it cannot tell a dead writer's directory from a live one's. Inside a manager's
    step the whole unfinished step is removed; beside a bare core checkpoint nothing
    removes it yet.)"""
    path = tmp_path / "ckpt"
    old, new = state(1)["params"], state(1, version=1)["params"]
    fop.save(path, old)
    _run_child(tmp_path, path, "core-replace", phase)
    try:
        restored = fop.restore(path)
    except (fop.CheckpointNotFoundError, fop.NotCommittedError) as e:
        raise AssertionError(f"no checkpoint at {path}: {os.listdir(tmp_path)}") from e
    matches = [
        v
        for v, tree in enumerate((old, new))
        if all(np.asarray(restored[k]).tobytes() == tree[k].tobytes() for k in tree)
    ]
    assert matches, "the checkpoint holds neither the old nor the new tree"
    fop.save(path, new, force=True)
    np.testing.assert_array_equal(fop.restore(path)["w0"], new["w0"])


@pytest.mark.s3
@pytest.mark.parametrize("phase", [*PHASES[:5], "mid_retention"])
def test_sigkill_at_phase_on_an_object_store(tmp_path, s3_location, phase):
    """The same on S3 (moto), where the manifest written last is the commit (no rename:
    mid_rename never fires there)."""
    url = s3_location.url  # the server's endpoint and keys are in the environment
    with fop.CheckpointManager(url, keep=2) as mngr:
        for s in STEPS_BEFORE:
            mngr.save(s, state(s))
    committed = {"after_marker": [1, 2, 3], "mid_retention": [2, 3]}.get(phase, [1, 2])

    _run_child(tmp_path, url, "new", phase)

    with fop.CheckpointManager(url, read_only=True) as reader:
        assert reader.steps() == committed
        for s in committed:
            _assert_items_equal(reader.restore(step=s), state(s))
    # A new writer removes the debris of the killed step (or of the half-deleted one).
    with fop.CheckpointManager(url, keep=2) as mngr:
        assert {k.split("/")[0] for k in s3_location.keys()} - {"_RUN.json"} == set(
            map(str, committed)
        )
        assert mngr.latest_step() == committed[-1]
        _assert_items_equal(mngr.restore(), state(committed[-1]))
        mngr.save(4, state(4))
        mngr.wait()
        _assert_items_equal(mngr.restore(step=4), state(4))
