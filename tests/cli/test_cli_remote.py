"""The CLI is a client of the library: every subcommand works on s3:// (a real
S3-compatible server on 127.0.0.1) and gs:// (the GCS emulator), as on local disk."""

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli

pytest_plugins = ["_servers"]


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _fill(url):
    with fop.CheckpointManager(url) as m:
        for step in (1, 2):
            m.save(
                step,
                {"params": {"w": np.full((64, 8), step, np.float32)}, "step": step},
                extras={"loss": 1.0 / step},
            )


@pytest.fixture(params=["s3", "gcs"])
def remote(request):
    return request.getfixturevalue(f"{request.param}_location")


def test_every_subcommand_on_a_bucket(remote, capsys, tmp_path):
    url = remote.url
    _fill(url)
    rc, out, _ = run(capsys, "list", url)
    assert rc == 0 and "2 step(s)" in out and "loss=0.5" in out
    rc, out, _ = run(capsys, "inspect", url, "--item", "params")
    assert rc == 0 and "(64, 8)" in out and "float32" in out and "extras" not in out
    rc, out, _ = run(capsys, "verify", url, "--all")
    assert rc == 0 and out.count("ok ") == 6
    rc, out, _ = run(capsys, "export", url, tmp_path / "p.safetensors")
    assert rc == 0
    from safetensors.numpy import load_file

    np.testing.assert_array_equal(load_file(tmp_path / "p.safetensors")["w"], np.full((64, 8), 2))
    rc, out, _ = run(capsys, "gc", url, "--keep", "1")
    assert rc == 0 and "removed steps: 1" in out
    assert fop.CheckpointManager(url, read_only=True).steps() == [2]


def test_verify_on_a_bucket_reports_damage_and_goes_on(remote, capsys):
    url = remote.url
    _fill(url)
    key = next(k for k in remote.keys() if k.startswith("2/extras/"))
    remote.delete(key)
    for k in remote.keys():
        if k.startswith("1/params/b/"):
            remote.delete(k)
    rc, out, err = run(capsys, "verify", url, "--all")
    assert rc == 1
    assert "DAMAGED  step 1/params" in out and "DAMAGED  step 2/extras" in out
    assert "ok       step 2/params" in out
