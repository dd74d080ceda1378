"""Object storage over GCS: tensorstore's gcs kvstore against gcp-storage-emulator on 127.0.0.1.

Skipped when the emulator package is not installed.
"""

import numpy as np
import pytest
import tensorstore as ts

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
