"""Zero-copy saves (issue 34, item 1): ``CheckpointManager.wrap_step`` / the callback's.

The step right after a save writes into the previous save's arrays (a spare, donated,
checked to alias) instead of donating the state the save still holds as views: the
saved bytes are the state at the save's step whatever the steps after do, on every
save path (async and sync, sharded, a host memory budget, incremental, per host,
several processes), and nothing is copied into host buffers.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin._manager.zero_copy import ZeroCopyStep


def _train_step(state, x):
    """Changes every leaf of the state (in place, once donated)."""
    params, opt = state
    params = jax.tree.map(lambda a: a * 0.5 + x, params)
    opt = {"m": opt["m"] + params["w"][:, :1], "count": opt["count"] + 1}
    return (params, opt), jnp.sum(params["w"])


def _state(sharded: bool = False):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((512, 96), np.float32)
    params = {"w": jnp.asarray(w), "b": jnp.zeros((96,), jnp.float32)}
    if sharded:
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(8), ("x",))
        params["w"] = jax.device_put(w, NamedSharding(mesh, P("x")))
    opt = {"m": jnp.zeros((512, 1), jnp.float32), "count": jnp.zeros((), jnp.int32)}
    return params, opt


def _items(state) -> dict:
    return {"params": state[0], "opt_state": state[1]}


def _pointers(tree) -> set[int]:
    return {
        s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree) for s in x.addressable_shards
    }


def _train(mngr, wrapped, state, steps: int, *, every: int):
    """Runs ``steps`` steps, saving every ``every``-th; returns (the host copies of
    the state at each saved step, the final state, the spare calls whose outputs
    landed in the previous snapshot's buffers)."""
    expected, snapshots, into_previous = {}, [], 0
    for step in range(1, steps + 1):
        if step % every == 0:
            assert mngr.save(step, _items(state))
            expected[step] = jax.tree.map(np.array, _items(state))
            before_spare = wrapped.spare_calls
            previous = _pointers(snapshots[-1]) if snapshots else None
            spare = _pointers(wrapped._spare[1]) if wrapped._spare else set()
            snapshots.append(state)
            state, _ = wrapped(state, 0.25)
            if wrapped.spare_calls > before_spare:  # written into the spare's buffers
                assert _pointers(state) <= spare
                into_previous += previous is not None and _pointers(state) <= previous
        else:
            state, _ = wrapped(state, 0.25)
    snapshots.clear()
    return expected, state, into_previous


def _check_restored(mngr, expected: dict) -> None:
    for step in mngr.steps():
        got = mngr.restore(step=step)
        for path, value in jax.tree_util.tree_leaves_with_path(expected[step]):
            found = got
            for key in path:
                found = found[key.key]
            np.testing.assert_array_equal(found, value, err_msg=f"step {step} {path}")


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"async_save": False},
        {"host_memory_budget": 1 << 20},
        {"incremental": True},
        {"format_version": 1},
        {"persistent": "tier"},
    ],
    ids=["async", "sync", "budget", "incremental", "v1", "tier"],
)
def test_saved_bytes_are_the_state_at_its_step_and_the_next_step_writes_into_a_spare(
    tmp_path, options
):
    if options.get("persistent") == "tier":  # a second tier, copied to in the background
        options = {"persistent": fop.Tier(str(tmp_path / "persistent"), keep=10)}
    with fop.CheckpointManager(tmp_path / "ckpt", keep=10, **options) as mngr:
        wrapped = mngr.wrap_step(_train_step, donate_argnums=0)
        expected, state, into_previous = _train(mngr, wrapped, _state(), 13, every=3)
        mngr.wait()
        assert mngr.steps() == [3, 6, 9, 12]
        _check_restored(mngr, expected)
    # The step after the first save writes into the spare allocated at the second call;
    # each later one into the previous snapshot's buffers: nothing copied or allocated.
    assert (wrapped.fresh_calls, wrapped.spare_calls, into_previous) == (0, 4, 3)
    assert mngr._buffers is None or mngr._saver._buffers is None  # no host buffers used


def test_sharded_state_over_eight_devices(tmp_path):
    with fop.CheckpointManager(tmp_path / "ckpt", keep=10) as mngr:
        wrapped = mngr.wrap_step(_train_step, donate_argnums=(0,))
        expected, state, into_previous = _train(mngr, wrapped, _state(sharded=True), 10, every=3)
        mngr.wait()
        _check_restored(mngr, expected)
    assert (wrapped.fresh_calls, wrapped.spare_calls, into_previous) == (0, 3, 2)
    assert len(state[0]["w"].sharding.device_set) == 8


