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
        ("to_safetensors", lambda: fop.to_safetensors(url, tmp_path / "out.safetensors")),
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


UNREACHABLE = """
import sys, time
import numpy as np
import flax_orbax_plugin as fop
url = sys.argv[1]
fop.save(url + "/a", {"w": np.ones(4)})
print("saved", flush=True)
sys.stdin.readline()  # the server is stopped meanwhile
began = time.monotonic()
for call in (lambda: fop.save(url + "/b", {"w": np.ones(4)}), lambda: fop.restore(url + "/a")):
    try:
        call()
        print("no error")
    except fop.StoreAccessError as e:
        print(f"{e.reason}|{e}|{time.monotonic() - began:.1f}", flush=True)
"""


def test_a_store_that_went_away_is_named_in_bounded_time(tmp_path):
    """The server stopped under a run: tensorstore's own retries went on for about 15
    minutes, silently (Ctrl-C held back by the save's blocking phase); the retries are
    bounded (FOP_STORE_RETRIES, 1 here) and the error names the store and the endpoint."""
    import os
    import subprocess
    import sys

    with S3Server(mode="process") as server:
        bucket = server.create_bucket()
        child = subprocess.Popen(
            [sys.executable, "-c", UNREACHABLE, f"s3://{bucket}/run"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **server.env, "FOP_STORE_RETRIES": "1"},
        )
        assert child.stdout.readline().strip() == "saved"
    try:  # the server is stopped here
        out, _ = child.communicate("go\n", timeout=120)
    finally:
        child.kill()
    lines = out.strip().splitlines()
    assert len(lines) == 2, out
    for line in lines:
        reason, message, seconds = line.split("|")
        assert reason == "cannot be reached", line
        assert f"s3://{bucket}" in message and "AWS_ENDPOINT_URL" in message, line
        assert float(seconds) < 60, line
