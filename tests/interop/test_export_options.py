"""The exporter's and the importer's options are checked where they enter, by kind:
``dtype`` casts floats to floats under the same cast rules as restore (a value that
overflows is an error naming the leaf unless ``cast="unsafe"``), ``key_map`` may be a
mapping as the CLI's file is, flags are booleans; ``restore_params``'s ``dtype``,
``sharding`` and ``cast`` likewise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import flax_orbax_plugin as fop

VALUES = np.array([0.7, 1.6, -2.5, 300.0, 1e5], np.float32)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    fop.save(root / "core", {"w": VALUES})
    with fop.CheckpointManager(root / "run", async_save=False) as m:
        m.save(1, {"params": {"w": VALUES}})
    return root


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"dtype": "int8"}, fop.OptionError, "expected a floating dtype"),
        ({"dtype": "float16"}, fop.StructureError, "leaf 'w'"),
        ({"cast": "maybe"}, fop.OptionError, "cast"),
        ({"key_map": 3}, fop.OptionTypeError, "key_map"),
        ({"key_map": {"w": 7}}, fop.OptionTypeError, "key_map"),
        ({"transpose_kernels": "yes"}, fop.OptionTypeError, "transpose_kernels"),
    ],
)
def test_to_safetensors_refuses_a_bad_option_naming_it(saved, tmp_path, options, error, words):
    out = tmp_path / "o.safetensors"
    with pytest.raises(error, match=words):
        fop.to_safetensors(saved / "core", out, **options)
    assert not out.exists()


def test_the_cast_rules_keep_values_or_round_and_unsafe_is_numpys(saved, tmp_path):
    fop.to_safetensors(saved / "core", tmp_path / "b.safetensors", dtype="bfloat16")
    got = safetensors.numpy.load_file(tmp_path / "b.safetensors")["w"].astype(np.float32)
    np.testing.assert_allclose(got, VALUES, rtol=1e-2)  # rounded, none wrapped or inf
    fop.to_safetensors(saved / "core", tmp_path / "h.safetensors", dtype="float16", cast="unsafe")
    assert np.isinf(safetensors.numpy.load_file(tmp_path / "h.safetensors")["w"][-1])


def test_a_key_map_mapping_renames_both_ways(saved, tmp_path):
    out = tmp_path / "k.safetensors"
    fop.to_safetensors(saved / "core", out, key_map={"w": "weight"})
    assert list(safetensors.numpy.load_file(out)) == ["weight"]
    back = fop.from_safetensors(out, {"w": np.zeros(5, np.float32)}, key_map={"w": "weight"})
    np.testing.assert_array_equal(back["w"], VALUES)
    with pytest.raises(fop.OptionTypeError, match="transpose_kernels"):
        fop.from_safetensors(out, None, transpose_kernels="yes")


def test_an_empty_tree_is_nothing_to_export(tmp_path):
    with pytest.raises(ValueError, match="nothing to export"):
        fop.to_safetensors({}, tmp_path / "e.safetensors")


@pytest.mark.parametrize("with_like", [True, False])
@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"dtype": "foo"}, fop.OptionTypeError, "dtype"),
        ({"dtype": jnp.int8}, fop.OptionError, "floating dtype"),
        ({"dtype": jnp.float16}, fop.StructureError, "leaf 'w'"),
        ({"sharding": 3}, fop.OptionTypeError, "sharding"),
        ({"sharding": {"v": None}}, fop.OptionTypeError, "sharding"),
        ({"cast": "x"}, fop.OptionError, "cast"),
    ],
)
def test_restore_params_refuses_a_bad_option_naming_it(saved, with_like, options, error, words):
    like = {"w": jax.ShapeDtypeStruct((5,), jnp.float32)} if with_like else None
    with pytest.raises(error, match=words):
        fop.restore_params(saved / "run", like=like, **options)


def test_restore_params_cast_unsafe_is_the_advice_that_works(saved):
    like = {"w": jax.ShapeDtypeStruct((5,), jnp.float32)}
    with pytest.raises(fop.StructureError, match="cast='unsafe'"):
        fop.restore_params(saved / "run", like=like, dtype=jnp.float16)
    got = fop.restore_params(saved / "run", like=like, dtype=jnp.float16, cast="unsafe")
    assert got["w"].dtype == jnp.float16 and np.isinf(np.asarray(got["w"])[-1])


def test_verify_refuses_a_progress_that_is_no_function(saved):
    with pytest.raises(fop.OptionTypeError, match="progress"):
        fop.verify(saved / "core", progress=3)


def test_a_sharding_that_cannot_hold_a_leaf_is_named(tmp_path):
    """jax's raw IndivisibleError named no leaf (6 rows over 4 devices)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    fop.save(tmp_path / "c", {"b": np.arange(6, dtype=np.float32)})
    with fop.CheckpointManager(tmp_path / "run", async_save=False) as m:
        m.save(1, {"params": {"b": np.arange(6, dtype=np.float32)}})
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(4), ("a",))
    rows = NamedSharding(mesh, P("a"))
    with pytest.raises(fop.StructureError, match=r"leaf 'b': the sharding of like cannot hold"):
        fop.restore(
            tmp_path / "c", like={"b": jax.ShapeDtypeStruct((6,), jnp.float32, sharding=rows)}
        )
    with pytest.raises(
        fop.StructureError, match=r"leaf 'b': sharding .* cannot hold its shape \(6,\)"
    ):
        fop.restore_params(tmp_path / "run", sharding=rows)
