"""The CLI on the project's S3 test server (moto), through the real entry point in a
child process, credentials from the environment only (no AWS config files, an empty
HOME): stderr holds nothing from tensorstore or the AWS libraries; sizes are listed;
a missing bucket, missing credentials and access denied are one line each, naming
the bucket, exit status 3."""

import json
import os
import subprocess
import sys

import _paths
import numpy as np
import pytest
from _s3_server import S3Server

import flax_orbax_plugin as fop
from flax_orbax_plugin.cli.dispatch import is_aws_line
from flax_orbax_plugin.cli.output import EXIT_STORE

pytest_plugins = ["_servers"]

CHILD = """
import sys, json
from flax_orbax_plugin import cli
codes = [cli.main(argv) for argv in json.loads(sys.argv[1])]
print("codes", json.dumps(codes), flush=True)
"""


def _env(server, home, *, keys=True):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(home), AWS_ENDPOINT_URL=server.endpoint, AWS_REGION="us-east-1")
    if keys:
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    env["PYTHONPATH"] = _paths.REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def _cli(env, *argvs):
    p = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([list(map(str, a)) for a in argvs])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    codes = json.loads(p.stdout.rsplit("codes ", 1)[1]) if "codes " in p.stdout else None
    return codes, p.stdout, p.stderr


@pytest.fixture
def filled(s3_location):
    with fop.CheckpointManager(s3_location.spec) as mngr:
        for step in (1, 2):
            mngr.save(step, {"params": {"w": np.full((256, 64), step, np.float32)}})
    return s3_location


def test_commands_on_s3_print_nothing_on_stderr_and_list_sizes(filled, s3_server, tmp_path):
    url = filled.url
    codes, out, err = _cli(
        _env(s3_server, tmp_path),
        ["list", url],
        ["list", url, "--json"],
        ["inspect", url, "--summary"],
        ["verify", url, "--all"],
        ["gc", url, "--keep", "2", "--dry-run"],
    )
    assert codes == [0, 0, 0, 0, 0], out + err
    assert err == "", err  # no "Failed to open file .../.aws/config", nothing
    sizes = {
        step: sum(len(filled.read(k)) for k in filled.keys() if k.startswith(f"{step}/"))
        for step in (1, 2)
    }
    doc = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert {s["step"]: s["size_bytes"] for s in doc["steps"]} == sizes
    row = next(line for line in out.splitlines() if line.startswith("| 2 "))
    assert "?" not in row and "KiB" in row


def test_without_keys_the_aws_chain_is_filtered_and_the_error_is_one_line(
    filled, s3_server, tmp_path
):
    """No keys, no profile: the default chain probes files and instance metadata (each
    logged by the AWS libraries), then goes anonymous and is refused."""
    codes, _, err = _cli(_env(s3_server, tmp_path, keys=False), ["list", filled.url])
    assert codes == [EXIT_STORE]
    assert err.splitlines() == [err.strip()], err  # one line
    assert f"s3://{filled.bucket}: no credentials" in err and "AWS_ACCESS_KEY_ID" in err


def test_a_missing_bucket_is_one_line_naming_it(s3_server, tmp_path):
    """Every command, reading or writing (import was exit 2: the library's own
    StoreAccessError was not mapped to the store's exit status)."""
    from flax import serialization

    source = tmp_path / "checkpoint_1"
    source.write_bytes(serialization.to_bytes({"w": np.ones(2, np.float32)}))
    codes, _, err = _cli(
        _env(s3_server, tmp_path),
        ["list", "s3://no-such-bucket-fop/run"],
        ["verify", "s3://no-such-bucket-fop/run"],
        ["import", str(source), "s3://no-such-bucket-fop/run", "--step", "1"],
    )
    assert codes == [EXIT_STORE, EXIT_STORE, EXIT_STORE], err
    lines = err.splitlines()
    assert len(lines) == 3, err
    for line in lines:
        assert "s3://no-such-bucket-fop: no such bucket" in line and "<?xml" not in line


def test_access_denied_is_one_line_naming_the_bucket(tmp_path, monkeypatch):
    """A server that checks signatures (moto's auth on after one request): keys
    it does not know are refused (the one unchecked request makes the bucket)."""
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "1")  # the bucket is made unsigned
    with S3Server(mode="process") as server:
        bucket = server.create_bucket()
        codes, _, err = _cli(_env(server, tmp_path), ["list", f"s3://{bucket}/run"])
    assert codes == [EXIT_STORE], err
    assert err.splitlines() == [err.strip()], err
    assert f"s3://{bucket}: access denied" in err


@pytest.mark.parametrize(
    "line, aws",
    [
        (b"E1202 05:25:01.950846   15394 common-io:5] static: Failed to open file.", True),
        (b"E1202 05:25:01.950886   15394 AuthCredentialsProvider:6146] static: x", True),
        (b"E1202 05:25:05.926432   15505 aws_api.cc:6148] (id=0x5) IMDS client failed", True),
        (b"E1202 05:25:05.926432   15505 s3_key_value_store.cc:412] a tensorstore error", False),
        (b"F1202 05:25:05.926432   15505 common-io:5] fatal", False),
        (b"Traceback (most recent call last):", None),
    ],
    ids=["common-io", "auth", "aws_api", "tensorstore-own", "fatal", "python"],
)
def test_which_lines_the_filter_drops(line, aws):
    assert is_aws_line(line) is aws
