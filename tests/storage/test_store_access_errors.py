"""A store's refusal at every public entry point of the Python API, on the S3 test
server (moto): a missing bucket and access denied (signatures checked)
are a ``fop.StoreAccessError`` naming the bucket, what happened and what to do, never
tensorstore's raw ``ValueError`` with the store's XML body. Other errors pass as they
were. (The GCS emulator answers a missing bucket with an empty body, which tensorstore
cannot parse, where GCS itself says "bucket does not exist": not tested on it.)"""

import numpy as np
import pytest
from _s3_server import S3Server

import flax_orbax_plugin as fop

pytest_plugins = ["_servers"]

TREE = {"w": np.arange(16, dtype=np.float32)}


def _entry_points(url, tmp_path):
    """Each public entry point given the place ``url``: (name, call)."""

    def callback():
        with fop.CheckpointCallback(url) as cb:
            cb.on_train_start({"params": TREE})

    return [
        ("save", lambda: fop.save(url, TREE)),
        ("save_async", lambda: fop.save_async(url, TREE).wait()),
        ("restore", lambda: fop.restore(url)),
        ("metadata", lambda: fop.metadata(url)),
        ("verify", lambda: fop.verify(url)),
        ("is_committed", lambda: fop.is_committed(url)),
        ("restore_params", lambda: fop.restore_params(url)),
        ("manager", lambda: fop.CheckpointManager(url).steps()),
        ("manager read-only", lambda: fop.CheckpointManager(url, read_only=True).steps()),
        ("callback", callback),
        ("import_msgpack", lambda: fop.import_msgpack(tmp_path / "m.msgpack", url, step=1)),
    ]


@pytest.fixture
def msgpack_file(tmp_path):
    from flax import serialization

    (tmp_path / "m.msgpack").write_bytes(serialization.msgpack_serialize({"w": TREE["w"]}))


def test_a_missing_bucket_is_named_at_every_entry_point(s3_server, tmp_path, msgpack_file):
    scheme = "s3"
    url = f"{scheme}://no-such-bucket-fop/run"
    for name, call in _entry_points(url, tmp_path):
        with pytest.raises(fop.StoreAccessError) as info:
            call()
            pytest.fail(f"{name}: nothing raised")
        e = info.value
        assert str(e).startswith(f"{scheme}://no-such-bucket-fop: no such bucket;"), (name, e)
        assert e.url == f"{scheme}://no-such-bucket-fop" and e.reason == "no such bucket"
        assert "<?xml" not in str(e) and e.__cause__ is None, name
        assert isinstance(e, ValueError), name  # what the raw error was


def test_a_missing_persistent_bucket_names_that_bucket(s3_server, tmp_path):
    with pytest.raises(fop.StoreAccessError, match="s3://no-such-tier-fop: no such bucket"):
        fop.CheckpointManager(tmp_path / "run", persistent="s3://no-such-tier-fop/run")


def test_access_denied_is_named_at_the_entry_points(tmp_path, monkeypatch, msgpack_file):
    """moto checking signatures (after one unchecked request, which makes the bucket):
    the test keys are unknown to it, so every request is refused."""
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "1")
    with S3Server(mode="process") as server:
        bucket = server.create_bucket()
        undo = server.apply_env()
        try:
            url = f"s3://{bucket}/run"
            for name, call in _entry_points(url, tmp_path):
                with pytest.raises(fop.StoreAccessError) as info:
                    call()
                    pytest.fail(f"{name}: nothing raised")
                assert info.value.url == f"s3://{bucket}", name
                assert info.value.reason == "access denied", (name, info.value)
        finally:
            undo()


def test_other_errors_pass_unchanged(s3_location):
    fop.save(s3_location.url, TREE)
    with pytest.raises(fop.StructureError):  # the template's fault, not the store's
        fop.restore(s3_location.url, {"other": np.zeros(3)})
    with pytest.raises(fop.UnsupportedLocationError):
        fop.restore("s4://bucket/run")
