"""A step's JSON items (``step``, ``extras``, ``data_iterator``) pointed at on their own,
on every store (issue 32): verify calls them ok (and damaged only when they are),
fop.restore returns their value, fop.metadata describes them, and ``flax-orbax list``
of a step or of an item says what it is, instead of "DAMAGED" and "not steps"."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _trust_world import MemoryLocation

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli

pytest_plugins = ["_servers"]

EXTRAS = {"loss": 0.25, "note": "best"}


@pytest.fixture(params=["local", "s3", "gcs", "memory"])
def store(request, tmp_path):
    """(url of a run directory, put(key, bytes) under it) on one store."""
    if request.param == "local":
        root = tmp_path / "run"

        def put(key, data):
            (root / key).write_bytes(data)

        return str(root), put
    where = (
        MemoryLocation().join("run")
        if request.param == "memory"
        else request.getfixturevalue(f"{request.param}_location")
    )
    kv = where.kvstore()
    return where.url, lambda key, data: kv.write(key, data).result()


def _save(url):
    it = fop.StepIndexedIterator(lambda i: i)
    next(it), next(it)
    with fop.CheckpointManager(url, async_save=False) as mngr:
        mngr.save(
            3,
            {"params": {"w": np.arange(4, dtype=np.float32)}, "step": 3},
            data_iterator=it,
            extras=EXTRAS,
        )
    return it.get_state()


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_items_verify_restore_and_describe(store, capsys):
    url, _ = store
    state = _save(url)
    values = {"step": 3, "extras": EXTRAS, "data_iterator": state}
    for name, value in values.items():
        item = f"{url}/3/{name}"
        (result,) = fop.verify(item)
        assert result.ok and (result.step, result.item) == (3, name), result
        assert fop.restore(item) == value
        meta = fop.metadata(item)
        assert meta.leaves == {} and meta.kind == {"extras": "json"}.get(name, name)
        rc, out, err = run(capsys, "verify", item)
        assert rc == 0 and f"ok       step 3/{name}" in out, out + err
        rc, out, err = run(capsys, "inspect", item)
        assert rc == 0 and json.dumps(value, sort_keys=True)[:40] in out.replace("JSON ", ""), out
    assert fop.metadata(f"{url}/3/params").kind == "pytree"
    # a like shapes the step as the manager's restore does
    assert fop.restore(f"{url}/3/step", np.int64(0)).dtype == np.int64


def test_list_of_a_step_and_of_an_item_say_what_they_are(store, capsys):
    url, _ = store
    _save(url)
    rc, out, err = run(capsys, "list", f"{url}/3")
    assert rc == 0, err
    assert "step 3 of the run directory" in out and "not steps" not in out
    assert (
        "items: data_iterator (data_iterator), extras (json), params (pytree), step (step)" in out
    )
    assert "loss=0.25" in out
    for name, kind in [("params", "pytree"), ("extras", "json"), ("step", "step")]:
        rc, out, err = run(capsys, "list", f"{url}/3/{name}")
        assert rc == 0, err
        assert f"item {name!r} ({kind}) of step 3" in out and "not steps" not in out


def test_a_damaged_json_item_is_still_called_damaged(store, capsys):
    url, put = store
    _save(url)
    put("3/extras/value.json", json.dumps({"loss": 9.0, "note": "best"}).encode())
    (result,) = fop.verify(f"{url}/3/extras")
    assert not result.ok and "checksum" in (result.error or "").lower()
    rc, out, _ = run(capsys, "verify", f"{url}/3/extras")
    assert rc == cli.EXIT_DAMAGED and "DAMAGED  step 3/extras" in out
    with pytest.raises(fop.CorruptCheckpointError):
        fop.restore(f"{url}/3/extras")
    (result,) = fop.verify(f"{url}/3/step")
    assert result.ok


def test_changes_meant_for_pytrees_are_refused_for_a_json_item(tmp_path):
    _save(tmp_path / "run")
    with pytest.raises(fop.CheckpointError, match="partial= apply to pytrees"):
        fop.restore(tmp_path / "run" / "3" / "extras", partial=True)


def test_export_of_a_json_item_says_it_holds_no_arrays(tmp_path, capsys):
    _save(tmp_path / "run")
    rc, _, err = run(
        capsys, "export", tmp_path / "run", tmp_path / "x.safetensors", "--item", "extras"
    )
    assert rc == cli.EXIT_ERROR and "item 'extras' holds a JSON value (json)" in err
    assert not (tmp_path / "x.safetensors").exists()
