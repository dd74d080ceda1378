"""The options every process opens a writing manager with are compared at the open
(``_manager/agreement.py``): a difference is refused on every process, naming the
option and each process's value, before anything is written. Real processes."""

from __future__ import annotations

import os

from _multiprocess import run_processes

import flax_orbax_plugin as fop

# option -> (process 0's value, process 1's value, words the error must hold)
CASES = {
    "format_version": (1, 2, "format_version="),
    "compression": ({"params": "zstd"}, None, "compression="),
    "every_steps": (2, 3, "the save policy"),
    "keep": (1, 3, "the retention"),
    "incremental": (True, False, "incremental="),
    "handle_sigterm": (True, False, "handle_sigterm="),
}


def open_with_each_difference(ctx, directory):
    """For each case, both processes open a manager in a directory of its own with
    their own value of the option; then with values that may differ per host."""
    from _mp_workers import replicated_state

    out = {}
    for option, values in CASES.items():
        where = os.path.join(directory, option)
        try:
            with fop.CheckpointManager(where, **{option: values[ctx.process_id]}):
                out[option] = None
        except fop.CoordinationError as e:
            out[option] = str(e)
        out[option + ":listing"] = sorted(os.listdir(where)) if os.path.isdir(where) else []
    per_host = {"async_save": ctx.process_id == 0, "host_memory_budget": 1 << (30 + ctx.process_id)}
    with fop.CheckpointManager(os.path.join(directory, "per-host"), **per_host) as m:
        m.save(1, replicated_state(ctx, 1, rows=8))
        m.wait()
        out["per-host"] = m.steps()
    return out


def test_a_manager_opened_with_different_options_is_refused_on_every_process(tmp_path):
    run = run_processes(
        "test_agreement:open_with_each_difference",
        2,
        devices_per_process=2,
        args={"directory": str(tmp_path)},
        env={"FOP_COORDINATION_TIMEOUT_S": "60"},
        timeout_s=150,
    ).check()
    for p in run.procs:
        out = p.result
        for option, (_, _, words) in CASES.items():
            error = out[option]
            assert error is not None, (option, p.describe())
            assert "opened this manager with different options" in error, error
            assert words in error and "process 0:" in error and "process 1:" in error, error
            # Refused before anything is written: no step, no lock left behind.
            assert not [n for n in out[option + ":listing"] if n[0].isdigit()], out
        assert out["per-host"] == [1]
