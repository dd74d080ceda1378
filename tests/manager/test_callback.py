"""CheckpointCallback in a real (short) Flax/optax/grain training loop."""

import os

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import flax_orbax_plugin as fop

NUM_STEPS = 12


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(8)(x)))


def make_state():
    net = Net()
    params = net.init(jax.random.key(0), jnp.zeros((1, 3)))["params"]
    return train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-2))


def make_iterator():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]
    records = [{"x": x[i], "y": y[i]} for i in range(64)]
    ds = grain.MapDataset.source(records).shuffle(seed=1).repeat(None).batch(8)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


@jax.jit
def train_step(state, batch):
    def loss_fn(p):
        return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


class RecordingWriter:
    def __init__(self):
        self.calls = []

    def write_scalars(self, step, scalars):
        self.calls.append((step, dict(scalars)))


def run(directory, *, stop_at=NUM_STEPS, final=True, **cb_kwargs):
    """The canonical loop: on_train_start, on_step_end per step, on_train_end."""
    it = make_iterator()
    cb = fop.CheckpointCallback(directory, **cb_kwargs)
    state = cb.on_train_start(make_state(), data_iterator=it)
    for step in range(int(state.step) + 1, stop_at + 1):
        state, _ = train_step(state, next(it))
        cb.on_step_end(step, state)
    if final:
        cb.on_train_end(state)
    else:
        cb.close()  # a loop that stops early: no final save
    return state, cb


def committed_steps(directory):
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_policy_final_save_and_figures(tmp_path):
    writer = RecordingWriter()
    state, cb = run(tmp_path, every_steps=5, keep=None, writer=writer)
    assert int(state.step) == NUM_STEPS
    # every 5 steps, plus the final step from on_train_end
    assert committed_steps(tmp_path) == [5, 10, 12]
    assert [f.step for f in cb.history] == [5, 10, 12]
    assert [step for step, _ in writer.calls] == [5, 10, 12]
    for figures, (_, scalars) in zip(cb.history, writer.calls, strict=True):
        assert 0 < figures.blocking_seconds <= figures.total_seconds
        assert figures.bytes_written > 0
        assert scalars == figures.as_scalars()
        assert set(scalars) == {
            "checkpoint/blocking_seconds",
            "checkpoint/total_seconds",
            "checkpoint/bytes",
            "checkpoint/gbytes_per_sec",
        }
    # the final checkpoint holds the final params
    assert_trees_equal(fop.restore_params(tmp_path, state.params), state.params)


def test_keep_and_sync_save(tmp_path):
    it = make_iterator()
    cb = fop.CheckpointCallback(tmp_path, every_steps=2, keep=2, async_save=False)
    state = cb.on_train_start(make_state(), data_iterator=it)
    for step in range(1, NUM_STEPS + 1):
        state, _ = train_step(state, next(it))
        if cb.on_step_end(step, state):
            # Synchronous: committed, and its figures reported, before on_step_end returns
            # (an async save reports them only at the next poll or save).
            assert not cb.manager.save_in_flight
            assert step in committed_steps(tmp_path)
            assert cb.history and cb.history[-1].step == step
            assert cb.history[-1].total_seconds >= cb.history[-1].blocking_seconds > 0
    cb.on_train_end(state)
    assert committed_steps(tmp_path) == [10, 12]
    assert [f.step for f in cb.history] == [2, 4, 6, 8, 10, 12]


def test_resume_after_interruption_is_bit_exact(tmp_path):
    reference, _ = run(tmp_path / "reference", every_steps=4)

    # Stops after step 7 without a final save: the latest checkpoint is step 4.
    run(tmp_path / "run", every_steps=4, stop_at=7, final=False)
    assert committed_steps(tmp_path / "run") == [4]

    state, cb = run(tmp_path / "run", every_steps=4, resume=True)
    assert cb.resumed_step == 4
    assert int(state.step) == NUM_STEPS
    assert_trees_equal(state.params, reference.params)
    assert_trees_equal(state.opt_state, reference.opt_state)
    assert committed_steps(tmp_path / "run")[-1] == NUM_STEPS


