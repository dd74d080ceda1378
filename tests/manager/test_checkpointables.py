"""Built-in checkpointables: pytrees (optax states), step, extras, data iterators."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._errors import CheckpointError, CheckpointNotFoundError
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._format import steps as _steps
from flax_orbax_plugin._format.layout import ItemEntry, StepManifest
from flax_orbax_plugin._manager.checkpointables import (
    BUILTIN_CHECKPOINTABLES,
    Checkpointable,
    DataIteratorCheckpointable,
    JsonCheckpointable,
    PytreeCheckpointable,
    StepCheckpointable,
    checkpointable_for,
)
from flax_orbax_plugin._storage.location import Location


def loc(tmp_path, name):
    """Where item ``name`` of step 1 lives."""
    return Location.from_path(tmp_path).child("1").child(name)


def save_item(c, tmp_path, name, value):
    """Saves one item into step 1 and commits the step (the manifest records the
    checksums of the item's JSON files, as the manager does)."""
    step = Location.from_path(tmp_path).child("1")
    written = c.save(step.child(name), value).wait()
    try:
        old = _layout.read_manifest(step)
        items, files = dict(old.items), dict(old.files)
    except CheckpointNotFoundError:
        items, files = {}, {}
    items[name] = ItemEntry(getattr(c, "kind", "custom"), name)
    files.update({f"{name}/{f}": h for f, h in (written.files if written else {}).items()})
    _steps.write_manifest(step, StepManifest(1, items, files))
    return step.child(name)


def test_builtins_follow_the_protocol_and_unknown_names_are_pytrees():
    for name, c in BUILTIN_CHECKPOINTABLES.items():
        assert isinstance(c, Checkpointable), name
    assert isinstance(checkpointable_for("batch_stats"), PytreeCheckpointable)
    assert isinstance(checkpointable_for("data_iterator"), DataIteratorCheckpointable)
    custom = JsonCheckpointable()
    assert checkpointable_for("params", {"params": custom}) is custom


def test_extras_json_round_trip_with_bytes_and_numpy_scalars(tmp_path):
    value = {"loss": np.float32(0.5), "n": 3, "blob": b"\x00\xffab", "cfg": {"lr": [1e-3, 2]}}
    c = checkpointable_for("extras")
    save_item(c, tmp_path, "extras", value)
    out = c.restore(loc(tmp_path, "extras"), None)
    assert out == {"loss": 0.5, "n": 3, "blob": b"\x00\xffab", "cfg": {"lr": [1e-3, 2]}}
    # stored as JSON text, base64 for bytes: nothing to unpickle
    text = (tmp_path / "1" / "extras" / "value.json").read_text()
    assert "__bytes__" in text


def test_extras_that_are_not_json_are_refused_at_save_time(tmp_path):
    with pytest.raises(TypeError, match="extras/fn"):
        checkpointable_for("extras").save(loc(tmp_path, "e"), {"fn": print})
    with pytest.raises(TypeError, match="keys must be str"):
        checkpointable_for("extras").save(loc(tmp_path, "e"), {1: 2})


def test_extras_holding_a_prng_key_or_a_deleted_array_are_named_at_the_save(tmp_path):
    """They raised jax's own TypeError / RuntimeError, naming no item or key."""
    gone = jnp.ones(2)
    gone.delete()
    with fop.CheckpointManager(tmp_path) as mngr:
        for extras, words in (
            ({"rng": jax.random.key(0)}, r"extras/rng: a PRNG key cannot be stored as JSON"),
            ({"m": {"w": gone}}, r"extras/m/w: expected a live array, found one that was del"),
        ):
            with pytest.raises(fop.StructureError, match=words):
                mngr.save(1, {"params": {"w": np.ones(2)}}, extras=extras)
        assert mngr.steps() == []
        mngr.save(1, {"params": {"w": np.ones(2)}}, extras={"rng": jax.random.PRNGKey(0)})
        assert mngr.restore(step=1, items=("extras",))["extras"] == {"rng": [0, 0]}


def test_step_restores_as_the_type_of_like(tmp_path):
    c = StepCheckpointable()
    save_item(c, tmp_path, "step", jnp.asarray(42, jnp.int32))
    assert c.restore(loc(tmp_path, "step"), None) == 42
    assert type(c.restore(loc(tmp_path, "step"), 0)) is int
    out = c.restore(loc(tmp_path, "step"), jax.ShapeDtypeStruct((), jnp.uint32))
    assert isinstance(out, jax.Array) and out.dtype == jnp.uint32 and int(out) == 42
    with pytest.raises(TypeError, match="integer scalar"):
        c.save(loc(tmp_path, "s2"), 1.5)


def test_missing_json_item_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="nothing/value.json: not inside a committed step"):
        JsonCheckpointable().restore(loc(tmp_path, "nothing"), None)
    save_item(JsonCheckpointable(), tmp_path, "extras", {"a": 1})
    (tmp_path / "1" / "extras" / "value.json").unlink()
    with pytest.raises(CheckpointError, match="value.json is missing"):
        JsonCheckpointable().restore(loc(tmp_path, "extras"), None)


