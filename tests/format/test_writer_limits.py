"""A writer never commits what a reader refuses (``_storage/local_files.py``: one
declaration of the reader's limits per document kind, used by both sides).

Refused at save time, naming the document or the leaf, with nothing left at the
target: metadata past the reader's size (520 text leaves, each within its own
limit), text UTF-8 cannot encode (a lone surrogate in a str leaf, a dict key, an
extras value or key), JSON items past their size or depth; and times a reader could
not format are refused when read back (a resealed manifest)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._storage import local_files as json_docs


def _nothing_left(parent) -> None:
    """Only what the test made itself (no staging, no step) under ``parent``."""
    left = sorted(os.listdir(parent))
    assert all(not name[0].isdigit() and ".partial-" not in name for name in left), left


def test_text_leaves_whose_metadata_no_reader_accepts_are_refused_before_staging(tmp_path):
    # 520 leaves of 65400 bytes in UTF-8 (within 64 KiB each), 130 KB each once escaped
    tree = {f"l{i}": "\u4e00" * 21_800 for i in range(520)}
    with pytest.raises(fop.StructureError, match=r"_METADATA.json.*520 leaves.*67108864"):
        fop.save(tmp_path / "ckpt", tree)
    assert os.listdir(tmp_path) == []
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        with pytest.raises(fop.StructureError, match="_METADATA.json"):
            mngr.save(1, {"params": {"w": np.ones(3)}, "opt_state": tree})
        mngr.wait()
        assert mngr.steps() == []
    _nothing_left(tmp_path / "run")


def test_the_exact_metadata_size_is_checked_against_the_same_declaration(tmp_path, monkeypatch):
    """Past the build's lower bound, the encoded document itself is checked (in the
    background): the save fails and leaves nothing; what is written under the limit
    is read back under the same one."""
    small = json_docs.DocKind("metadata document (_METADATA.json)", 4000, 64, unique_keys=False)
    monkeypatch.setattr(json_docs, "METADATA", small)
    tree = {f"leaf_{i}": np.full(3, i, np.float32) for i in range(30)}
    with pytest.raises(fop.StructureError, match=r"_METADATA.json.*more than a reader accepts"):
        fop.save(tmp_path / "ckpt", tree)
    assert os.listdir(tmp_path) == []
    fop.save(tmp_path / "ckpt", dict(list(tree.items())[:5]))
    assert sorted(fop.restore(tmp_path / "ckpt")) == [f"leaf_{i}" for i in range(5)]


@pytest.mark.parametrize(
    "tree, named",
    [
        ({"a": "x\ud800"}, r"leaf 'a': a str that UTF-8 cannot encode.*'\\ud800'"),
        ({"k\udc00": np.ones(3)}, r"leaf path 'k\\udc00': a key that UTF-8 cannot encode"),
        ({"ok": {"k\udc00": "v"}}, r"leaf path 'ok/k\\udc00'"),
    ],
)
@pytest.mark.parametrize("entry", ["save", "save_async", "manager"])
def test_text_utf8_cannot_encode_is_refused_naming_the_leaf(tmp_path, tree, named, entry):
    if entry == "manager":
        with fop.CheckpointManager(tmp_path / "run") as mngr:
            with pytest.raises(fop.StructureError, match=named):
                mngr.save(1, {"params": tree})
            assert mngr.steps() == []
        _nothing_left(tmp_path / "run")
        return
    with pytest.raises(fop.StructureError, match=named):
        getattr(fop, entry)(tmp_path / "ckpt", tree)
    assert os.listdir(tmp_path) == []


def _deep(n):
    x: list = []
    for _ in range(n):
        x = [x]
    return x


@pytest.mark.parametrize(
    "extras, named",
    [
        ({"note": "x\ud800"}, r"extras/note: text that UTF-8 cannot encode"),
        ({"k\udfff": 1.0}, r"extras: the key 'k\\udfff': text that UTF-8 cannot encode"),
        ({"deep": _deep(5000)}, r"extras/deep.*nested more than 100 levels"),
        ({"blob": "x" * (64 << 20)}, r"extras/value.json: a JSON item .* more than a reader"),
    ],
)
def test_extras_no_reader_accepts_are_refused_at_save_time(tmp_path, extras, named):
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        with pytest.raises(fop.StructureError, match=named):
            mngr.save(1, {"params": {"w": np.ones(3)}}, extras=extras)
        mngr.wait()
        assert mngr.steps() == []
        mngr.save(2, {"params": {"w": np.ones(3)}}, extras={"loss": 0.5})
    _nothing_left_but = sorted(os.listdir(tmp_path / "run"))
    assert [n for n in _nothing_left_but if n[0].isdigit()] == ["2"], _nothing_left_but


def test_a_resealed_manifest_time_past_year_9999_is_damage_named(tmp_path, capsys):
    d = tmp_path / "run"
    with fop.CheckpointManager(d) as mngr:
        mngr.save(1, {"params": {"w": np.ones(3)}})
    path = d / "1" / _layout.MANIFEST_FILE
    body = json.loads(path.read_bytes())
    body.pop("checksum")
    body["time"] = 1e20
    path.write_bytes(_layout.seal(body))
    with pytest.raises(fop.CorruptCheckpointError, match=r"_CHECKPOINT.json: field time"):
        _layout.manifest_from_bytes(path.read_bytes(), str(path))
    cli.main(["list", str(d)])  # names the damage; no OverflowError from formatting it
    out, err = capsys.readouterr()
    assert "OverflowError" not in out + err and "Traceback" not in out + err


class _Iterator:
    def __init__(self, state):
        self.state = state

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state


@pytest.mark.parametrize(
    "state, named",
    [
        ({"pos": "x\udc80"}, r"data_iterator/pos: text that UTF-8 cannot encode"),
        ({"pos": _deep(3000)}, r"data_iterator/pos.*nested more than 100 levels"),
        ({"seen": "y" * (64 << 20)}, r"process_0.json: a JSON item .* more than a reader"),
    ],
)
def test_an_iterator_state_no_reader_accepts_is_refused_at_save_time(tmp_path, state, named):
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        with pytest.raises(fop.StructureError, match=named):
            mngr.save(1, {"params": {"w": np.ones(3)}}, data_iterator=_Iterator(state))
        mngr.wait()
        assert mngr.steps() == []
    _nothing_left(tmp_path / "run")


def test_records_never_write_a_time_no_reader_could_format():
    with pytest.raises(ValueError, match=r"_CHECKPOINT.json: field time: expected a time"):
        _layout.StepManifest(1, {}, {}, time=1e20).to_bytes()
    with pytest.raises(ValueError, match=r"_COMMITTED: field committed_at: expected a time"):
        _layout.CommitMarker({_layout.METADATA_FILE: "0" * 64}, committed_at=-1.0).to_bytes()
    with pytest.raises(ValueError, match=r"_METADATA.json: field created_at: expected a time"):
        _layout.CheckpointDocument((), {}, created_at=float("nan")).to_json()
    raw = _layout.StepManifest(1, {}, {}, time=json_docs.MAX_TIME).to_bytes()
    assert _layout.manifest_from_bytes(raw, "m").time == json_docs.MAX_TIME
