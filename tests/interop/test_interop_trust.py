"""Trust rules on the interop surfaces: the Orbax, msgpack and safetensors importers
and the safetensors exporter (`flax-orbax import` / `flax-orbax export`).

Every test here uses real FIFOs and real symlinks. A test that would hang on a FIFO
fails through its timeout mark instead.
"""

import hashlib
import json
import logging
import os
import shutil

import msgpack
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import serialization
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._errors import CheckpointError, ForeignEntryError
from flax_orbax_plugin._format import foreign as _foreign
from flax_orbax_plugin._interop import importing as _importing
from flax_orbax_plugin._interop import msgpack_reader as _msgpack_import
from flax_orbax_plugin._interop import orbax_reader as _orbax_import
from flax_orbax_plugin._interop import safetensors as _safetensors
from flax_orbax_plugin._interop.importing import import_checkpoint

FAST = pytest.mark.timeout(30)
HYPOTHESIS = settings(
    derandomize=True,
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _tree_digest(root):
    """{relative path: (kind, sha256 or link target)} of everything under root."""
    out = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = ("dir", None)
            else:
                with open(path, "rb") as f:
                    out[rel] = ("file", hashlib.sha256(f.read()).hexdigest())
    return out


def _params(seed):
    rng = np.random.default_rng(seed)
    return {
        "Dense_0": {"kernel": rng.standard_normal((8, 4), dtype=np.float32)},
        "Dense_1": {"kernel": rng.standard_normal((4, 2), dtype=np.float32)},
        "bias": np.arange(3, dtype=np.float32) + seed,
    }


@pytest.fixture(scope="module")
def orbax_run(tmp_path_factory):
    """An Orbax CheckpointManager directory with steps 1 and 2 (digits folders)."""
    path = tmp_path_factory.mktemp("orbax") / "run"
    with ocp.CheckpointManager(path) as mngr:
        for step in (1, 2):
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_params(step))))
        mngr.wait_until_finished()
    return path


@pytest.fixture
def run(orbax_run, tmp_path):
    """A private copy of the Orbax run, free to damage."""
    dst = tmp_path / "run"
    shutil.copytree(orbax_run, dst, symlinks=True)
    return dst


def _fifo(path):
    if os.path.lexists(path):
        os.remove(path)
    os.mkfifo(path)
    return path


# -- FIFOs never block: every importer path --------------------------------------------


@FAST
def test_fifo_safetensors_file(tmp_path):
    fifo = _fifo(tmp_path / "model.safetensors")
    with pytest.raises(ForeignEntryError, match=r"model\.safetensors.*a FIFO"):
        _safetensors.from_safetensors(fifo)
    with pytest.raises(ForeignEntryError, match="a FIFO"):
        _safetensors.read_safetensors_index([fifo])


@FAST
def test_fifo_safetensors_shard(tmp_path):
    out = tmp_path / "hf"
    result = _safetensors.to_safetensors(_params(0), out, max_shard_size=40)
    assert len(result.files) > 1
    _fifo(result.files[1])
    with pytest.raises(ForeignEntryError, match=os.path.basename(result.files[1]) + ".*a FIFO"):
        _safetensors.from_safetensors(out)


@FAST
def test_fifo_safetensors_index(tmp_path):
    out = tmp_path / "hf"
    result = _safetensors.to_safetensors(_params(0), out, max_shard_size=40)
    _fifo(result.index)
    with pytest.raises(ForeignEntryError, match=r"index\.json.*a FIFO"):
        _safetensors.from_safetensors(result.index)
    with pytest.raises(CheckpointError):  # the directory: the FIFO is not taken for an index
        _safetensors.from_safetensors(out)


