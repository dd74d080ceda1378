"""Object storage over GCS: tensorstore's gcs kvstore against gcp-storage-emulator on 127.0.0.1.

Skipped when the emulator package is not installed.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

import flax_orbax_plugin as fop

pytest_plugins = ["_servers"]


def _zarr3_spec(kvstore: dict):
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": {
            "shape": [100, 64],
            "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [50, 64]}},
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
        },
    }


class TestServerWithRawTensorstore:
    def test_kvstore_write_read_list_delete(self, gcs_location):
        kv = gcs_location.kvstore()
        kv.write("a/b", b"hello").result()
        kv.write("a/c", b"world").result()
        assert kv.read("a/b").result().value == b"hello"
        assert gcs_location.keys() == ["a/b", "a/c"]
        kv.delete_range(ts.KvStore.KeyRange("a/", "a0")).result()
        assert gcs_location.keys() == []

    def test_url_form_works(self, gcs_location):
        kv = ts.KvStore.open(gcs_location.url + "/").result()
        kv.write("k", b"v").result()
        assert gcs_location.read("k") == b"v"

    def test_zarr3_crc32c_roundtrip_and_corruption(self, gcs_location):
        loc = gcs_location.join("arr")
        x = np.random.default_rng(0).random((100, 64), dtype=np.float32)
        ts.open(_zarr3_spec(loc.spec), create=True).result().write(x).result()
        back = ts.open({"driver": "zarr3", "kvstore": loc.spec}).result()
        np.testing.assert_array_equal(back.read().result(), x)
        raw = bytearray(loc.read("c/0/0"))
        raw[3] ^= 0xFF
        loc.kvstore().write("c/0/0", bytes(raw)).result()
        back = ts.open({"driver": "zarr3", "kvstore": loc.spec}).result()
        with pytest.raises(ValueError, match="Digest mismatch"):
            back.read().result()


# ---------------------------------------------------------------- the core and manager on gs://


def test_core_roundtrip_via_gs_url(gcs_location):
    url = gcs_location.url  # gs://bucket/ckpt: the endpoint comes from the environment
    tree = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64), "n": np.int32(3)}
    fop.save(url, tree)
    assert fop.is_committed(url)
    back = fop.restore(url)
    np.testing.assert_array_equal(back["w"], np.asarray(tree["w"]))
    assert int(back["n"]) == 3
    # The marker is the commit: without it the same bytes are no checkpoint.
    gcs_location.delete("_COMMITTED")
    assert not fop.is_committed(url)
    with pytest.raises(fop.NotCommittedError):
        fop.restore(url)


def test_manager_retention_and_params_only(gcs_location):
    url = gcs_location.url
    with fop.CheckpointManager(url, keep=2) as mngr:
        for step in range(4):
            mngr.save(
                step, {"params": {"w": jnp.full(8, float(step))}, "opt_state": {"m": jnp.ones(8)}}
            )
        mngr.wait()
    assert {k.split("/")[0] for k in gcs_location.keys()} == {"2", "3", "_RUN.json"}
    for key in gcs_location.keys():
        if key.startswith("3/opt_state/"):
            gcs_location.delete(key)
    np.testing.assert_array_equal(fop.restore_params(url)["w"], np.full(8, 3.0))


def test_a_missing_bucket_is_a_store_access_error_at_every_entry_point(gcs_server, capsys):
    """The emulator answers a missing bucket with an empty body: tensorstore's 'Failed
    to parse response metadata' came out raw (a ValueError; the CLI's exit 2)."""
    from flax_orbax_plugin import cli

    url = "gs://no-such-bucket-here/run"
    for call in (
        lambda: fop.save(url, {"w": np.ones(3)}),
        lambda: fop.restore(url),
        lambda: fop.CheckpointManager(url, read_only=True).steps(),
    ):
        with pytest.raises(fop.StoreAccessError, match="no-such-bucket-here: no such bucket"):
            call()
    assert cli.main(["list", url]) == 3
    assert "no such bucket" in capsys.readouterr().err
