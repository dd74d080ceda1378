"""Optional zstd compression, per core save or per manager item: recorded in the
metadata (restore needs no option), checksummed after compression, cross-checked
against each array's zarr.json."""

import json
import os

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format import layout as _layout


def _tree():
    rng = np.random.default_rng(0)
    return {
        "w": rng.integers(0, 4, (600, 512)).astype(np.float32),  # compressible, own array
        "small": {f"b{i}": np.full((64,), i, np.float32) for i in range(20)},  # a batch
    }


def _bytes(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _same(a[k], b[k])
        else:
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes()


def test_core_save_with_zstd_round_trips_and_is_smaller(tmp_path):
    tree = _tree()
    fop.save(tmp_path / "plain", tree)
    fop.save(tmp_path / "zstd", tree, compression="zstd:5")
    _same(tree, fop.restore(tmp_path / "zstd"))
    assert _bytes(tmp_path / "zstd") < 0.5 * _bytes(tmp_path / "plain")
    meta = json.loads((tmp_path / "zstd" / _layout.METADATA_FILE).read_bytes())
    w = next(r for r in meta["leaves"] if r["path"] == "w")
    assert w["storage"]["codec"] == "zstd:5"
    assert all(b["codec"] == "zstd:5" for b in meta["batches"].values())
    assert fop.verify(tmp_path / "zstd")[0].ok


def test_manager_compresses_only_the_items_asked(tmp_path):
    tree = _tree()
    with fop.CheckpointManager(tmp_path, compression={"opt_state": "zstd"}) as mngr:
        mngr.save(1, {"params": tree, "opt_state": tree})
    step = tmp_path / "1"
    assert _bytes(step / "opt_state") < 0.5 * _bytes(step / "params")
    out = fop.CheckpointManager(tmp_path, read_only=True).restore(items=("params", "opt_state"))
    _same(tree, out["params"])
    _same(tree, out["opt_state"])
    _same(tree, fop.restore_params(tmp_path))
    assert all(r.ok for r in fop.verify(tmp_path))


def test_a_codec_that_disagrees_with_zarr_json_is_an_error(tmp_path):
    """The codec is part of what restore cross-checks: a metadata file (resealed, so
    its checksum holds) claiming no compression for a compressed array is refused."""
    fop.save(tmp_path / "c", _tree(), compression="zstd")
    meta_path = tmp_path / "c" / _layout.METADATA_FILE
    doc = json.loads(meta_path.read_bytes())
    next(r for r in doc["leaves"] if r["path"] == "w")["storage"].pop("codec")
    raw = json.dumps(doc).encode()
    meta_path.write_bytes(raw)
    marker = json.loads((tmp_path / "c" / _layout.COMMIT_FILE).read_bytes())
    marker.pop("checksum")
    marker["files"][_layout.METADATA_FILE] = _layout.sha256(raw)
    (tmp_path / "c" / _layout.COMMIT_FILE).write_bytes(_layout.seal(marker))
    with pytest.raises(fop.CorruptCheckpointError, match="'w'"):
        fop.restore(tmp_path / "c")


@pytest.mark.parametrize("bad", ["gzip", "zstd:0", "zstd:23", 5])
def test_unknown_compression_is_refused_up_front(tmp_path, bad):
    with pytest.raises(ValueError, match="compression"):
        fop.save(tmp_path / "c", _tree(), compression=bad)
    with pytest.raises(ValueError, match="compression"):
        fop.CheckpointManager(tmp_path / "run", compression={"opt_state": bad})