@FAST
def test_fifo_msgpack(tmp_path):
    fifo = _fifo(tmp_path / "checkpoint_5")
    with pytest.raises(ForeignEntryError, match=r"checkpoint_5.*a FIFO"):
        _msgpack_import.read_msgpack(fifo)
    with pytest.raises(ForeignEntryError, match="a FIFO"):
        import_checkpoint(fifo, tmp_path / "out")
    assert not _foreign.is_msgpack_checkpoint(fifo)
    # in a flax.training.checkpoints directory the FIFO is not a checkpoint: skipped
    (tmp_path / "ckpts").mkdir()
    _fifo(tmp_path / "ckpts" / "checkpoint_7")
    (tmp_path / "ckpts" / "checkpoint_8").write_bytes(serialization.to_bytes(_params(8)))
    assert _importing.import_msgpack(tmp_path / "ckpts", tmp_path / "out2") == [8]


@FAST
@pytest.mark.parametrize(
    "victim",
    [
        "2/state/manifest.ocdbt",
        "2/state/ocdbt.process_0/manifest.ocdbt",
        "2/state/_METADATA",
        "2/_CHECKPOINT_METADATA",
    ],
)
def test_fifo_orbax_manifest_and_metadata(run, tmp_path, victim):
    _fifo(run / victim)
    with pytest.raises(ForeignEntryError, match=os.path.basename(victim) + ".*a FIFO"):
        _orbax_import.restore_orbax(run / "2")
    with pytest.raises(CheckpointError, match="a FIFO"):
        _importing.import_orbax(run, tmp_path / "out")


@FAST
def test_fifo_orbax_data_file(run, tmp_path):
    data_dir = run / "2" / "state" / "ocdbt.process_0" / "d"
    victim = sorted(os.listdir(data_dir))[0]
    _fifo(data_dir / victim)
    with pytest.raises(ForeignEntryError, match=victim + ".*a FIFO"):
        _orbax_import.restore_orbax(run, step=2)
    with pytest.raises(ForeignEntryError, match=victim + ".*a FIFO"):
        _importing.import_orbax(run, tmp_path / "out", step=2)


# -- symlinks: the Orbax reader follows none below the named path ------------------------


@FAST
def test_orbax_symlinked_step_directory_is_refused(run, orbax_run, tmp_path):
    other = tmp_path / "other_run"
    shutil.copytree(orbax_run, other)
    os.symlink(other / "2", run / "3")  # a step that leads into another run
    before = _tree_digest(other)
    for call in (
        lambda: _orbax_import.orbax_steps(run),
        lambda: _orbax_import.restore_orbax(run),
        lambda: _importing.import_orbax(run, tmp_path / "out"),
    ):
        with pytest.raises(ForeignEntryError, match=r"run/3.*symbolic link"):
            call()
    assert _tree_digest(other) == before
    assert not (tmp_path / "out").exists()


@FAST
def test_orbax_symlinked_item_directory_is_refused(run, orbax_run, tmp_path):
    other = tmp_path / "other_run"
    shutil.copytree(orbax_run, other)
    shutil.rmtree(run / "2" / "state")
    os.symlink(other / "1" / "state", run / "2" / "state")
    with pytest.raises(ForeignEntryError, match=r"2/state.*symbolic link"):
        _orbax_import.restore_orbax(run / "2")
    with pytest.raises(ForeignEntryError, match=r"2/state.*symbolic link"):
        _importing.import_orbax(run, tmp_path / "out", step=2)


@FAST
@pytest.mark.parametrize("victim", ["_METADATA", "manifest.ocdbt", "data"])
def test_orbax_symlinked_file_in_an_item_is_refused(run, orbax_run, tmp_path, victim):
    item = run / "2" / "state"
    if victim == "data":
        data_dir = item / "ocdbt.process_0" / "d"
        victim = "ocdbt.process_0/d/" + sorted(os.listdir(data_dir))[0]
    target = orbax_run / "1" / "state" / victim
    os.remove(item / victim)
    os.symlink(target, item / victim)
    with pytest.raises(ForeignEntryError, match=os.path.basename(victim) + ".*symbolic link"):
        _orbax_import.restore_orbax(item)


# -- safetensors: where a link is expected (the Hugging Face cache) ----------------------


