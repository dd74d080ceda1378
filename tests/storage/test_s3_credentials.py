"""An ``s3://`` URL with both keys in the environment names them as its credentials
(the ones the default chain would pick first): a training job's save and restore
print nothing on stderr, though no AWS config file exists (the default chain logs
about 5 lines per store opened then). Keys in ``~/.aws/credentials`` (no config file)
are named as that profile: tensorstore's default chain went anonymous there (access
denied). Anything else is left to the chain."""

import os
import subprocess
import sys

import _paths
import pytest

from flax_orbax_plugin._storage.location import spec_from_path

pytest_plugins = ["_servers"]

CHILD = """
import sys
import numpy as np
import flax_orbax_plugin as fop
fop.save(sys.argv[1], {"w": np.arange(1000, dtype=np.float32)})
assert fop.restore(sys.argv[1])["w"].sum() == 499500
with fop.CheckpointManager(sys.argv[1] + "-run") as mngr:
    mngr.save(1, {"params": {"w": np.ones(8, np.float32)}})
print("done", flush=True)
"""


@pytest.mark.parametrize("where", ["environment", "credentials-file"])
def test_keys_are_named_and_nothing_is_logged(where, s3_location, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if where == "environment":
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")  # no ~/.aws
    else:
        (tmp_path / ".aws").mkdir()
        (tmp_path / ".aws" / "credentials").write_text(
            "[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
        )
    env.update(
        HOME=str(tmp_path),
        AWS_ENDPOINT_URL=s3_location.endpoint,
        AWS_REGION="us-east-1",
        PYTHONPATH=_paths.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    p = subprocess.run(
        [sys.executable, "-c", CHILD, s3_location.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and "done" in p.stdout, p.stderr
    assert p.stderr == "", p.stderr


def test_the_spec_names_credentials_only_where_it_finds_both_keys(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    assert spec_from_path("s3://bucket-a/x")["aws_credentials"] == {"type": "environment"}
    given = {"driver": "s3", "bucket": "bucket-a", "aws_credentials": {"type": "anonymous"}}
    assert spec_from_path(given)["aws_credentials"] == {"type": "anonymous"}  # as given
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    assert "aws_credentials" not in spec_from_path("s3://bucket-a/x")  # the default chain
    (tmp_path / "credentials").write_text("[default]\nrole_arn = arn:aws:iam::1:role/r\n")
    assert "aws_credentials" not in spec_from_path("s3://bucket-a/x")  # a role: the chain
    (tmp_path / "credentials").write_text(
        "[ci]\naws_access_key_id = a\naws_secret_access_key = b\n"
    )
    monkeypatch.setenv("AWS_PROFILE", "ci")
    assert spec_from_path("s3://bucket-a/x")["aws_credentials"] == {
        "type": "profile",
        "profile": "ci",
        "credentials_file": str(tmp_path / "credentials"),
        "config_file": os.devnull,
    }