def test_resume_choices(tmp_path):
    # Nothing to resume: True starts fresh, "required" refuses.
    fresh = make_state()
    cb = fop.CheckpointCallback(tmp_path, resume=True)
    assert cb.on_train_start(fresh) is fresh
    assert cb.resumed_step is None
    cb.close()
    cb = fop.CheckpointCallback(tmp_path, resume="required")
    with pytest.raises(fop.CheckpointNotFoundError, match="no committed checkpoint"):
        cb.on_train_start(fresh)
    cb.close()

    trained, _ = run(tmp_path, every_steps=5)
    # resume=False refuses to mix a new run into the existing one, naming the ways out ...
    cb = fop.CheckpointCallback(tmp_path, resume=False)
    with pytest.raises(fop.CheckpointError, match=r"latest: 12.*resume=True.*overwrite=True"):
        cb.on_train_start(make_state())
    cb.close()
    assert committed_steps(tmp_path)[-1] == NUM_STEPS
    # ... resume="required" restores the latest.
    cb = fop.CheckpointCallback(tmp_path, resume="required")
    resumed = cb.on_train_start(make_state())
    cb.close()
    assert int(resumed.step) == NUM_STEPS
    assert_trees_equal(resumed.params, trained.params)
    # overwrite=True starts a fresh run there: the old steps are removed first.
    cb = fop.CheckpointCallback(tmp_path, resume=False, overwrite=True, every_steps=5)
    state = cb.on_train_start(make_state())
    assert committed_steps(tmp_path) == []
    cb.on_train_end(state, step=1)
    assert committed_steps(tmp_path) == [1]


def test_clu_style_hook_with_time_passed_in(tmp_path):
    state = {"value": make_state()}
    cb = fop.CheckpointCallback(tmp_path, every_seconds=10.0, state_fn=lambda: state["value"])
    cb.on_train_start(state["value"])
    saved = []
    for step, t in [(1, 100.0), (2, 105.0), (3, 110.5), (4, 112.0), (5, 119.0), (6, 121.0)]:
        state["value"], _ = train_step(state["value"], next(make_iterator()))
        if cb(step, t=t):
            saved.append(step)
    cb.close()
    # the first call starts the clock; then a save once 10 s have passed since the last
    assert saved == [3, 6]
    assert committed_steps(tmp_path) == [3, 6]


def test_a_hooks_on_train_end_takes_the_final_state_from_state_fn(tmp_path):
    """A callback used as a hook (``state_fn=``) ends without being handed the state;
    one without ``state_fn`` says that on_train_end needs it."""
    state = {"value": make_state()}
    cb = fop.CheckpointCallback(tmp_path / "a", every_steps=10, state_fn=lambda: state["value"])
    cb.on_train_start(state["value"])
    state["value"], _ = train_step(state["value"], next(make_iterator()))
    cb(1)
    cb.on_train_end(step=1)
    assert committed_steps(tmp_path / "a") == [1]
    plain = fop.CheckpointCallback(tmp_path / "b", every_steps=10)
    plain.on_train_start(state["value"])
    with pytest.raises(fop.OptionTypeError, match="made without state_fn="):
        plain.on_train_end()
    plain.close()


def test_hook_needs_state_fn_and_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="state_fn"):
        fop.CheckpointCallback(tmp_path)(1)
    with pytest.raises(ValueError, match="resume"):
        fop.CheckpointCallback(tmp_path, resume="yes")
    with pytest.raises(ValueError, match="every_steps"):
        fop.CheckpointCallback(tmp_path, every_steps=0)
    with pytest.raises(ValueError, match="every_seconds"):
        fop.CheckpointCallback(tmp_path, every_seconds=-1)


def test_nnx_loop_resumes_bit_exact(tmp_path):
    from flax import nnx

    def fresh():
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def nnx_step(model, optimizer, batch):
        def loss_fn(m):
            return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

        grads = nnx.grad(loss_fn)(model)
        optimizer.update(model, grads)

    def nnx_run(directory, stop_at, final, resume):
        it = make_iterator()
        model, optimizer = fresh()
        cb = fop.CheckpointCallback(directory, every_steps=3, resume=resume)
        model, optimizer = cb.on_train_start((model, optimizer), data_iterator=it)
        for step in range(int(optimizer.step[...]) + 1, stop_at + 1):
            nnx_step(model, optimizer, next(it))
            cb.on_step_end(step, (model, optimizer))
        if final:
            cb.on_train_end((model, optimizer))  # no .step on a tuple: the last step seen
        else:
            cb.close()
        return model, cb

    reference, _ = nnx_run(tmp_path / "reference", 8, True, False)
    assert committed_steps(tmp_path / "reference") == [3, 6, 8]
    nnx_run(tmp_path / "run", 5, False, False)
    model, cb = nnx_run(tmp_path / "run", 8, True, True)
    assert cb.resumed_step == 3
    assert_trees_equal(nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param))