def _hf_cache(tmp_path, params):
    """snapshots/<rev>/*.safetensors -> ../../blobs/<hash>, as huggingface_hub lays out."""
    export = tmp_path / "export"
    result = _safetensors.to_safetensors(params, export, max_shard_size=40)
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for path in (*result.files, result.index):
        data = open(path, "rb").read()
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", digest), snap / os.path.basename(path))
    return snap


@FAST
def test_hugging_face_cache_symlinks_are_read(tmp_path):
    params = _params(3)
    snap = _hf_cache(tmp_path, params)
    got = _safetensors.from_safetensors(snap, params)
    for a, b in zip(
        jax_leaves(got), jax_leaves(params), strict=True
    ):  # bit-exact through the links
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@FAST
def test_a_shard_link_to_a_fifo_is_refused(tmp_path):
    snap = _hf_cache(tmp_path, _params(3))
    shard = sorted(p for p in os.listdir(snap) if p.endswith("00002-of-00003.safetensors"))
    target = snap / os.readlink(snap / shard[0])
    os.remove(target)
    os.mkfifo(target)
    with pytest.raises(ForeignEntryError, match="a FIFO"):
        _safetensors.from_safetensors(snap)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


# -- the exporter writes nothing through a link and removes only its own files ----------


@FAST
def test_export_never_follows_a_planted_temp_name(tmp_path):
    """Symlinks planted at every temp name the exporter used to use (``<final>.tmp-<pid>``)
    point at outside files: they stay byte-identical and the links stay links."""
    out = tmp_path / "hf"
    out.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    names += ["model.safetensors", "model.safetensors.index.json"]
    planted = {}
    for name in names:
        victim = outside / (name + ".precious")
        victim.write_bytes(b"do not overwrite " + name.encode())
        link = out / f"{name}.tmp-{os.getpid()}"
        os.symlink(victim, link)
        planted[link] = victim
    before = _tree_digest(outside)
    result = _safetensors.to_safetensors(_params(1), out, max_shard_size=40)
    assert len(result.files) == 3
    assert _tree_digest(outside) == before
    for link, victim in planted.items():
        assert os.path.islink(link) and os.readlink(link) == str(victim)
    # the outputs are new regular files, 0o644 less the umask
    umask = os.umask(0)
    os.umask(umask)
    for path in (*result.files, result.index):
        st = os.lstat(path)
        assert not os.path.islink(path) and (st.st_mode & 0o777) == (0o644 & ~umask)
    leftovers = [n for n in os.listdir(out) if ".tmp-" in n and out / n not in planted]
    assert leftovers == []


