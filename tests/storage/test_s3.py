"""Object storage over S3: tensorstore's s3 kvstore against a moto server on 127.0.0.1."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import _paths
import _proc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop

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
        code = (
            "import json,sys,tensorstore as ts;"
            "kv=ts.KvStore.open(json.loads(sys.argv[1])).result();"
            "kv.write('from_child', b'ok').result()"
        )
        env = {**os.environ, **s3_location.env}
        subprocess.run(
            [sys.executable, "-c", code, json.dumps(s3_location.spec)],
            env=env,
            check=True,
            timeout=60,
            capture_output=True,
        )
        assert s3_location.read("from_child") == b"ok"


# ---------------------------------------------------------------- the core and manager on s3


REPO = _paths.REPO


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def _tree():
    mesh = _mesh((2, 4), ("x", "y"))
    w = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32)
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),
        "r": jax.device_put(jnp.ones((16,), jnp.bfloat16), NamedSharding(mesh, P())),
        "n": np.arange(10, dtype=np.int8),
        "s": 7,
        "small": [np.float32(i) for i in range(5)],
    }


def _assert_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class TestCoreOnS3:
    def test_roundtrip_and_reshard(self, s3_location):
        tree = _tree()
        fop.save(s3_location.spec, tree)
        assert fop.is_committed(s3_location.spec)
        _assert_equal(fop.restore(s3_location.spec), jax.device_get(tree))
        mesh = _mesh((4, 2), ("a", "b"))
        like = jax.tree.map(lambda x: x, tree)
        like["w"] = jax.ShapeDtypeStruct(
            (64, 32), jnp.float32, sharding=NamedSharding(mesh, P("b", "a"))
        )
        back = fop.restore(s3_location.spec, like)
        assert back["w"].sharding == like["w"].sharding
        np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(tree["w"]))
        info = fop.metadata(s3_location.spec)
        got = {k: (v.kind, v.shape, v.dtype) for k, v in info.leaves.items()}
        assert got == {
            "w": ("array", (64, 32), "float32"),
            "r": ("array", (16,), "bfloat16"),
            "n": ("array", (10,), "int8"),
            "s": ("py_int", (), "int64"),
            **{f"small/{i}": ("np_scalar", (), "float32") for i in range(5)},
        }
        assert info.leaves["w"].sharding["spec"] == ["x", "y"]
        assert info.leaves["w"].sharding["mesh_shape"] == [2, 4]
        assert info.leaves["r"].sharding["spec"] == [] and info.leaves["n"].sharding is None
        assert info.leaves["w"].nbytes == 64 * 32 * 4 and info.leaves["r"].nbytes == 32

    def test_marker_is_written_last_and_is_the_commit(self, s3_location, monkeypatch):
        from flax_orbax_plugin._storage.location import Location

        # Record, for every small file the library writes, its name and the keys
        # already on the bucket at that moment (array chunks are written by
        # tensorstore, so the listing is what shows them).
        writes = []
        real_write = Location.write_bytes

        def recording_write(self, name, data, **kw):
            writes.append((name, set(s3_location.keys())))
            return real_write(self, name, data, **kw)

        monkeypatch.setattr(Location, "write_bytes", recording_write)
        tree = {"a": np.ones(100, np.float32), "big": np.arange(1 << 19, dtype=np.float32)}
        fop.save(s3_location.spec, tree)
        keys = set(s3_location.keys())
        assert "_COMMITTED" in keys, keys
        names = [name for name, _ in writes]
        assert names[-1] == "_COMMITTED" and names.count("_COMMITTED") == 1, names
        # When the marker was written, every other key of the checkpoint was there.
        assert "_PENDING.json" not in keys  # the claim goes once the marker is there
        assert writes[-1][1] - {"_PENDING.json"} == keys - {"_COMMITTED"}, (writes[-1][1], keys)
        assert any(k.startswith("data/") for k in writes[-1][1])  # the data files among them
        # Without its marker, the same bytes are not a checkpoint.
        s3_location.delete("_COMMITTED")
        assert not fop.is_committed(s3_location.spec)
        with pytest.raises(fop.NotCommittedError):
            fop.restore(s3_location.spec)

    def test_save_refuses_to_overwrite_unless_forced(self, s3_location):
        fop.save(s3_location.spec, {"a": np.zeros(3)})
        with pytest.raises(fop.CheckpointError):
            fop.save(s3_location.spec, {"a": np.ones(3)})
        fop.save(s3_location.spec, {"a": np.ones(3)}, force=True)
        np.testing.assert_array_equal(fop.restore(s3_location.spec)["a"], np.ones(3))

    def test_corrupt_chunk_names_the_leaf(self, s3_location):
        fop.save(s3_location.spec, {"layer": {"kernel": np.arange(4 << 18, dtype=np.float32)}})
        chunks = [k for k in s3_location.keys() if k.startswith("data/") and k.endswith(".bin")]
        assert chunks, s3_location.keys()
        raw = bytearray(s3_location.read(chunks[0]))
        raw[len(raw) // 2] ^= 0xFF
        s3_location.kvstore().write(chunks[0], bytes(raw)).result()
        with pytest.raises(fop.CorruptCheckpointError, match="kernel"):
            fop.restore(s3_location.spec)

    def test_save_async_then_wait(self, s3_location):
        tree = {"w": jnp.arange(1000.0)}
        handle = fop.save_async(s3_location.spec, tree)
        handle.wait()
        _assert_equal(fop.restore(s3_location.spec), jax.device_get(tree))

    def test_s3_url_with_custom_endpoint(self, s3_location):
        fop.save(s3_location.url, {"a": np.ones(3)})
        assert s3_location.read("_COMMITTED") is not None


def _state(step):
    return {
        "params": {"w": jnp.full((8, 4), float(step)), "b": jnp.zeros(4)},
        "opt_state": {"mu": jnp.full((8, 4), -float(step))},
    }


class TestManagerOnS3:
    def test_listing_and_retention(self, s3_location):
        spec = s3_location.spec
        with fop.CheckpointManager(spec, keep=2) as mngr:
            for step in range(5):
                mngr.save(step, _state(step), extras={"loss": 1.0 / (step + 1)})
            mngr.wait()
            assert mngr.steps() == [3, 4]
            assert mngr.latest_step() == 4
        # Retention deleted the bytes of old steps, not just their markers.
        tops = {k.split("/")[0] for k in s3_location.keys()}
        assert tops == {"3", "4", "_RUN.json"}, sorted(tops)
        with fop.CheckpointManager(spec, read_only=True) as reader:
            restored = reader.restore()
            np.testing.assert_array_equal(restored["params"]["w"], np.full((8, 4), 4.0))
            assert reader.restore(step=3, items="extras")["loss"] == pytest.approx(0.25)

    def test_step_without_marker_is_never_listed_or_restored(self, s3_location):
        spec = s3_location.spec
        with fop.CheckpointManager(spec) as mngr:
            mngr.save(1, _state(1))
            mngr.save(2, _state(2))
            mngr.wait()
        manifests = [k for k in s3_location.keys() if k.startswith("2/") and "/" not in k[2:]]
        assert manifests, s3_location.keys()
        for key in manifests:  # the step's own marker (manifest)
            s3_location.delete(key)
        with fop.CheckpointManager(spec, read_only=True) as reader:
            assert reader.steps() == [1]
            np.testing.assert_array_equal(reader.restore()["params"]["w"], np.full((8, 4), 1.0))
            with pytest.raises(fop.CheckpointNotFoundError):
                reader.restore(step=2)
        with pytest.raises(fop.CheckpointNotFoundError):
            fop.restore_params(spec, step=2)
        np.testing.assert_array_equal(fop.restore_params(spec)["w"], np.full((8, 4), 1.0))

    def test_params_only_restore_reads_nothing_else(self, s3_location):
        spec = s3_location.spec
        with fop.CheckpointManager(spec) as mngr:
            mngr.save(7, _state(7))
            mngr.wait()
        # Remove every opt_state byte: a params-only restore must not notice.
        for key in s3_location.keys():
            if key.startswith("7/opt_state/"):
                s3_location.delete(key)
        params = fop.restore_params(spec)
        np.testing.assert_array_equal(params["w"], np.full((8, 4), 7.0))
        with fop.CheckpointManager(spec, read_only=True) as reader:
            p = reader.restore(items="params")
            np.testing.assert_array_equal(p["w"], np.full((8, 4), 7.0))
            with pytest.raises(fop.CheckpointError):
                reader.restore()

    def test_sigkilled_writer_leaves_no_listed_step(self, s3_location):
        """A writer SIGKILLed after some of a step's objects exist: the step never appears."""
        spec = s3_location.spec
        with fop.CheckpointManager(spec) as mngr:
            mngr.save(1, _state(1))
        code = textwrap.dedent(
            """
            import json, sys
            import jax.numpy as jnp
            import flax_orbax_plugin as fop
            mngr = fop.CheckpointManager(json.loads(sys.argv[1]))
            big = {"params": {f"w{i}": jnp.full((512, 1024), float(i)) for i in range(40)}}
            mngr.save(2, big)
            mngr.wait()
            print("finished", flush=True)
            """
        )
        env = {**os.environ, **s3_location.env, "PYTHONPATH": REPO}
        proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(spec)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                if any(k.startswith("2/") for k in s3_location.keys()):
                    break
                time.sleep(0.01)
            else:
                pytest.fail("the writer wrote nothing under 2/ within 60 s")
        finally:
            proc.send_signal(signal.SIGKILL)
            _proc.wait(proc, timeout=60)
        assert proc.returncode == -signal.SIGKILL  # killed mid-save, not finished
        assert b"finished" not in proc.stdout.read()
        assert any(k.startswith("2/") for k in s3_location.keys())  # debris exists
        with fop.CheckpointManager(spec, read_only=True) as reader:
            assert reader.steps() == [1]
            np.testing.assert_array_equal(reader.restore()["params"]["w"], np.full((8, 4), 1.0))
        # The next writer removes the debris and can save that step for real.
        with fop.CheckpointManager(spec) as mngr:
            assert mngr.steps() == [1]
            mngr.save(2, _state(2))
            mngr.wait()
            assert mngr.steps() == [1, 2]