class _Writer:
    def __init__(self):
        self.calls = []

    def write_scalars(self, step, scalars):
        self.calls.append((step, dict(scalars)))


@pytest.mark.parametrize("with_writer", [False, True])
def test_one_log_line_per_save_when_it_commits(tmp_path, caplog, with_writer):
    writer = _Writer() if with_writer else None
    state = make_state()
    cb = fop.CheckpointCallback(tmp_path, every_steps=2, writer=writer)
    state = cb.on_train_start(state)
    with caplog.at_level("INFO", logger="flax_orbax_plugin"):
        cb.on_step_end(2, state)
        cb.manager.pending_save.wait()  # committed in the background: logged now, not later
        lines = [r for r in caplog.records if "committed step 2" in r.getMessage()]
        assert len(lines) == (0 if with_writer else 1)
        assert all(r.name == "flax_orbax_plugin" for r in caplog.records)
        cb.on_step_end(4, state)
        cb.close()
    committed = [r for r in caplog.records if "committed step" in r.getMessage()]
    if with_writer:  # the writer's line is the one line: the log stays quiet
        assert committed == [] and [s for s, _ in writer.calls] == [2, 4]
        assert "checkpoint/bytes" in writer.calls[0][1]
    else:
        assert [r.getMessage().split(":")[1] for r in committed] == [
            " committed step 2",
            " committed step 4",
        ]


def test_on_train_start_after_on_step_end_is_refused_naming_the_order(tmp_path):
    """It took the steps this run had just saved for an earlier run's and refused them."""
    cb = fop.CheckpointCallback(tmp_path / "run", every_steps=1)
    cb.on_step_end(1, {"params": {"w": np.zeros(3)}})
    with pytest.raises(fop.CheckpointError, match=r"after on_step_end \(step 1\).*before the"):
        cb.on_train_start({"params": {"w": np.zeros(3)}})
    cb.close()
    assert fop.CheckpointManager(tmp_path / "run", read_only=True).steps() == [1]


def test_a_hook_without_on_train_start_still_keeps_runs_apart(tmp_path):
    """``cb(step)`` alone (a CLU hook list) never ran on_train_start: a directory holding
    another run's steps got this run's saves after them (resume=False ignored), or a
    fresh state saved after the steps it never resumed (resume=True)."""
    state = {"params": {"w": np.zeros(3)}}
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        mngr.save(20, state)
    hook = fop.CheckpointCallback(
        tmp_path / "run", every_steps=25, resume=True, state_fn=lambda: state
    )
    with pytest.raises(
        fop.CheckpointError, match=r"on_step_end\(1\) before on_train_start.*step 20"
    ):
        hook(1)
    hook.close()
    fresh = fop.CheckpointCallback(
        tmp_path / "run", every_steps=25, resume=False, state_fn=lambda: state
    )
    with pytest.raises(
        fop.CheckpointError, match=r"holds steps of a run \(latest: 20\) and resume=False"
    ):
        fresh(25)
    fresh.close()
    assert fop.CheckpointManager(tmp_path / "run", read_only=True).steps() == [20]
    # an empty directory has no run to mix with; with overwrite, resume=False empties it
    empty = fop.CheckpointCallback(tmp_path / "new", every_steps=1, state_fn=lambda: state)
    assert empty(1)
    empty.close()
    over = fop.CheckpointCallback(
        tmp_path / "run", every_steps=1, resume=False, overwrite=True, state_fn=lambda: state
    )
    assert over(1)
    over.close()
    assert fop.CheckpointManager(tmp_path / "run", read_only=True).steps() == [1]


def test_resume_required_on_a_missing_path_leaves_no_directory_behind(tmp_path):
    """A mistyped path with resume="required" is refused and the open's directory goes
    again; one that existed (here, with a file of the user's) is left as it was."""
    missing = tmp_path / "no_such_run"
    cb = fop.CheckpointCallback(missing, resume="required")
    with pytest.raises(fop.CheckpointNotFoundError, match="resume='required'"):
        cb.on_train_start({"params": {"w": np.ones(2)}})
    assert not missing.exists()
    kept = tmp_path / "existing"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    cb = fop.CheckpointCallback(kept, resume="required")
    with pytest.raises(fop.CheckpointNotFoundError):
        cb.on_train_start({"params": {"w": np.ones(2)}})
    assert (kept / "notes.txt").read_text() == "mine"
    nested = tmp_path / "runs" / "a" / "b"  # the open makes its parents too: they go as well
    cb = fop.CheckpointCallback(nested, resume="required")
    with pytest.raises(fop.CheckpointNotFoundError):
        cb.on_train_start({"params": {"w": np.ones(2)}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]


def test_a_refused_start_lets_go_of_the_directory(tmp_path):
    """on_train_start refused (resume=False over steps) kept the callback's manager open,
    so a corrected retry in the same process was refused as a second writer."""
    state = {"params": {"w": np.ones(2)}}
    with fop.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, state)
    cb = fop.CheckpointCallback(tmp_path, resume=False)
    with pytest.raises(fop.CheckpointError, match="resume=False: refusing to mix"):
        cb.on_train_start(state)
    retry = fop.CheckpointCallback(tmp_path, resume=True)
    assert retry.on_train_start(state) is not None and retry.resumed_step == 1
    retry.close()