@FAST
def test_export_force_refuses_to_replace_what_is_not_ours(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    outside = tmp_path / "precious.bin"
    outside.write_bytes(b"outside")
    os.symlink(outside, out / "model.safetensors")  # a link at the final name
    with pytest.raises(FileExistsError):
        _safetensors.to_safetensors(_params(1), out)
    with pytest.raises(ForeignEntryError, match=r"model\.safetensors.*symbolic link"):
        _safetensors.to_safetensors(_params(1), out, force=True)
    assert outside.read_bytes() == b"outside" and os.path.islink(out / "model.safetensors")
    # a regular file we did not write (no marker) is not replaced either
    os.remove(out / "model.safetensors")
    foreign = b"\x08\0\0\0\0\0\0\0{}      "
    (out / "model.safetensors").write_bytes(foreign)
    with pytest.raises(ForeignEntryError, match="marker"):
        _safetensors.to_safetensors(_params(1), out, force=True)
    assert (out / "model.safetensors").read_bytes() == foreign
    assert sorted(os.listdir(out)) == ["model.safetensors"]  # no temp file left behind


@FAST
def test_export_force_leaves_files_an_old_index_names_that_are_not_ours(tmp_path, caplog):
    """An old index (ours) that also lists config.json, a look-alike shard without our
    marker and a shard-named link: export --force removes only our own stale shards."""
    directory = tmp_path / "ckpts"
    with fop.CheckpointManager(directory) as mngr:
        mngr.save(1, {"params": _params(1)})
    out = tmp_path / "export"
    assert cli.main(["export", str(directory), str(out), "--max-shard-size", "40"]) == 0
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    ours = sorted(set(index["weight_map"].values()))
    assert len(ours) == 3
    (out / "config.json").write_text('{"model_type": "mine"}')
    (out / "model-00004-of-00005.safetensors").write_bytes((8).to_bytes(8, "little") + b'{"a":1} ')
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"outside")
    os.symlink(outside, out / "model-00005-of-00005.safetensors")
    index["weight_map"].update(
        {
            "c": "config.json",
            "x": "model-00004-of-00005.safetensors",
            "y": "model-00005-of-00005.safetensors",
        }
    )
    index_path.write_text(json.dumps(index))  # still carries our marker
    keep = {
        n: _tree_digest(out).get(n) for n in ("config.json", "model-00004-of-00005.safetensors")
    }
    with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin._interop.safetensors"):
        rc = cli.main(["export", str(directory), str(out), "--max-shard-size", "1MB", "--force"])
    assert rc == 0
    after = _tree_digest(out)
    for name, digest in keep.items():
        assert after.get(name) == digest, name
    assert os.path.islink(out / "model-00005-of-00005.safetensors")
    assert outside.read_bytes() == b"outside"
    assert not any((out / n).exists() for n in ours)  # our own stale shards are gone
    assert not index_path.exists()  # and our own old index
    assert (out / "model.safetensors").is_file()
    assert "config.json" in caplog.text and "left alone" in caplog.text


# -- malformed input: a CheckpointError naming the file and the field --------------------


def _safetensors_bytes(header, data=b""):
    body = json.dumps(header).encode() if not isinstance(header, bytes) else header
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body + data