def test_the_callback_wraps_the_step_and_the_pool_reserved_before_is_given_back(tmp_path):
    cb = fop.CheckpointCallback(
        str(tmp_path / "ckpt"), every_steps=4, keep=5, manager_options={"reuse_host_buffers": True}
    )
    state = _items(_state())
    state = cb.on_train_start(state)
    assert cb.manager._buffers is not None and cb.manager._buffers.nbytes > 0  # reserved

    def step(items, x):
        (p, o), loss = _train_step((items["params"], items["opt_state"]), x)
        return {"params": p, "opt_state": o}, loss

    wrapped = cb.wrap_step(step)
    assert cb.manager._buffers.nbytes == 0  # the reserved pool is not needed any more
    expected = {}
    for i in range(1, 13):
        if cb.on_step_end(i, state):
            expected[i] = jax.tree.map(np.array, state)
        state, _ = wrapped(state, 1.0)
    cb.on_train_end(state, step=13)
    expected[13] = jax.tree.map(np.array, state)
    with fop.CheckpointManager(tmp_path / "ckpt", read_only=True) as reader:
        assert reader.steps()[-3:] == [8, 12, 13]
        _check_restored(reader, {s: expected[s] for s in reader.steps()})
    assert wrapped.spare_calls >= 1


def test_a_spare_that_jax_cannot_donate_is_a_clear_error():
    """A spare whose buffer something else still references (here a numpy view, as a
    save that never let go of its views would) is not donated by jax: the outputs land
    in fresh memory, and the wrapper says so rather than silently copying."""
    wrapped = ZeroCopyStep(_train_step, donate_argnums=0)

    class Done:
        def done(self):
            return True

    state = _state()
    state, _ = wrapped(state, 1.0)  # the first call: its spare is allocated
    wrapped._spare = None
    wrapped.saved(_items(state), Done())
    state, _ = wrapped(state, 1.0)  # no spare: fresh memory
    assert wrapped.fresh_calls == 1
    held_view = np.asarray(wrapped._spare[1][0])  # keeps the spare's first buffer
    wrapped.saved(_items(state), Done())
    with pytest.raises(fop.CheckpointError, match="did not write into the spare"):
        wrapped(state, 1.0)
    assert held_view.shape


def test_the_step_after_the_first_save_compiles_nothing(caplog):
    """The second call makes the first spare and compiles the spare variant ahead of
    time: the step right after a save neither compiles nor allocates (issue 34: "the
    first save no slower than a steady one")."""

    class Done:
        def done(self):
            return True

    wrapped = ZeroCopyStep(_train_step, donate_argnums=0)
    state = _state()
    with jax.log_compiles(True), caplog.at_level("WARNING", logger="jax"):
        for _ in range(2):
            state, _ = wrapped(state, 1.0)
        assert any("into_spare" in r.getMessage() for r in caplog.records)
        caplog.clear()
        wrapped.saved(_items(state), Done())
        state, _ = wrapped(state, 1.0)
        compiled = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert (wrapped.spare_calls, wrapped.fresh_calls, compiled) == (1, 0, [])


def test_calls_after_a_save_of_other_arrays_take_the_plain_step(tmp_path):
    """A save of arrays the step is not given (an eval copy, say) is not a reason to
    hold the step's own state: the plain donating step runs, nothing is kept."""
    with fop.CheckpointManager(tmp_path / "ckpt") as mngr:
        wrapped = mngr.wrap_step(_train_step)
        state = _state()
        for _ in range(2):  # the second call makes the first spare
            state, _ = wrapped(state, 1.0)
        other = jax.tree.map(jnp.copy, _items(state))
        mngr.save(1, other)
        state, _ = wrapped(state, 1.0)
        first_spare = wrapped._spare[1]  # made at the first call, still the spare
        state, _ = wrapped(state, 1.0)
        assert (wrapped.spare_calls, wrapped.fresh_calls) == (0, 0)
        assert wrapped._spare[1] is first_spare
        mngr.wait()
        np.testing.assert_array_equal(
            mngr.restore(step=1)["params"]["w"], np.asarray(other["params"]["w"])
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"donate_argnums": ()}, ValueError, "must name the state"),
        ({"donate_argnums": "0"}, TypeError, "donate_argnums must be an int"),
        ({"donate_argnums": -1}, ValueError, "non-negative"),
        ({"donate_argnums": 0, "static_argnums": 0}, ValueError, "both static and donated"),
    ],
)
def test_bad_options_are_refused(tmp_path, kwargs, error, match):
    with fop.CheckpointManager(tmp_path / "ckpt") as mngr:
        with pytest.raises(error, match=match):
            mngr.wrap_step(_train_step, **kwargs)
        with pytest.raises(TypeError, match="expected the training step function"):
            mngr.wrap_step("train_step")