def test_delete_of_a_step_named_twice_removes_it_once(tmp_path):
    with fop.CheckpointManager(tmp_path, async_save=False) as m:
        for step in (1, 2, 3):
            m.save(step, {"params": {"w": np.ones(2)}})
        m.delete(2, 2)
        assert m.steps() == [1, 3]


class _GetOnly:
    """An iterator whose position can be read but never set back."""

    def __init__(self):
        self.i = 0

    def __next__(self):
        self.i += 1
        return self.i

    def get_state(self):
        return {"i": self.i}


class _Both(_GetOnly):
    def set_state(self, state):
        self.i = state["i"]


def test_an_iterator_that_cannot_be_set_back_is_refused_where_it_is_given(tmp_path):
    """Where it enters (it failed the first save before)."""
    cb = fop.CheckpointCallback(tmp_path, every_steps=1, async_save=False)
    with pytest.raises(fop.OptionTypeError, match=r"has get_state\(\) but no set_state\(\)"):
        cb.on_train_start({"params": {"w": np.ones(2)}}, data_iterator=_GetOnly())
    with pytest.raises(fop.OptionTypeError, match=r"has get_state\(\) but no set_state\(\)"):
        fop.CheckpointCallback(tmp_path, data_iterator=_GetOnly())
    cb.close()


def test_two_data_iterators_are_refused_and_the_run_ends_with_on_train_end(tmp_path):
    a, b = _Both(), _Both()
    cb = fop.CheckpointCallback(tmp_path, data_iterator=a)
    with pytest.raises(fop.CheckpointError, match="data_iterator given twice"):
        cb.on_train_start({"params": {"w": np.ones(2)}}, data_iterator=b)
    cb = fop.CheckpointCallback(tmp_path / "run", every_steps=1, async_save=False)
    cb.on_train_start({"params": {"w": np.ones(2)}})
    cb.on_step_end(1, {"params": {"w": np.ones(2)}})
    cb.on_train_end({"params": {"w": np.ones(2)}}, step=2)
    with pytest.raises(fop.CheckpointError, match=r"on_step_end\(3\) after on_train_end"):
        cb.on_step_end(3, {"params": {"w": np.ones(2)}})
    assert fop.CheckpointManager(tmp_path / "run", read_only=True).steps() == [1, 2]


def test_the_end_of_a_callbacks_run_is_final(tmp_path):
    """A second on_train_end with another step opened the run again and saved that
    step, and cb.manager after the end opened a new writer (its lock, or a bucket's
    lease, held for a run that is over): the same end again is nothing, another step is
    refused, and the manager names how to read the run."""
    cb = fop.CheckpointCallback(tmp_path / "run", every_steps=1)
    state = {"params": {"w": np.ones(2)}}
    cb.on_train_start(state)
    cb.on_step_end(1, state)
    cb.on_train_end(state, step=2)
    cb.on_train_end(state, step=2)  # the same end: nothing
    with pytest.raises(fop.CheckpointError, match=r"on_train_end\(step 9\) after on_train_end"):
        cb.on_train_end(state, step=9)
    with pytest.raises(fop.CheckpointError, match=r"run is over.*read_only=True"):
        cb.manager.steps()
    with fop.CheckpointManager(tmp_path / "run") as writer:  # no lock left behind
        assert writer.steps() == [1, 2]


def test_a_bad_leaf_is_named_with_its_item(tmp_path):
    with fop.CheckpointManager(tmp_path, async_save=False) as m:
        with pytest.raises(fop.StructureError, match=r"^item 'act': leaf '<root>': .*function"):
            m.save(1, {"params": {"w": np.ones(2)}, "act": lambda x: x})
        with pytest.raises(fop.StructureError, match=r"^item 'params': leaf 'act': "):
            m.save(1, {"params": {"act": lambda x: x}})
        assert m.steps() == []
