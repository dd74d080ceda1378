"""Object storage over S3: tensorstore's s3 kvstore against a moto server on 127.0.0.1."""

import numpy as np
import pytest
import tensorstore as ts

pytest_plugins = ["_servers"]


def _zarr3_spec(kvstore: dict, shape=(100, 64), chunk=(50, 64)):
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": {
            "shape": list(shape),
            "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
        },
    }


class TestServerWithRawTensorstore:
    """The test server itself: what the core's s3 support stands on."""

    def test_kvstore_write_read_list_delete(self, s3_location):
        kv = s3_location.kvstore()
        kv.write("a/b", b"hello").result()
        kv.write("a/c", b"world").result()
        assert kv.read("a/b").result().value == b"hello"
        assert s3_location.keys() == ["a/b", "a/c"]
        kv.delete_range(ts.KvStore.KeyRange("a/", "a0")).result()
        assert s3_location.keys() == []
        assert kv.read("a/b").result().state == "missing"

    def test_zarr3_crc32c_roundtrip(self, s3_location):
        x = np.random.default_rng(0).random((100, 64), dtype=np.float32)
        arr = ts.open(_zarr3_spec(s3_location.join("arr").spec), create=True).result()
        arr.write(x).result()
        back = ts.open({"driver": "zarr3", "kvstore": s3_location.join("arr").spec}).result()
        np.testing.assert_array_equal(back.read().result(), x)
        assert s3_location.join("arr").keys() == ["c/0/0", "c/1/0", "zarr.json"]

    def test_zarr3_crc32c_detects_corruption(self, s3_location):
        x = np.ones((100, 64), np.float32)
        loc = s3_location.join("arr")
        ts.open(_zarr3_spec(loc.spec), create=True).result().write(x).result()
        raw = bytearray(loc.read("c/1/0"))
        raw[7] ^= 0xFF
        loc.kvstore().write("c/1/0", bytes(raw)).result()
        back = ts.open({"driver": "zarr3", "kvstore": loc.spec}).result()
        with pytest.raises(ValueError, match="Digest mismatch"):
            back.read().result()

    def test_conditional_create_is_honoured(self, s3_location):
        kv = s3_location.kvstore()
        missing = kv.read("marker").result().stamp.generation
        assert kv.write("marker", b"1", if_equal=missing).result().generation != b""
        # A second create-if-absent fails (empty generation) and leaves the first value.
        assert kv.write("marker", b"2", if_equal=missing).result().generation == b""
        assert kv.read("marker").result().value == b"1"

    def test_buckets_are_isolated(self, s3_server, s3_location):
        s3_location.kvstore().write("x", b"1").result()
        other = s3_server.location(s3_server.create_bucket(), "ckpt")
        assert other.keys() == []

    def test_env_for_child_processes(self, s3_location):
        import os
        import subprocess
        import sys

        code = (
            "import json,sys,tensorstore as ts;"
            "kv=ts.KvStore.open(json.loads(sys.argv[1])).result();"
            "kv.write('from_child', b'ok').result()"
        )
        import json

        env = {**os.environ, **s3_location.env}
        subprocess.run(
            [sys.executable, "-c", code, json.dumps(s3_location.spec)],
            env=env,
            check=True,
            timeout=60,
            capture_output=True,
        )
        assert s3_location.read("from_child") == b"ok"
