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
        if k.startswith(("1/params/b/", "1/params/data/0-")):  # v1 batches, v2 data files
            remote.delete(k)
    rc, out, err = run(capsys, "verify", url, "--all")
    assert rc == 1
    assert "DAMAGED  step 1/params" in out and "DAMAGED  step 2/extras" in out
    assert "ok       step 2/params" in out


# -- what a path argument names (issue 32): a store URL is written there or refused ------


def _no_local_name_made(tmp_path):
    """Nothing named like a URL was created as a local folder (``./s3:/bucket``)."""
    made = sorted(p.name for p in tmp_path.iterdir() if ":" in p.name)
    assert made == [], made


def test_export_to_a_store_url_is_refused_naming_out(remote, capsys, tmp_path, monkeypatch):
    url = remote.url
    _fill(url)
    monkeypatch.chdir(tmp_path)
    keys = remote.keys()
    for out in (remote.join("hf").url, url.replace("://", ":/", 1) + "/hf", "memory://hf"):
        rc, _, err = run(capsys, "export", url, out)
        assert rc == cli.EXIT_ERROR, out
        assert f"OUT {out!r}" in err and len(err.splitlines()) == 1
        assert "must be a local path" in err or "no '//'" in err
    rc, _, err = run(capsys, "export", url, "x.safetensors", "--key-map", remote.join("k").url)
    assert rc == cli.EXIT_ERROR and "--key-map" in err and "local path" in err
    _no_local_name_made(tmp_path)
    assert not (tmp_path / "x.safetensors").exists()
    assert remote.keys() == keys  # nothing written to the bucket either


def test_python_exporters_and_importers_refuse_a_store_url(remote, tmp_path, monkeypatch):
    url = remote.url
    _fill(url)
    monkeypatch.chdir(tmp_path)
    hf = remote.join("hf").url
    with pytest.raises(
        fop.UnsupportedLocationError, match="safetensors output .* names an object store"
    ):
        fop.to_safetensors(f"{url}/2/params", hf)
    with pytest.raises(
        fop.UnsupportedLocationError, match="safetensors output .* names an object store"
    ):
        fop.to_safetensors({"w": np.zeros(3, np.float32)}, remote.spec)
    with pytest.raises(
        fop.UnsupportedLocationError, match="safetensors source .* names an object store"
    ):
        fop.from_safetensors(hf)
    with pytest.raises(
        fop.UnsupportedLocationError, match="safetensors file .* names an object store"
    ):
        fop.from_safetensors([f"{hf}/model.safetensors"])
    with pytest.raises(
        fop.UnsupportedLocationError, match="msgpack source .* names an object store"
    ):
        fop.import_msgpack(f"{url}/state.msgpack", tmp_path / "out")
    with pytest.raises(
        fop.UnsupportedLocationError, match="msgpack checkpoint .* names an object store"
    ):
        fop.restore_msgpack(f"{url}/state.msgpack")
    _no_local_name_made(tmp_path)
    assert not (tmp_path / "out").exists()


def test_import_reads_and_writes_store_urls_or_says_why_not(remote, capsys, tmp_path):
    """OUT on a bucket is written through the library (a manager directory there);
    a SOURCE on a bucket holding no Orbax checkpoint is refused as a msgpack source."""
    from flax import serialization

    state = {"params": {"w": np.arange(6, dtype=np.float32)}}
    (tmp_path / "checkpoint_3").write_bytes(serialization.to_bytes(state))
    out = remote.join("imported").url
    rc, _, err = run(capsys, "import", tmp_path / "checkpoint_3", out)
    assert rc == 0, err
    np.testing.assert_array_equal(fop.restore_params(out)["w"], state["params"]["w"])
    rc, _, err = run(capsys, "import", remote.join("nothing").url, tmp_path / "o")
    assert rc == cli.EXIT_ERROR
    assert "no Orbax checkpoint" in err and "local disk" in err and "ValueError" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["list", "{u}"],
        ["inspect", "{u}"],
        ["verify", "{u}"],
        ["gc", "{u}"],
        ["export", "{u}", "{t}/x.safetensors"],
        ["export", "{t}/ckpt", "{u}"],
        ["import", "{u}", "{t}/o"],
        ["import", "{t}/ckpt", "{u}"],
    ],
)
@pytest.mark.parametrize("url", ["ftp://host/run", "s3:bucket/run", "gs:///run"])
def test_every_path_argument_names_itself_when_it_names_no_store(
    argv, url, capsys, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    fop.save(tmp_path / "ckpt", {"w": np.zeros(2, np.float32)})
    rc, _, err = run(capsys, *[a.format(u=url, t=tmp_path) for a in argv])
    assert rc == cli.EXIT_ERROR
    position = argv.index("{u}")
    name = {"list": "DIRECTORY", "gc": "DIRECTORY", "import": "SOURCE"}.get(argv[0], "PATH")
    if position == 2:
        name = "OUT"
    assert f"{name} {url!r}" in err, err
    assert "ValueError" not in err and len(err.splitlines()) == 1
    _no_local_name_made(tmp_path)


def test_a_file_url_with_a_host_is_refused_not_read_as_another_path(capsys, tmp_path):
    """``file://ckpts/run`` would name ``/run``: refused, naming the argument."""
    rc, _, err = run(capsys, "list", "file://ckpts/run")
    assert rc == cli.EXIT_ERROR and "DIRECTORY 'file://ckpts/run'" in err and "file:///" in err
    with pytest.raises(fop.UnsupportedLocationError, match="expected file:///"):
        fop.restore("file://ckpts/run")
    fop.save(f"file://{tmp_path}/ckpt", {"w": np.ones(2, np.float32)})  # file:///abs works
    np.testing.assert_array_equal(fop.restore(tmp_path / "ckpt")["w"], np.ones(2))


def test_memory_urls_on_the_command_line_are_warned_of(capsys, tmp_path):
    """A memory:// store lives in one process: from a shell, an import there exited 0
    and silently lost it all. main() called in-process still works (shared store)."""
    from flax import serialization

    (tmp_path / "checkpoint_1").write_bytes(serialization.to_bytes({"w": np.ones(2)}))
    url = "memory://cli-warned/run"
    cases = {"import": ["import", tmp_path / "checkpoint_1", url], "list": ["list", url]}
    cases["verify"] = ["verify", url]
    names = {"import": "OUT", "list": "DIRECTORY", "verify": "PATH"}
    for command, argv in cases.items():
        rc, out, err = run(capsys, *argv)
        assert rc == 0, out + err
        assert f"warning: {names[command]} {url!r}: memory:// lives inside one" in err, err


def test_a_dry_run_beside_a_live_writer_on_a_bucket_says_a_real_gc_would_refuse(remote, capsys):
    """As on local disk (its lock): a live lease was not looked at, so the dry run listed
    the writer's saves in flight as 'would remove unfinished' without a word."""
    import warnings

    with fop.CheckpointManager(remote.url) as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}})
        mngr.wait()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            rc, out, _ = run(capsys, "gc", remote.url, "--dry-run")
        assert rc == 0 and "dry run: nothing was removed" in out
        said = [str(w.message) for w in seen]
        assert any("a real gc would refuse" in m and "lease" in m for m in said), said
        rc, _, err = run(capsys, "gc", remote.url)  # as the warning says
        assert rc == 2 and "gc removes nothing while a training job writes there" in err, err
    with warnings.catch_warnings(record=True) as seen:  # closed: its lease let go
        warnings.simplefilter("always")
        run(capsys, "gc", remote.url, "--dry-run")
    assert not any("a real gc would refuse" in str(w.message) for w in seen)