OPTAX_STATES = {
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "masked": lambda: optax.masked(optax.adam(1e-3), {"w": True, "b": False}),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.sgd(0.1, momentum=0.9), "b": optax.adam(1e-3)}, {"w": "a", "b": "b"}
    ),
    "inject": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
}


@pytest.mark.parametrize("kind", sorted(OPTAX_STATES))
def test_optax_states_round_trip(tmp_path, kind):
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    tx = OPTAX_STATES[kind]()
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, state = tx.update(grads, state, params)
    c = checkpointable_for("opt_state")
    save_item(c, tmp_path, "opt_state", state)
    like = jax.eval_shape(lambda: tx.init(params))
    out = c.restore(loc(tmp_path, "opt_state"), like)
    assert jax.tree.structure(out) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.dtype == b.dtype


def _map_iter():
    ds = grain.MapDataset.range(40).shuffle(seed=3).batch(4)
    return iter(ds.to_iter_dataset())


def _loader_iter():
    loader = grain.DataLoader(
        data_source=list(range(40)),
        sampler=grain.samplers.IndexSampler(40, shuffle=True, seed=3, num_epochs=1),
        operations=[grain.transforms.Batch(4)],
        worker_count=0,
    )
    return iter(loader)


@pytest.mark.parametrize("make", [_map_iter, _loader_iter], ids=["map_dataset", "data_loader"])
def test_grain_iterator_position_round_trip(tmp_path, make):
    it = make()
    for _ in range(3):
        next(it)
    c = checkpointable_for("data_iterator")
    save_item(c, tmp_path, "data_iterator", it)
    expected = [np.asarray(next(it)) for _ in range(4)]
    fresh = make()
    assert c.restore(loc(tmp_path, "data_iterator"), fresh) is fresh
    got = [np.asarray(next(fresh)) for _ in range(4)]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    assert (tmp_path / "1" / "data_iterator" / "process_0.json").exists()


class StateDictIterator:
    def __init__(self):
        self.i = 0

    def __next__(self):
        self.i += 1
        return self.i

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, d):
        self.i = d["i"]


def test_state_dict_iterators_work_too(tmp_path):
    it = StateDictIterator()
    next(it)
    next(it)
    c = checkpointable_for("data_iterator")
    save_item(c, tmp_path, "di", it)
    next(it)  # the state was taken at save time, not at wait time
    other = c.restore(loc(tmp_path, "di"), StateDictIterator())
    assert other.i == 2
    assert c.restore(loc(tmp_path, "di"), None) == {"i": 2}


def test_iterator_without_state_is_refused(tmp_path):
    with pytest.raises(TypeError, match="get_state"):
        checkpointable_for("data_iterator").save(loc(tmp_path, "di"), iter([1, 2]))


def test_non_finite_metrics_round_trip_as_tagged_json(tmp_path):
    """A diverging run's loss is NaN: it must save (JSON has no NaN) and come back."""
    import math

    value = {"loss": float("nan"), "hi": np.float32(np.inf), "lo": -math.inf, "ok": 0.5}
    save_item(checkpointable_for("extras"), tmp_path, "extras", value)
    out = checkpointable_for("extras").restore(loc(tmp_path, "extras"), None)
    assert math.isnan(out["loss"]) and out["hi"] == math.inf and out["lo"] == -math.inf
    assert out["ok"] == 0.5
    text = (tmp_path / "1" / "extras" / "value.json").read_text()
    assert "NaN" not in text and "__float__" in text
