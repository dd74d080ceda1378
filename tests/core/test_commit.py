"""One step, one commit, with several real processes (jax.distributed on 127.0.0.1).

The protocol (``flax_orbax_plugin/_core/save.py``): no barrier and two key-value rounds per
manager step, whatever the number of items; a step commits only when every process
reported the same step and tree structure; a fully replicated state saves with several
processes, its chunks written in disjoint parts by the replicas.
"""

import os
import re

import pytest
from _multiprocess import run_processes

import flax_orbax_plugin as fop

pytestmark = pytest.mark.distributed


def _ok(result):
    for p in result.procs:
        assert p.error is None, p.error
    return [p.record.get("result") for p in result.procs]


def _run(target, n, args, *, devices=2, timeout_s=150):
    """Runs ``target`` (``module:function``) in ``n`` processes; every process's result."""
    return _ok(
        run_processes(target, n, devices_per_process=devices, args=args, timeout_s=timeout_s)
    )


@pytest.mark.parametrize("n", [2, 4])
def test_coordination_calls_per_manager_step(tmp_path, n):
    values = _run("_mp_workers:commit_counts", n, {"directory": str(tmp_path / "run")})
    for rank, v in enumerate(values):
        assert v["steps"] == [1, 2, 3]
        assert v["restored_ok"]
        for s in v["per_step"]:
            calls = s["calls"]
            assert calls.get("barrier", 0) == 0, calls
            if rank == 0:  # reads every status, publishes the outcome
                assert calls.get("kv_get", 0) == n - 1 and calls.get("kv_set", 0) == 1, calls
            else:  # publishes its status, reads the outcome
                assert calls.get("kv_get", 0) == 1 and calls.get("kv_set", 0) == 1, calls


@pytest.mark.parametrize("n", [2, 4])
def test_fully_replicated_state_saves_and_writes_are_spread(tmp_path, n):
    values = _run(
        "_mp_workers:commit_counts",
        n,
        {"directory": str(tmp_path / "run"), "replicated": True, "steps": [1]},
    )
    written = [v["per_step"][0]["written"] for v in values]
    assert all(v["restored_ok"] and v["steps"] == [1] for v in values)
    total = sum(written)
    # w is 4096 x 1024 float32 (16 MiB, 4 chunks of 4 MiB): its chunk rows are split
    # over the replicas; the small leaves are batched by process 0.
    assert total >= 4096 * 1024 * 4
    assert max(written) <= 1.1 * total / n + 64 * 1024, written


def test_processes_saving_different_steps_commit_nothing(tmp_path):
    values = [
        p.record.get("result")
        for p in run_processes(
            "_mp_workers:different_steps",
            2,
            devices_per_process=2,
            args={"directory": str(tmp_path / "run")},
            timeout_s=120,
        ).procs
    ]
    for v in values:
        assert v["error"] is not None and "disagree" in v["error"], v
        assert v["steps"] == []
    leftovers = [n for n in os.listdir(tmp_path / "run") if not n.startswith(".")]
    assert leftovers == []


def test_a_failed_removal_of_a_processs_staging_is_reported_not_swallowed(tmp_path):
    """The commit refused (different steps), then each process's removal of its own
    staging fails: each process's error says so, naming the process, beside the cause."""
    run = run_processes(
        "_mp_workers:different_steps",
        2,
        devices_per_process=2,
        args={"directory": str(tmp_path / "run")},
        env={"FOP_FAIL_AT": "remove_staging"},
        timeout_s=120,
    )
    for p in run.procs:
        error = p.result["error"]
        assert "disagree" in error, p.describe()
        me = p.process_id
        assert f"removing process {me}'s staged files failed: injected fault" in error, error


def test_time_based_policy_is_shared_by_all_processes(tmp_path):
    values = _run("_mp_workers:timed_callback", 2, {"directory": str(tmp_path / "run")})
    assert values[0]["saved"] == values[1]["saved"]
    assert len(values[0]["saved"]) >= 2
    assert values[0]["steps"] == sorted(set(values[0]["saved"]) | {30})
    info = fop.verify(tmp_path / "run", all_steps=True)
    assert info and all(r.ok for r in info), [r for r in info if not r.ok]