_BAD_HEADERS = {
    "negative offset": ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, 4),
    "huge offset": ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 2**70]}}, 4),
    "int64-overflowing shape": (
        {"t": {"dtype": "F32", "shape": [2**40, 2**40, 2**40], "data_offsets": [0, 4]}},
        4,
    ),
    "wrapping shape": ({"t": {"dtype": "U8", "shape": [2**32, 2**32], "data_offsets": [0, 0]}}, 0),
    "unknown dtype": ({"t": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, 16),
    "unhashable dtype": ({"t": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, 4),
    "bool in shape": ({"t": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4),
    "too many dims": ({"t": {"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 4]}}, 4),
    "three offsets": ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, 8),
    "entry not an object": ({"t": [1, 2]}, 0),
    "deep nesting": (b"[" * 100000 + b"]" * 100000, 0),
    "not an object": (b"[1, 2]", 0),
    "not utf-8": (b'{"\xff": 1}', 0),
}


@FAST
@pytest.mark.parametrize("case", sorted(_BAD_HEADERS))
def test_malformed_safetensors_headers(tmp_path, case):
    header, nbytes = _BAD_HEADERS[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(_safetensors_bytes(header, b"\0" * nbytes))
    with pytest.raises(CheckpointError, match=r"bad\.safetensors"):
        _safetensors.from_safetensors(path)


@FAST
@pytest.mark.parametrize(
    "index",
    [
        b"[" * 100000 + b"]" * 100000,
        b'{"weight_map": [1]}',
        b'{"weight_map": {"a": "../model.safetensors"}}',
        b'{"weight_map": {"a": 7}}',
        b'{"weight_map": {"a": ["x"]}}',
        b"\xff\xfe",
    ],
)
def test_malformed_safetensors_index(tmp_path, index):
    path = tmp_path / "model.safetensors.index.json"
    path.write_bytes(index)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        _safetensors.from_safetensors(path)


def _nd(shape, dtype, buffer):
    return msgpack.ExtType(1, msgpack.packb([shape, dtype, buffer]))


def _deep_map(depth):
    raw = b""
    for _ in range(depth):
        raw += b"\x81\xa1a"  # {"a": ...
    return raw + b"\xc0"


_BAD_MSGPACK = {
    "deep map nesting": _deep_map(900),
    "deeper than msgpack's stack": _deep_map(5000),
    "deep array nesting": b"\x81\xa1a" + b"\x91" * 900 + b"\xc0",
    "mixed key types": msgpack.packb({"a": 1, 2: 3}, strict_types=False),
    "bytes keys": msgpack.packb({b"a": 1, b"b": 2}, use_bin_type=True),
    "float keys": msgpack.packb({1.5: 1}),
    "int64-overflowing shape": msgpack.packb({"w": _nd([2**40, 2**40], "float32", b"\0" * 4)}),
    "wrapping shape": msgpack.packb({"w": _nd([2**32, 2**32], "uint8", b"")}),
    "bool in shape": msgpack.packb({"w": _nd([True], "float32", b"\0" * 4)}),
    "too many dims": msgpack.packb({"w": _nd([1] * 100, "float32", b"\0" * 4)}),
    "unhashable dtype": msgpack.packb({"w": _nd([1], ["float32"], b"\0" * 4)}),
    "object dtype": msgpack.packb({"w": _nd([1], "object", b"\0" * 8)}),
    "payload not a triple": msgpack.packb({"w": msgpack.ExtType(1, msgpack.packb(7))}),
    "complex payload": msgpack.packb({"w": msgpack.ExtType(2, msgpack.packb(["a", []]))}),
    "chunked, wrong count": msgpack.packb(
        {
            "w": {
                "__msgpack_chunked_array__": True,
                "shape": {"0": 2**40, "1": 2**40},
                "chunks": {"0": _nd([4], "float32", b"\0" * 16)},
            }
        }
    ),
    "chunked, bad shape": msgpack.packb(
        {
            "w": {
                "__msgpack_chunked_array__": True,
                "shape": {"0": "x"},
                "chunks": {"0": _nd([4], "float32", b"\0" * 16)},
            }
        }
    ),
    "chunked, shape not a map": msgpack.packb(
        {"w": {"__msgpack_chunked_array__": True, "shape": 5, "chunks": {}}}
    ),
    "truncated": msgpack.packb({"w": _nd([4], "float32", b"\0" * 16)})[:-5],
}


@FAST
@pytest.mark.parametrize("case", sorted(_BAD_MSGPACK))
def test_malformed_msgpack(tmp_path, case):
    path = tmp_path / "checkpoint_3"
    path.write_bytes(_BAD_MSGPACK[case])
    with pytest.raises(CheckpointError, match="checkpoint_3"):
        _msgpack_import.read_msgpack(path)
    with pytest.raises(CheckpointError, match="checkpoint_3"):
        _importing.import_msgpack(path, tmp_path / "out")


def _rewrite_json(path, edit):
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(edit(doc)))


def _first_leaf(doc):
    return next(iter(doc["tree_metadata"].values()))


def _set(doc, **fields):
    doc.update(fields)
    return doc


def _edit_leaf(change):
    def edit(doc):
        change(_first_leaf(doc))
        return doc

    return edit


def _add_leaf(entry):
    def edit(doc):
        doc["tree_metadata"]["extra"] = entry
        return doc

    return edit


_SEQ = 1
_BAD_ORBAX = {
    "tree_metadata not an object": ("_METADATA", lambda d: _set(d, tree_metadata=[1])),
    "use_ocdbt not a bool": ("_METADATA", lambda d: _set(d, use_ocdbt="no")),
    "use_zarr3 not a bool": ("_METADATA", lambda d: _set(d, use_zarr3=[1])),
    "key path too deep": (
        "_METADATA",
        _edit_leaf(lambda e: e.update(key_metadata=[{"key": "k", "key_type": 2}] * 1000)),
    ),
    "huge sequence index": (
        "_METADATA",
        _add_leaf(
            {
                "key_metadata": [{"key": 10**12, "key_type": _SEQ}],
                "value_metadata": {"value_type": "None"},
            }
        ),
    ),
    "negative sequence index": (
        "_METADATA",
        _add_leaf(
            {
                "key_metadata": [{"key": "-1", "key_type": _SEQ}],
                "value_metadata": {"value_type": "None"},
            }
        ),
    ),
    "sequence and dict keys mixed": (
        "_METADATA",
        _add_leaf(
            {
                "key_metadata": [{"key": 0, "key_type": _SEQ}],
                "value_metadata": {"value_type": "None"},
            }
        ),
    ),
    "a leaf that is also a parent": (
        "_METADATA",
        _add_leaf(
            {
                "key_metadata": [{"key": "bias", "key_type": 2}, {"key": "x", "key_type": 2}],
                "value_metadata": {"value_type": "None"},
            }
        ),
    ),
    "value_type missing": ("_METADATA", _edit_leaf(lambda e: e.pop("value_metadata"))),
    "key entry not an object": ("_METADATA", _edit_leaf(lambda e: e.update(key_metadata=[5]))),
    "deep JSON nesting": ("_METADATA", None),
    "item name escapes the step": (
        "../_CHECKPOINT_METADATA",
        lambda d: _set(d, item_handlers={"../1": "x", "state": "y"}),
    ),
    "deep step JSON nesting": ("../_CHECKPOINT_METADATA", None),
}


@FAST
@pytest.mark.parametrize("case", sorted(_BAD_ORBAX))
def test_malformed_orbax_metadata(run, tmp_path, case):
    name, edit = _BAD_ORBAX[case]
    path = run / "2" / "state" / name
    if edit is None:
        path.write_bytes(b"[" * 100000 + b"]" * 100000)
    else:
        _rewrite_json(path, edit)
    with pytest.raises(CheckpointError, match=os.path.basename(name)):
        _orbax_import.restore_orbax(run / "2")
    with pytest.raises(CheckpointError, match=os.path.basename(name)):
        _importing.import_orbax(run, tmp_path / "out", step=2)


@pytest.mark.timeout(60)
@HYPOTHESIS
@given(data=st.binary(max_size=200))
def test_random_bytes_give_only_checkpoint_errors(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("fuzz")
    cases = [
        (
            root / "a.safetensors",
            len(data).to_bytes(8, "little") + data,
            _safetensors.from_safetensors,
        ),
        (root / "b.safetensors", data, _safetensors.from_safetensors),
        (root / "m.safetensors.index.json", data, _safetensors.from_safetensors),
        (root / "checkpoint_1", data, _msgpack_import.read_msgpack),
        (root / "checkpoint_2", b"\x81\xa1a" + data, _msgpack_import.read_msgpack),
    ]
    for path, raw, reader in cases:
        path.write_bytes(raw)
        try:
            reader(path)
        except CheckpointError:
            pass


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=5),
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids, max_size=4)
    ),
    max_leaves=20,
)


_sizes = st.integers(-2, 4) | st.sampled_from([2**31, 2**32, 2**63, 2**64, 2**70])
_tensor_entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "U8", "BOOL", "F128", "f32"]) | _json_values,
        "shape": st.lists(_sizes, max_size=4) | _json_values,
        "data_offsets": st.lists(_sizes, min_size=2, max_size=2) | _json_values,
    },
)


