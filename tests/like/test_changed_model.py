"""Restoring into a changed model (issue 25): partial=, missing="keep", transform=,
and one error listing every difference; through fop.restore, the manager, the
callback and restore_params."""

from __future__ import annotations

import _docs
import jax
import numpy as np
import pytest

import flax_orbax_plugin as fop


def layers(n: int, fill: float = 0.0) -> dict:
    return {
        f"layers_{i}": {"w": np.full((2, 3), fill + i, np.float32), "b": np.full(3, fill + i)}
        for i in range(n)
    }


def assert_tree_equal(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture
def saved(tmp_path):
    tree = {"params": layers(3, fill=10.0), "step": np.int64(7)}
    fop.save(tmp_path / "ckpt", tree)
    return tmp_path / "ckpt", tree


# -- fop.restore ----------------------------------------------------------------------


def test_new_leaf_refused_then_kept(saved):
    path, tree = saved
    like = {"params": {**layers(3), "head": {"w": np.ones(4, np.float32)}}, "step": np.int64(0)}
    with pytest.raises(fop.StructureError, match=r"leaf 'params/head/w'.*missing='keep'"):
        fop.restore(path, like)
    out = fop.restore(path, like, missing="keep")
    assert out["params"]["head"]["w"] is like["params"]["head"]["w"]  # like's own value
    assert_tree_equal(out["params"]["layers_2"], tree["params"]["layers_2"])
    assert int(out["step"]) == 7


def test_new_leaf_as_shape_dtype_struct_is_named(saved):
    path, _ = saved
    like = {"params": {**layers(3), "head": jax.ShapeDtypeStruct((4,), np.float32)}, "step": 0}
    with pytest.raises(fop.StructureError, match=r"'params/head'.*no value to keep"):
        fop.restore(path, like, missing="keep")


def test_dropped_leaf_refused_then_left_out(saved):
    path, tree = saved
    like = {"params": layers(2), "step": np.int64(0)}
    with pytest.raises(fop.StructureError, match=r"params/layers_2/b.*partial=True"):
        fop.restore(path, like)
    out = fop.restore(path, like, partial=True)
    assert set(out["params"]) == {"layers_0", "layers_1"}
    assert_tree_equal(out["params"], {k: tree["params"][k] for k in ("layers_0", "layers_1")})


def test_renamed_leaf_by_dict_and_callable(saved):
    path, tree = saved
    like = {"params": {f"block{i}": layers(3)[f"layers_{i}"] for i in range(3)}, "step": 0}
    with pytest.raises(fop.StructureError):
        fop.restore(path, like)
    by_dict = fop.restore(path, like, transform={r"layers_(\d+)": r"block\1"})
    by_call = fop.restore(path, like, transform=lambda p: p.replace("layers_", "block"))
    for out in (by_dict, by_call):
        for i in range(3):
            assert_tree_equal(out["params"][f"block{i}"], tree["params"][f"layers_{i}"])
        assert out["step"] == 7 and isinstance(out["step"], int)


def test_transform_none_drops_and_rules_apply_in_order(saved):
    path, tree = saved
    like = {"params": {"first": layers(1)["layers_0"]}, "step": 0}
    rules = {r"layers_0": "zero", r"zero": "first"}  # the second sees the first's output
    drop_rest = {r"^params/layers_[12]/.*": "", **rules}
    with pytest.raises(fop.StructureError, match="both to"):  # two leaves onto ''
        fop.restore(path, like, transform=drop_rest)
    drop = lambda p: None if p.startswith(("params/layers_1", "params/layers_2")) else p
    out = fop.restore(path, like, transform=lambda p: drop(p) and rules_apply(p, rules))
    assert_tree_equal(out["params"]["first"], tree["params"]["layers_0"])


def rules_apply(path, rules):
    import re

    for pattern, repl in rules.items():
        path = re.sub(pattern, repl, path)
    return path


def test_grown_model_keeps_new_layers(saved):
    path, tree = saved
    fresh = layers(4, fill=-1.0)
    out = fop.restore(path, {"params": fresh, "step": 0}, missing="keep")
    for i in range(3):
        assert_tree_equal(out["params"][f"layers_{i}"], tree["params"][f"layers_{i}"])
    assert out["params"]["layers_3"]["w"] is fresh["layers_3"]["w"]


def test_every_difference_in_one_error(saved):
    path, _ = saved
    like = layers(2)
    like["layers_0"]["w"] = np.zeros((3, 3), np.float32)  # shape
    like["layers_1"]["b"] = np.zeros(3, np.int32)  # float64 to int32: never a checked cast
    like["new"] = np.zeros(1)  # missing from the checkpoint
    with pytest.raises(fop.StructureError) as info:
        fop.restore(path, {"params": like, "step": 0})
    message = str(info.value)
    assert "5 differences" in message, message
    for needle in (
        "'params/layers_0/w': shape mismatch: expected (3, 3)",
        "'params/layers_1/b': saved as float64, requested int32",
        "'params/new': expected by like, found no such key",
        "'params/layers_2/w': unexpected key",
        "'params/layers_2/b': unexpected key",
    ):
        assert needle in message, needle


def test_options_checked_by_name(saved):
    path, _ = saved
    with pytest.raises(ValueError, match="missing must be one of"):
        fop.restore(path, None, missing="skip")
    with pytest.raises(fop.TransformError, match="transform: expected a dict"):
        fop.restore(path, None, transform=3)
    with pytest.raises(fop.TransformError, match="needs like"):
        fop.restore(path, None, transform={"layers": "blocks"})
    out = fop.restore(path, None, transform=lambda p: None if "layers_1" in p else p)
    assert set(out["params"]) == {"layers_0", "layers_2"}


# -- the manager, the callback, restore_params ---------------------------------------


@pytest.fixture
def run(tmp_path):
    tree = {"params": layers(3, fill=10.0), "opt_state": {"mu": layers(3, fill=20.0)}}
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        mngr.save(5, tree, extras={"loss": 1.0})
    return tmp_path / "run", tree


def test_manager_grown_renamed_and_dropped(run):
    directory, tree = run
    grown = {"params": layers(4, fill=-1.0), "opt_state": {"mu": layers(4, fill=-1.0)}}
    with fop.CheckpointManager(directory, read_only=True) as mngr:
        with pytest.raises(fop.StructureError, match=r"item 'params'.*layers_3.*missing='keep'"):
            mngr.restore(like=grown)
        out = mngr.restore(like=grown, missing="keep")
        assert_tree_equal(out["params"]["layers_1"], tree["params"]["layers_1"])
        assert_tree_equal(out["opt_state"]["mu"]["layers_2"], tree["opt_state"]["mu"]["layers_2"])
        assert out["params"]["layers_3"]["w"] is grown["params"]["layers_3"]["w"]
        renamed = {
            "params": {f"block{i}": layers(3)[f"layers_{i}"] for i in range(2)},
            "opt_state": {"mu": {f"block{i}": layers(3)[f"layers_{i}"] for i in range(2)}},
        }
        out = mngr.restore(like=renamed, partial=True, transform={r"layers_(\d)": r"block\1"})
        assert_tree_equal(out["opt_state"]["mu"]["block1"], tree["opt_state"]["mu"]["layers_1"])
        # an item the step lacks keeps like's value with missing="keep"
        with_ema = {**grown, "ema": {"w": np.ones(2)}}
        out = mngr.restore(like=with_ema, missing="keep")
        assert out["ema"]["w"] is with_ema["ema"]["w"]
        abstract = {**grown, "ema": {"w": jax.ShapeDtypeStruct((2,), np.float32)}}
        with pytest.raises(fop.StructureError, match="'ema/w'.*no value to keep"):
            mngr.restore(like=abstract, missing="keep")


def test_callback_resumes_a_grown_model(run):
    directory, tree = run
    grown = {"params": layers(4, fill=-1.0), "opt_state": {"mu": layers(4, fill=-1.0)}}
    cb = fop.CheckpointCallback(directory, resume=True)
    try:
        with pytest.raises(fop.StructureError, match="missing='keep'"):
            cb.on_train_start(grown)
        state = cb.on_train_start(grown, missing="keep")
    finally:
        cb.close()
    assert cb.resumed_step == 5
    assert_tree_equal(state["params"]["layers_0"], tree["params"]["layers_0"])
    assert state["params"]["layers_3"]["w"] is grown["params"]["layers_3"]["w"]


def test_restore_params_subset_and_transform(run):
    directory, tree = run
    subset = {"layers_1": layers(3)["layers_1"]}
    with pytest.raises(fop.StructureError, match="layers_0/w': unexpected key"):
        fop.restore_params(directory, subset)
    out = fop.restore_params(directory, subset, partial=True)
    assert_tree_equal(out, {"layers_1": tree["params"]["layers_1"]})
    like = {f"block{i}": jax.ShapeDtypeStruct((2, 3), np.float32) for i in range(3)}
    out = fop.restore_params(
        directory,
        {k: {"w": v} for k, v in like.items()},
        transform=lambda p: None if p.endswith("/b") else p.replace("layers_", "block"),
        dtype=np.float16,
    )
    assert out["block2"]["w"].dtype == np.float16
    np.testing.assert_array_equal(np.asarray(out["block2"]["w"]), tree["params"]["layers_2"]["w"])


# -- the recipe of docs/changed_models.md ---------------------------------------------


def readme_recipe() -> str:
    """The python block of docs/changed_models.md this test is named for."""
    return _docs.run_by("tests/like/test_changed_model.py::test_readme_recipe")


def test_readme_recipe(tmp_path):
    import optax
    from flax import linen, nnx
    from flax.training import train_state

    class LinenMLP(linen.Module):
        @linen.compact
        def __call__(self, x):
            hidden = linen.relu(linen.Dense(8)(x))  # Dense_0
            return linen.Dense(2)(hidden)  # Dense_1

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(4, 8, rngs=rngs)
            self.out = nnx.Linear(8, 2, rngs=rngs)

    class Stack(linen.Module):
        num_layers: int

        @linen.compact
        def __call__(self, x):
            for i in range(self.num_layers):
                x = linen.Dense(4, name=f"layers_{i}")(x)
            return x

    x = jnp_ones((1, 4))

    def create_train_state(num_layers, seed=0):
        model = Stack(num_layers)
        params = model.init(jax.random.key(seed), x)["params"]
        return train_state.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adam(1e-2)
        )

    def trained(state, steps):  # a few real Adam steps: moments and step are not zero
        grad = jax.tree.map(lambda p: np.ones_like(p) * 0.5, state.params)
        for _ in range(steps):
            state = state.apply_gradients(grads=grad)
        return state

    linen_model = LinenMLP()
    linen_state = train_state.TrainState.create(
        apply_fn=linen_model.apply,
        params=linen_model.init(jax.random.key(1), x)["params"],
        tx=optax.adam(1e-3),
    )
    linen_state = trained(linen_state, 2)
    linen_directory = tmp_path / "linen"
    with fop.CheckpointManager(linen_directory, async_save=False) as mngr:
        mngr.save(2, linen_state)
    saved3 = trained(create_train_state(3, seed=2), 3)
    directory = tmp_path / "run"
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        mngr.save(3, saved3)
    without_head = jax.eval_shape(lambda: {k: saved3.params[k] for k in ("layers_0", "layers_1")})

    names = {"fop": fop, "nnx": nnx, "optax": optax, "MLP": MLP}
    names.update(linen_directory=linen_directory, directory=directory)
    names.update(create_train_state=create_train_state, without_head=without_head)
    exec(compile(readme_recipe(), "docs/changed_models.md", "exec"), names)
    names["cb"].close()

    # case 1: every NNX value is the Linen one under its new name
    model, optimizer = names["model"], names["optimizer"]
    assert int(optimizer.step[...]) == 2
    for new, old in (("hidden", "Dense_0"), ("out", "Dense_1")):
        for leaf in ("kernel", "bias"):
            want = linen_state.params[old][leaf]
            assert_tree_equal(getattr(getattr(model, new), leaf)[...], want)
            assert_tree_equal(
                optimizer.opt_state[0].mu[new][leaf][...], linen_state.opt_state[0].mu[old][leaf]
            )
            assert_tree_equal(
                optimizer.opt_state[0].nu[new][leaf][...], linen_state.opt_state[0].nu[old][leaf]
            )
    # case 2: layers 0..2 and their moments resumed; layer 3 as initialised
    state, fresh = names["state"], create_train_state(4)
    assert int(state.step) == 3
    for i in range(3):
        assert_tree_equal(state.params[f"layers_{i}"], saved3.params[f"layers_{i}"])
        assert_tree_equal(
            state.opt_state[0].mu[f"layers_{i}"], saved3.opt_state[0].mu[f"layers_{i}"]
        )
    assert_tree_equal(state.params["layers_3"], fresh.params["layers_3"])
    assert_tree_equal(state.opt_state[0].nu["layers_3"], fresh.opt_state[0].nu["layers_3"])
    # case 3: the served subset
    assert set(names["params"]) == {"layers_0", "layers_1"}
    assert_tree_equal(names["params"]["layers_1"], saved3.params["layers_1"])


