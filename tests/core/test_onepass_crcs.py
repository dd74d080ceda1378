"""One pass for copy and checksum (issue 34, item 2): a manager's pooled snapshot
checksums each chunk as it copies it, and the writers (version 1's chunk files,
version 2's data files) store that checksum rather than computing it again. Every
chunk written must carry the crc32c of exactly the bytes written: checked against a
fresh crc32c (google_crc32c, not the package's crc) of the bytes on disk, with edge
chunks cut on the first and on a trailing axis, bfloat16, bool, a sharded leaf, a
numpy leaf and a packed sub-byte leaf (computed by the writer: not carried); with
the C kernel (``_zarr/_copycrc.c``) where it is built and with its fallback (the
kernel made absent: np.copyto, then crc32c, a piece at a time)."""

from __future__ import annotations

import json
import os

import google_crc32c
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import host as _host
from flax_orbax_plugin._core import host_snapshot as _host_snapshot
from flax_orbax_plugin._core import plan as _plan
from flax_orbax_plugin._zarr import arrays as _arrays
from flax_orbax_plugin._zarr import chunks as _crcs
from flax_orbax_plugin._zarr import packed_writer as _chunk_writer


@pytest.fixture
def small_geometry(monkeypatch):
    """Small leaves get arrays of their own and many chunks; pooled copies are cut into
    several pieces (copied on several threads) and chunks into several copy steps."""
    monkeypatch.setattr(_plan, "SMALL_LEAF_BYTES", 1 << 12)
    monkeypatch.setattr(_arrays, "CHUNK_TARGET_BYTES", 16 << 10)
    monkeypatch.setattr(_host, "COPY_PIECE", 40 << 10)
    monkeypatch.setattr(_crcs, "COPY_STEP", 4096)


@pytest.fixture(params=["kernel", "fallback"])
def carried(request, monkeypatch):
    """{chunk name: the crc32c the writer was handed (None: it computed one)}, recorded
    around the real ChunkWriter._write_chunk (PackedWriter's too), one pass on (by
    default only where the kernel is built: host_snapshot.ONE_PASS), copied by the
    kernel or by its fallback."""
    if request.param == "fallback":
        monkeypatch.setattr(_crcs, "_copycrc", None)
    elif not _crcs.has_kernel():
        pytest.skip("the C extension is not built here")
    monkeypatch.setattr(_host_snapshot, "ONE_PASS", True)
    seen: dict[str, int | None] = {}
    real = _chunk_writer.ChunkWriter._write_chunk

    def spy(self, name, view, chunk, crc):
        seen[name] = crc
        return real(self, name, view, chunk, crc)

    monkeypatch.setattr(_chunk_writer.ChunkWriter, "_write_chunk", spy)
    return seen


def _state(devices, v: int) -> dict:
    rng = np.random.default_rng(v)
    mesh = Mesh(np.array(devices).reshape(8), ("x",))
    return {
        "f": jnp.asarray(rng.standard_normal((150, 101), np.float32)),  # cut on axis 0
        "t": jnp.asarray(rng.standard_normal((3, 5001), np.float32)),  # chunks cut on axis 1
        "bf": jnp.asarray(rng.standard_normal((77, 129)), jnp.bfloat16),
        "b": jnp.asarray(rng.random((300, 61)) > 0.5),
        "s": jax.device_put(  # 8 shards of 64 rows
            rng.standard_normal((512, 40), np.float32), NamedSharding(mesh, P("x"))
        ),
        "n": rng.standard_normal((10007,)).astype(np.float64),  # numpy
        "i4": jnp.asarray(rng.integers(-8, 8, (200, 301)).astype(ml_dtypes.int4)),  # packed
    }


def _v1_files(item: str) -> dict[str, bytes]:
    """{chunk name: its file's bytes} of every array's chunk files (not the batches')."""
    out = {}
    for root, _, files in os.walk(os.path.join(item, "d")):
        for file in files:
            path = os.path.join(root, file)
            name = os.path.relpath(path, item)
            if "/c/" in name:
                with open(path, "rb") as f:
                    out[name] = f.read()
    return out


def _v2_bytes(item: str) -> dict[str, bytes]:
    index = json.load(open(os.path.join(item, "data", "0.json")))
    names = [f["name"] for f in index["files"]]
    out = {}
    for key, (n, offset, length, crc) in index["chunks"].items():
        with open(os.path.join(item, "data", names[n]), "rb") as f:
            f.seek(offset)
            segment = f.read(length)
        assert int.from_bytes(segment[-4:], "little") == crc, key  # the index's crc
        out[key] = segment
    return out


@pytest.mark.parametrize("version", [1, 2])
def test_every_carried_crc32c_is_that_of_the_bytes_written(
    tmp_path, devices, small_geometry, carried, version
):
    pooled = {"reuse_host_buffers": True}  # the pooled copy carries the crcs
    with fop.CheckpointManager(tmp_path, format_version=version, keep=3, **pooled) as mngr:
        for step in (1, 2):  # the second save copies into the first one's buffers
            carried.clear()
            state = _state(devices, step)
            mngr.save(step, {"params": state})
            mngr.wait()
            item = os.path.join(tmp_path, str(step), "params")
            written = _v2_bytes(item) if version == 2 else _v1_files(item)
            assert set(carried) == set(written)  # every chunk went through the writer
            packed = f"d/{sorted(state).index('i4')}/"  # the leaves' order: their paths'
            for name, crc in carried.items():
                data = written[name]
                fresh = google_crc32c.value(data[:-4])
                assert int.from_bytes(data[-4:], "little") == fresh, name
                if name.startswith(packed):
                    assert crc is None, name  # packed in the background: not carried
                else:
                    assert crc == fresh, name  # carried: the crc32c of the bytes written
            assert sum(c is not None for c in carried.values()) >= 25
            restored = mngr.restore(step=step)["params"]
            for key, value in state.items():
                assert np.array_equal(np.asarray(restored[key]), np.asarray(value)), key
            assert all(r.ok for r in fop.verify(os.path.join(tmp_path, str(step))))


def test_one_pass_is_on_by_default_where_the_kernel_is_built():
    assert _host_snapshot.ONE_PASS == _crcs.has_kernel()
