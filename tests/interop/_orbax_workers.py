"""Multi-process workers for the Orbax reader (run by ``_multiprocess.run_processes``;
importable in the children, whose path holds every test wing). Imports are made in
the workers, as in ``_mp_workers``: jax is set up by the child before they run."""

import os
import time


def _listing_in_order(ctx, directory, hidden):
    """Wraps the real Orbax step listing (every caller's copy of the name) so that the
    race is not left to chance: the last process lists first and says so; the primary
    waits for that (1.5 s at most), puts the hidden step back, then lists."""
    from flax_orbax_plugin._interop import orbax_layout, orbax_reader, orbax_steps

    real = getattr(orbax_steps.list_steps, "real", orbax_steps.list_steps)
    mark = os.path.join(os.path.dirname(directory), "listed-by-1")

    def listing(loc):
        if ctx.process_id == 0:
            deadline = time.monotonic() + 1.5
            while not os.path.exists(mark) and time.monotonic() < deadline:
                time.sleep(0.01)
            if os.path.exists(hidden):
                os.rename(hidden, os.path.join(directory, "2"))
            return real(loc)
        out = real(loc)
        open(mark, "w").close()
        return out

    listing.real = real
    orbax_layout.list_steps = orbax_reader.list_steps = orbax_steps.list_steps = listing


def reading_an_orbax_run_while_a_step_lands(ctx, directory):
    """An Orbax run holds steps 1 and 2 (``w`` = expected_w + step). Twice (through
    ``restore_params``, then ``fop.restore``), step 2 is hidden until the last process
    has listed the run, and both processes read it with a ``like`` sharded over them.
    Reports, per entry point, the steps whose values this process's shards hold."""
    import jax
    from _mp_workers import expected_w, steps_held
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_orbax_plugin as fop

    full = expected_w(len(ctx.devices))
    sharding = NamedSharding(ctx.mesh, P(ctx.mesh.axis_names[0]))
    like = {"w": jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=sharding)}
    calls = {
        "restore_params": lambda: fop.restore_params(directory, like),
        "restore": lambda: fop.restore(directory, {"default": like})["default"],
    }
    out = {}
    for name, call in calls.items():
        hidden = os.path.join(os.path.dirname(directory), "hidden-2")
        if ctx.process_id == 0:
            os.rename(os.path.join(directory, "2"), hidden)
        ctx.client.wait_at_barrier(f"fop_test/orbax-hidden-{name}", 60_000)
        _listing_in_order(ctx, directory, hidden)
        out[name] = steps_held(call(), lambda step: {"w": full + step})
        ctx.client.wait_at_barrier(f"fop_test/orbax-read-{name}", 60_000)
        if ctx.process_id == 1:
            os.remove(os.path.join(os.path.dirname(directory), "listed-by-1"))
        ctx.client.wait_at_barrier(f"fop_test/orbax-reset-{name}", 60_000)
    return out


def orbax_saves_a_run(ctx, directory):
    """Orbax itself (its CheckpointManager, every process writing its own shards)
    saves steps 1 and 2 of ``w`` (expected_w + step, rows sharded over the processes)
    and a JSON ``metrics`` item (best_fn: loss 1/step)."""
    import jax
    import orbax.checkpoint as ocp
    from _mp_workers import expected_w
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    full = expected_w(len(ctx.devices))
    sharding = NamedSharding(ctx.mesh, P(ctx.mesh.axis_names[0]))
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(directory, options=options) as mngr:
        for step in (1, 2):
            values = full + step
            w = jax.make_array_from_callback(full.shape, sharding, lambda i, v=values: v[i])
            mngr.save(step, args=ocp.args.StandardSave({"w": w}), metrics={"loss": 1 / step})
        mngr.wait_until_finished()


def orbax_saves_then_reads_while_a_step_lands(ctx, directory):
    """:func:`orbax_saves_a_run`, then :func:`reading_an_orbax_run_while_a_step_lands`
    on that run (one start of the processes for both)."""
    orbax_saves_a_run(ctx, directory)
    ctx.client.wait_at_barrier("fop_test/orbax-saved", 60_000)
    return reading_an_orbax_run_while_a_step_lands(ctx, directory)