@pytest.mark.timeout(60)
@HYPOTHESIS
@given(
    header=st.dictionaries(st.text(max_size=3), _tensor_entries | _json_values, max_size=3),
    data=st.binary(max_size=16),
)
def test_random_safetensors_headers_give_only_checkpoint_errors(tmp_path_factory, header, data):
    path = tmp_path_factory.mktemp("fuzz") / "f.safetensors"
    path.write_bytes(_safetensors_bytes(header, data))
    try:
        got = _safetensors.from_safetensors(path)
    except CheckpointError:
        return
    for name, value in got.items():  # what was accepted is what the header says
        assert list(value.shape) == header[name]["shape"]


@pytest.mark.timeout(120)
@settings(
    derandomize=True,
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    entry=st.fixed_dictionaries(
        {},
        optional={
            "key_metadata": st.lists(
                st.fixed_dictionaries(
                    {"key": st.integers(-3, 3) | st.text(max_size=3) | _json_values},
                    optional={"key_type": st.integers(0, 2) | _json_values},
                ),
                max_size=4,
            )
            | _json_values,
            "value_metadata": st.fixed_dictionaries(
                {"value_type": st.sampled_from(["None", "Dict", "List", "scalar", "x"])}
            )
            | _json_values,
        },
    ),
    flags=st.dictionaries(
        st.sampled_from(["use_ocdbt", "use_zarr3", "store_array_data_equal_to_fill_value"]),
        _json_values,
    ),
)
def test_random_orbax_metadata_gives_only_checkpoint_errors(
    orbax_run, tmp_path_factory, entry, flags
):
    item = tmp_path_factory.mktemp("fuzz") / "state"
    shutil.copytree(orbax_run / "2" / "state", item)
    doc = json.loads((item / "_METADATA").read_text())
    doc["tree_metadata"]["fuzzed"] = entry
    doc.update(flags)
    (item / "_METADATA").write_text(json.dumps(doc))
    try:
        _orbax_import.restore_orbax(item)
    except CheckpointError:
        pass