def jnp_ones(shape):
    return np.ones(shape, np.float32)


def test_manager_names_every_absent_item(run):
    directory, _ = run
    like = {"params": layers(3), "opt_state": {"mu": layers(3)}, "ema": {}, "teacher": {"w": 1.0}}
    with fop.CheckpointManager(directory, read_only=True) as mngr:
        with pytest.raises(fop.StructureError, match=r"items 'ema', 'teacher' but step 5.*'keep'"):
            mngr.restore(like=like)


def test_nnx_model_that_grew_keeps_its_new_layer(tmp_path):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, n, rngs):
            self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs) for _ in range(n)])

    small = Net(2, nnx.Rngs(0))
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as mngr:
        mngr.save(1, small)
    big = Net(3, nnx.Rngs(1))
    new_kernel = np.asarray(big.layers[2].kernel[...]).copy()
    with fop.CheckpointManager(tmp_path / "run", read_only=True) as mngr:
        with pytest.raises(fop.StructureError, match=r"layers/2/kernel.*missing='keep'"):
            mngr.restore(like=big)
        assert mngr.restore(like=big, missing="keep") is big  # updated in place
        abstract = nnx.eval_shape(lambda: Net(3, nnx.Rngs(2)))
        with pytest.raises(fop.StructureError, match="layers/2/.*no value to keep"):
            mngr.restore(like=abstract, missing="keep")
    for i in range(2):
        np.testing.assert_array_equal(big.layers[i].kernel[...], small.layers[i].kernel[...])
    np.testing.assert_array_equal(big.layers[2].kernel[...], new_kernel)
    params = fop.restore_params(tmp_path / "run", Net(1, nnx.Rngs(3)), partial=True)
    np.testing.assert_array_equal(params["layers"][0]["kernel"], small.layers[0].kernel[...])