def test_a_read_only_manager_refuses_to_wrap_a_step(tmp_path):
    with fop.CheckpointManager(tmp_path / "ckpt") as mngr:
        mngr.save(1, {"params": {"w": jnp.ones(3)}})
    with fop.CheckpointManager(tmp_path / "ckpt", read_only=True) as reader:
        with pytest.raises(fop.CheckpointError, match="read-only"):
            reader.wrap_step(_train_step)


def test_an_nnx_state_is_refused_with_a_clear_error(tmp_path):
    from flax import nnx

    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with fop.CheckpointManager(tmp_path / "ckpt") as mngr:
        wrapped = mngr.wrap_step(lambda m, x: m(x))
        with pytest.raises(TypeError, match="NNX Linear"):
            wrapped(model, jnp.ones((1, 2)))  # nnx.jit's in-place updates would be lost
        with pytest.raises(TypeError, match="1 positional arguments"):
            mngr.wrap_step(_train_step, donate_argnums=1)(_state())


def test_readme_recipe(tmp_path):
    """docs/saving.md's zero-copy snippet, verbatim, on a Linen TrainState with adam."""
    import _docs
    import optax
    from flax import linen
    from flax.training import train_state

    code = _docs.run_by("tests/manager/test_zero_copy.py::test_readme_recipe")
    model = linen.Dense(64)
    x = np.random.default_rng(1).standard_normal((32, 48)).astype(np.float32)
    params = model.init(jax.random.key(0), x[:1])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))

    def loss_fn(params, batch):
        return jnp.mean(model.apply({"params": params}, batch) ** 2)

    cb = fop.CheckpointCallback(str(tmp_path / "ckpt"), every_steps=3, keep=10)
    state = cb.on_train_start(state)
    seen = {}

    class Batches:  # records the state each saved step holds (after its update)
        def __next__(self):
            return x

    names = {"jax": jax, "cb": cb, "state": state, "loss_fn": loss_fn}
    names.update(it=Batches(), num_steps=10)
    real_end = cb.on_step_end

    def on_step_end(i, state):
        saved = real_end(i, state)
        if saved:
            seen[i] = jax.tree.map(np.array, state.params)
        return saved

    cb.on_step_end = on_step_end
    exec(compile(code, "docs/saving.md", "exec"), names)
    seen[10] = jax.tree.map(np.array, names["state"].params)
    assert names["step"].spare_calls >= 2
    for step in (3, 6, 9, 10):
        got = fop.restore_params(str(tmp_path / "ckpt"), step=step)
        jax.tree.map(np.testing.assert_array_equal, got, seen[step])


# -- several processes (a worker run in each, tests/support/_multiprocess.py)


def two_process_training(ctx, directory, steps=7, every=3, per_host=False):
    """Each process trains a state sharded over the global mesh with a wrapped step and
    saves through one manager (``per_host``: each its own directory, a shared persistent
    tier); returns the sums of the state at each saved step."""
    mesh = ctx.mesh
    sharding = NamedSharding(mesh, P("data"))
    rows = 64 * len(jax.devices())
    full = np.arange(rows * 8, dtype=np.float32).reshape(rows, 8)
    w = jax.make_array_from_callback(full.shape, sharding, lambda i: full[i])
    state = ({"w": w, "b": jnp.zeros((8,))}, {"m": jnp.zeros((rows, 1)), "count": jnp.array(0)})
    sums = {}
    options = {}
    if per_host:
        options["persistent"] = fop.Tier(os.path.join(directory, "persistent"), keep=10)
        directory = os.path.join(directory, f"host{ctx.process_id}")
    with fop.CheckpointManager(directory, keep=10, **options) as mngr:
        assert mngr._book.per_host == per_host
        wrapped = mngr.wrap_step(_train_step)
        for step in range(1, steps + 1):
            if step % every == 0:
                mngr.save(step, _items(state))
                sums[step] = float(jax.jit(jnp.sum)(state[0]["w"]))
            state, _ = wrapped(state, 1.0)
        mngr.wait()
        restored = {s: float(np.sum(mngr.restore(step=s)["params"]["w"])) for s in mngr.steps()}
    calls = {"spare_calls": wrapped.spare_calls, "fresh_calls": wrapped.fresh_calls}
    return {"sums": sums, "restored": restored, **calls}