# -- an in-place import never touches the source's own folders ---------------------------


@FAST
def test_in_place_orbax_import_leaves_every_orbax_file_alone(run):
    before = _tree_digest(run)
    with pytest.raises(ForeignEntryError, match=r"run/1.*another output directory"):
        _importing.import_orbax(run, run)
    with pytest.raises(ForeignEntryError, match=r"run/2"):
        _importing.import_orbax(run, run, step=2, force=True)
    assert cli.main(["import", str(run), str(run), "--force"]) == cli.EXIT_ERROR
    assert _tree_digest(run) == before


@FAST
def test_import_refuses_a_user_folder_named_like_the_step(tmp_path):
    ckpts = tmp_path / "flax"
    ckpts.mkdir()
    (ckpts / "checkpoint_5").write_bytes(serialization.to_bytes({"params": _params(5)}))
    (ckpts / "5").mkdir()
    (ckpts / "5" / "notes.txt").write_text("mine")
    before = _tree_digest(ckpts)
    with pytest.raises(ForeignEntryError, match=r"flax/5"):
        _importing.import_msgpack(ckpts, ckpts, force=True)
    assert _tree_digest(ckpts) == before
    # into a fresh directory it works
    assert _importing.import_msgpack(ckpts, tmp_path / "out") == [5]


def test_an_import_never_writes_inside_its_own_source(run, tmp_path):
    """``import orbax_run orbax_run/sub`` (or into a step of it, or into a msgpack
    directory it reads) wrote a run inside the source and exited 0. Refused now, by
    every entry point, with nothing written."""
    before = _tree_digest(run)
    for src, out in ((run, run / "sub"), (run / "1", run / "1" / "conv"), (run, run / "2" / "x")):
        with pytest.raises(fop.UnsupportedLocationError, match="lies inside the source"):
            fop.import_orbax(src, out)
        assert cli.main(["import", str(src), str(out)]) == 2
    assert _tree_digest(run) == before
    msgd = tmp_path / "msgd"
    msgd.mkdir()
    (msgd / "checkpoint_1").write_bytes(serialization.to_bytes({"params": _params(1)}))
    with pytest.raises(fop.UnsupportedLocationError, match="lies inside the source"):
        fop.import_msgpack(msgd, msgd / "out")
    assert sorted(os.listdir(msgd)) == ["checkpoint_1"]
    assert fop.import_orbax(run, tmp_path / "beside") == [1, 2]  # outside it: imported