@pytest.mark.parametrize("share", [False, True])
def test_replicated_restore_reads_once_and_shares_when_asked(tmp_path, share):
    values = _run("_mp_workers:shared_restore", 2, {"directory": str(tmp_path), "share": share})
    total = values[0]["nbytes"]
    for v in values:
        assert v["ok"]
        if share:  # each process reads its half (plus chunk indexes), then all-gathers
            assert 0.45 * total <= v["read"] <= 0.55 * total, (v["read"], total)
        else:  # every process reads all of it
            assert v["read"] >= total, (v["read"], total)


@pytest.mark.parametrize("n", [2, 4])
def test_mixed_state_with_arrays_on_a_subset_of_devices(tmp_path, n):
    values = _run("_mp_workers:mixed_state_save", n, {"directory": str(tmp_path / "run")})
    assert all(v["ok"] and v["steps"] == [1] for v in values), values


def test_data_iterator_saved_by_one_process_is_refused_by_two(tmp_path):
    class It:
        def get_state(self):
            return {"position": 7}

        def set_state(self, state):
            pass

    with fop.CheckpointManager(tmp_path / "run") as m:
        m.save(1, {"params": {"w": [1.0, 2.0]}}, data_iterator=It())
    values = _run(
        "_mp_workers:iterator_into_more_processes",
        2,
        {"directory": str(tmp_path / "run")},
        devices=1,
        timeout_s=120,
    )
    for v in values:
        assert v["w"] == [1.0, 2.0]
        assert "saved by 1 process(es) but 2 are restoring" in v["error"]
        assert "re-seed" in v["error"]


def save_with_own_option(ctx, directory, option, values):
    """Each process calls fop.save with its own value of ``option``."""
    import numpy as np

    path = os.path.join(directory, "ckpt")
    kwargs = {option: values[ctx.process_id]}
    if option == "path":
        path, kwargs = os.path.join(directory, values[ctx.process_id]), {}
    tree = {"w": np.arange(32, dtype=np.float32).reshape(8, 4)}
    try:
        fop.save(path, tree, **kwargs)
    except fop.CoordinationError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.parametrize(
    ("option", "values"),
    [("format_version", [1, 2]), ("compression", ["zstd", None]), ("path", ["a0", "a1"])],
)
def test_processes_saving_with_different_options_commit_nothing(tmp_path, option, values):
    """fop.save where the processes pass different formats, codecs or paths: each
    would write what the others' index does not describe. Refused on both, naming the
    option and both values; nothing committed, nothing staged left."""
    run = run_processes(
        "test_commit:save_with_own_option",
        2,
        devices_per_process=2,
        args={"directory": str(tmp_path), "option": option, "values": values},
        timeout_s=120,
    ).check()
    for p in run.procs:
        error = p.result["error"]
        assert error is not None and "saved with different options" in error, p.result
        assert option in error and str(values[1]) in error, error
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".")] == []


def save_another_tree(ctx, directory, via):
    """Process 1's leaf 'b' is float64 where process 0's is float32."""
    import numpy as np

    dtype = np.float64 if ctx.process_id == 1 else np.float32
    tree = {"a": np.zeros(4, np.float32), "b": np.zeros(3, dtype)}
    try:
        if via == "core":
            fop.save(os.path.join(directory, "ckpt"), tree)
        else:
            with fop.CheckpointManager(os.path.join(directory, "run"), async_save=False) as m:
                m.save(1, {"params": tree})
    except fop.CoordinationError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.parametrize("via", ["core", "manager"])
def test_a_tree_of_another_structure_names_the_first_leaf_that_differs(tmp_path, via):
    """It gave only two structure digests; the other process now names the leaf."""
    run = run_processes(
        "test_commit:save_another_tree",
        2,
        devices_per_process=2,
        args={"directory": str(tmp_path), "via": via},
        timeout_s=120,
    ).check()
    errors = [p.result["error"] for p in run.procs]
    assert all(e and "another structure" in e for e in errors), errors
    leaf = "params/b" if via == "manager" else "b"
    # (a host array's line ends with a digest of its value: compared too)
    here = rf"the first leaf that differs: '{leaf}: array float64\[3\][^']*' here"
    assert re.search(here, errors[1]), errors
    assert re.search(rf"'{leaf}: array float32\[3\][^']*' on process 0", errors[1]), errors
    # Process 0 names it too, from its side (it used to give only the digests).
    there = rf"the first leaf that differs: '{leaf}: array float32\[3\][^']*' here, "
    assert re.search(there + rf"'{leaf}: array float64\[3\][^']*' on process 1", errors[0]), errors