@pytest.mark.distributed
@pytest.mark.parametrize("per_host", [False, True], ids=["shared", "per_host"])
def test_two_processes_save_the_state_at_each_step(tmp_path, per_host):
    from _multiprocess import run_processes

    run = run_processes(
        "test_zero_copy:two_process_training",
        2,
        args={"directory": str(tmp_path / "ckpt"), "per_host": per_host},
        timeout_s=120,
    ).check()
    for result in run.results:
        assert (result["fresh_calls"], result["spare_calls"]) == (0, 2)
        assert {int(k): v for k, v in result["restored"].items()} == {
            int(k): v for k, v in result["sums"].items()
        }


def test_donate_argnums_past_the_steps_arguments_is_refused_when_wrapped(tmp_path):
    """A position the step does not take failed only at its first call, deep in jit."""

    def train_step(state, batch):
        return state

    with fop.CheckpointManager(tmp_path / "run") as mngr:
        with pytest.raises(fop.OptionError, match=r"names argument 5.*takes 2 positional"):
            mngr.wrap_step(train_step, donate_argnums=5)
        with pytest.raises(fop.OptionTypeError, match="donate_argnums"):
            mngr.wrap_step(train_step, donate_argnums="state")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"static_argnames": None}, fop.OptionTypeError, r"static_argnames must be a str.*None"),
        ({"static_argnames": 1.5}, fop.OptionTypeError, r"static_argnames must be a str.*1\.5"),
        ({"static_argnames": False}, fop.OptionTypeError, r"static_argnames must be.*False"),
        ({"static_argnames": object()}, fop.OptionTypeError, r"static_argnames.*object"),
        ({"static_argnames": ["mode", 3]}, fop.OptionTypeError, r"static_argnames.*'mode', 3"),
        ({"static_argnames": "moed"}, fop.OptionError, r"static_argnames names 'moed'.*'mode'"),
        ({"static_argnames": "state"}, fop.OptionError, r"both static and donated.*'state'"),
        ({"static_argnums": 5}, fop.OptionError, r"static_argnums=\(5,\) names argument 5"),
        ({"static_argnums": True}, fop.OptionTypeError, r"static_argnums must be an int.*True"),
        ({"static_argnums": None}, fop.OptionTypeError, r"static_argnums must be an int.*None"),
        ({"donate_argnums": True}, fop.OptionTypeError, r"donate_argnums must be an int.*True"),
    ],
)
def test_static_options_are_checked_when_the_step_is_wrapped(tmp_path, kwargs, error, match):
    """Issue 51 item 4: static_argnames of a wrong type was a raw TypeError; a
    static_argnums position the step lacks, jax's raw ValueError at the first call; a
    bool passed as a position. Each is refused by wrap_step, naming the option, on the
    manager and the callback alike."""

    def train_step(state, batch, *, mode="train"):
        return state

    with fop.CheckpointManager(tmp_path / "run") as mngr:
        with pytest.raises(error, match=match):
            mngr.wrap_step(train_step, **kwargs)
    cb = fop.CheckpointCallback(tmp_path / "cb")
    try:
        with pytest.raises(error, match=match):
            cb.wrap_step(train_step, **kwargs)
    finally:
        cb.manager.close()


def test_valid_static_options_still_wrap_and_run(tmp_path):
    def train_step(state, batch, scale, *, mode="train"):
        return jax.tree.map(lambda a: a * scale + (mode == "eval"), state)

    with fop.CheckpointManager(tmp_path / "run") as mngr:
        step = mngr.wrap_step(train_step, static_argnums=np.int64(2), static_argnames=["mode"])
        out = step({"w": jnp.ones(3)}, None, 2.0, mode="eval")
    np.testing.assert_array_equal(out["w"], np.full(3, 3.0))
