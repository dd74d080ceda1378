"""_chunk_files: zarr3 chunk files written straight from host memory on local disk.

The reference is tensorstore itself: every file must be byte for byte the one
tensorstore writes for the same spec and values, for every supported dtype, chunks cut
by the array's end, chunks that are not contiguous in the source, and batches of any
size; tensorstore must read them back and catch damage through their checksums.
"""

import errno
import os

import jax
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._errors import CheckpointError
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._format.layout import BatchRecord
from flax_orbax_plugin._storage import location as _storage
from flax_orbax_plugin._zarr import arrays as _arrays
from flax_orbax_plugin._zarr import chunk_files as _chunk_files
from flax_orbax_plugin._zarr import packed_writer as _chunk_writer


def _files(root):
    out = {}
    for parent, _, names in os.walk(root):
        for name in names:
            if name != "zarr.json":
                path = os.path.join(parent, name)
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = f.read()
    return out


def _values(dtype_name, shape, seed=0):
    dtype = _layout.dtype_from_name(dtype_name)
    rng = np.random.default_rng(seed)
    if dtype_name == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype_name == "int4":
        return rng.integers(-8, 8, size=shape).astype(dtype)
    return rng.integers(0, 100, size=shape).astype(dtype)


def _both(tmp_path, make_spec, write_direct, values):
    """Files of the same array written by tensorstore and by ChunkFileWriter."""
    out = []
    for who in ("tensorstore", "direct"):
        root = tmp_path / who
        spec = make_spec(_storage.Location.from_path(root))
        _arrays.create(spec).result()
        if who == "tensorstore":
            store = _arrays.open_for_write(spec)
            store[...].write(_arrays.as_stored(values, store.dtype.numpy_dtype)).result()
        else:
            with _chunk_writer.ChunkFileWriter(str(root)) as writer:
                futures = write_direct(writer)
                assert futures is not None
                for future in futures:
                    future.result()
        out.append(_files(root))
    return out


@pytest.mark.parametrize("dtype_name", sorted(_layout.SUPPORTED_DTYPES))
@pytest.mark.parametrize(
    "shape,chunk",
    [
        ((10, 7), (4, 7)),  # last chunk cut by the end: zero-padded
        ((9,), (4,)),
        ((6, 5, 3), (2, 5, 3)),
        ((5, 6), (5, 2)),  # chunks along axis 1: not contiguous in the source
        ((8, 8), (3, 5)),  # cut along both axes
    ],
)
def test_array_chunks_are_the_bytes_tensorstore_writes(tmp_path, dtype_name, shape, chunk):
    values = _values(dtype_name, shape)
    itemsize = _layout.dtype_from_name(dtype_name).itemsize
    region = tuple(slice(None) for _ in shape)
    ts_files, direct_files = _both(
        tmp_path,
        lambda loc: _arrays.spec(loc, "x", shape, dtype_name, list(chunk), itemsize),
        lambda writer: writer.array("x", shape, chunk, region, values),
        values,
    )
    assert ts_files and direct_files == ts_files


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "int8", "bool", "complex128"])
@pytest.mark.parametrize("size", [1, 5, 1000, 70_000, 300_000])
def test_batch_shards_are_the_bytes_tensorstore_writes(tmp_path, dtype_name, size):
    """Up to 3 files (the last one short: inner chunks past the end are not stored),
    several inner chunks each (the last one cut by the end: zero-padded)."""
    chunk = min(1 << 17, 1 << (size - 1).bit_length())
    record = BatchRecord("b", dtype_name, 0, size, chunk, None)
    values = _values(dtype_name, (size,))
    inner = record.inner
    ts_files, direct_files = _both(
        tmp_path,
        lambda loc: _arrays.batch_spec(loc, record),
        lambda writer: writer.batch("b/b", record.chunk, inner, values),
        values,
    )
    assert ts_files and direct_files == ts_files


def test_a_region_of_partial_chunks_is_declined_and_nothing_written(tmp_path):
    values = np.ones((6, 4), np.float32)
    with _chunk_writer.ChunkFileWriter(str(tmp_path)) as writer:
        # starts inside a chunk / stops inside one before the array's end
        assert writer.array("x", (12, 4), (4, 4), (slice(2, 8), slice(None)), values) is None
        assert writer.array("x", (12, 4), (4, 4), (slice(0, 6), slice(None)), values) is None
    assert os.listdir(tmp_path) == []


def test_short_writes_are_resumed(tmp_path, monkeypatch):
    real = os.writev

    def at_most_1000_bytes(fd, buffers):
        first = memoryview(buffers[0]).cast("B")
        return real(fd, [first[:1000]])

    monkeypatch.setattr(_chunk_files.os, "writev", at_most_1000_bytes)
    shape, chunk = (50, 30), (20, 30)
    values = _values("float32", shape)
    ts_files, direct_files = _both(
        tmp_path,
        lambda loc: _arrays.spec(loc, "x", shape, "float32", list(chunk), 4),
        lambda writer: writer.array("x", shape, chunk, (slice(None), slice(None)), values),
        values,
    )
    assert direct_files == ts_files


def test_an_existing_file_or_symlink_is_never_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    root = tmp_path / "root"
    (root / "x" / "c").mkdir(parents=True)
    os.symlink(outside, root / "x" / "c" / "0")
    values = np.ones((4,), np.float32)
    with _chunk_writer.ChunkFileWriter(str(root)) as writer:
        (future,) = writer.array("x", (4,), (4,), (slice(None),), values)
        with pytest.raises(OSError) as info:
            future.result()
    assert info.value.errno in (errno.EEXIST, errno.ELOOP)
    assert outside.read_bytes() == b"keep"


def _tree():
    """4 MiB chunks: several per large leaf, the last one cut; a leaf sharded along axis
    1 over 8 devices (chunks not contiguous in a shard); small leaves in batches."""
    rng = np.random.default_rng(1)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("a", "b"))
    cols = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "b"))
    return {
        "big": jax.numpy.asarray(rng.standard_normal((2100, 1000), dtype=np.float32)),
        "wide": jax.numpy.asarray(rng.standard_normal((3, 1_000_000), dtype=np.float32)),
        "half": jax.numpy.asarray(rng.standard_normal((3000, 1000)).astype(jax.numpy.bfloat16)),
        "cols": jax.device_put(rng.standard_normal((4096, 2048), dtype=np.float32), cols),
        "small": {f"s{i}": np.full((i + 1, 3), i, np.int32) for i in range(40)},
        "step": 7,
    }


def test_a_save_on_local_disk_writes_what_tensorstore_writes(tmp_path, monkeypatch):
    """The whole save: same files as with the direct writer switched off; restores."""
    tree = _tree()
    fop.save(tmp_path / "direct", tree, format_version=1)
    monkeypatch.setattr(_chunk_files, "usable", lambda location: False)
    fop.save(tmp_path / "tensorstore", tree, format_version=1)
    direct, reference = _files(tmp_path / "direct"), _files(tmp_path / "tensorstore")
    assert sorted(direct) == sorted(reference)
    data = [name for name in direct if name.startswith(("d/", "b/")) and "zarr.json" not in name]
    assert len(data) > 15
    assert all(direct[name] == reference[name] for name in data)
    out = fop.restore(tmp_path / "direct", like=tree)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_flipped_byte_in_a_directly_written_chunk_fails_the_restore(tmp_path):
    tree = _tree()
    fop.save(tmp_path / "c", tree, format_version=1)
    files = sorted(
        os.path.join(parent, name)
        for parent, _, names in os.walk(tmp_path / "c" / "d")
        for name in names
        if name != "zarr.json"
    )
    with open(files[0], "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CheckpointError):
        fop.restore(tmp_path / "c", like=tree)


def test_a_failing_write_fails_the_save_and_leaves_nothing(tmp_path, monkeypatch):
    fop.save(tmp_path / "1", {"w": np.arange(10.0)}, format_version=1)
    calls = []
    real = os.writev

    def full_disk_on_the_third_file(fd, buffers):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, buffers)

    monkeypatch.setattr(_chunk_files.os, "writev", full_disk_on_the_third_file)
    with pytest.raises(CheckpointError, match="No space left"):
        fop.save(tmp_path / "2", _tree(), format_version=1)
    assert sorted(os.listdir(tmp_path)) == ["1"]
    np.testing.assert_array_equal(fop.restore(tmp_path / "1")["w"], np.arange(10.0))


# -- reading --------------------------------------------------------------------------


def _saved_big(tmp_path):
    """(directory, tree, chunk files of the leaf "big": 3 chunks, the last one cut)."""
    tree = {"big": jax.numpy.asarray(np.random.default_rng(2).standard_normal((2100, 1000)))}
    tree["big"] = tree["big"].astype(jax.numpy.float32)
    fop.save(tmp_path / "c", tree, format_version=1)
    chunks = sorted((tmp_path / "c" / "d" / "0" / "c").glob("*/0"))
    assert len(chunks) == 3
    return tmp_path / "c", tree, chunks


def test_whole_arrays_are_read_by_the_chunk_reader(tmp_path, monkeypatch):
    directory, tree, _ = _saved_big(tmp_path)
    used = []
    real = _chunk_files.ChunkReader.read

    def spy(self, *args):
        result = real(self, *args)
        used.append(result is not None)
        return result

    monkeypatch.setattr(_chunk_files.ChunkReader, "read", spy)
    out = fop.restore(directory, like=tree)
    assert used == [True]
    np.testing.assert_array_equal(np.asarray(out["big"]), np.asarray(tree["big"]))
    assert out["big"].dtype == tree["big"].dtype


@pytest.mark.parametrize(
    "damage",
    ["flip a data byte", "flip a padding byte", "truncate", "append", "remove", "symlink"],
)
def test_damaged_chunks_fail_the_direct_read_naming_the_leaf(tmp_path, damage):
    directory, tree, chunks = _saved_big(tmp_path)
    last = chunks[-1]  # cut by the array's end: 4 rows of data, then 1044 rows of padding
    data = last.read_bytes()
    if damage == "flip a data byte":
        last.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    elif damage == "flip a padding byte":
        at = len(data) - 100
        last.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    elif damage == "truncate":
        last.write_bytes(data[:-1])
    elif damage == "append":
        last.write_bytes(data + b"\0")
    elif damage == "remove":
        last.unlink()
    else:
        copy = tmp_path / "elsewhere"
        copy.write_bytes(data)
        last.unlink()
        os.symlink(copy, last)
    named = "symbolic link" if damage == "symlink" else "'big'"  # the walk before reading
    with pytest.raises(fop.CorruptCheckpointError, match=named):
        fop.restore(directory, like=tree)


def test_read_chunk_refuses_a_symlink_and_a_wrong_size(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"\0" * 20)
    os.symlink(target, tmp_path / "link")
    dest = np.empty(16, np.uint8)
    with pytest.raises(ValueError, match="cannot be opened"):
        _chunk_files._read_chunk(str(tmp_path / "link"), dest, 16)
    with pytest.raises(ValueError, match="expected a file of 21 bytes, found 20"):
        _chunk_files._read_chunk(str(target), dest, 17)  # wrong: wants 21


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16", "bool", "complex128"])
@pytest.mark.parametrize("size", [1, 1000, 70_000, 300_000])
def test_batches_written_by_tensorstore_are_read_back_directly(tmp_path, dtype_name, size):
    chunk = min(1 << 17, 1 << (size - 1).bit_length())
    record = BatchRecord("b", dtype_name, 0, size, chunk, None)
    values = _values(dtype_name, (size,))
    spec = _arrays.batch_spec(_storage.Location.from_path(tmp_path), record)
    _arrays.create(spec).result()
    _arrays.open_for_write(spec)[...].write(values).result()
    reader = _chunk_files.ChunkReader(str(tmp_path))
    try:
        read = reader.read_batch("b/b", size, chunk, record.inner, values.dtype)
        out = read.result()
    finally:
        reader.close()
    assert out.dtype == values.dtype
    np.testing.assert_array_equal(out, values)


def _small_leaves():
    rng = np.random.default_rng(3)
    return {
        f"s{i:03d}": jax.numpy.asarray(rng.standard_normal(i + 1000, np.float32)) for i in range(50)
    }


@pytest.mark.parametrize(
    "damage", ["flip a data byte", "flip a padding byte", "flip an index byte", "truncate"]
)
def test_a_damaged_batch_file_fails_the_direct_read_naming_its_leaves(tmp_path, damage):
    tree = _small_leaves()
    fop.save(tmp_path / "c", tree, format_version=1)
    (batch,) = list((tmp_path / "c" / "b").iterdir())
    (path,) = list((batch / "c").iterdir())
    data = path.read_bytes()
    index_bytes = 16 * (len(data) // (64 << 10) + 1) + 4  # upper bound; the index is last
    at = {
        "flip a data byte": 70_000,  # inside the second inner chunk: leaves s017..s034
        "flip a padding byte": len(data) - index_bytes - 200,  # the last inner chunk's tail
        "flip an index byte": len(data) - 10,
        "truncate": None,
    }[damage]
    if at is None:
        path.write_bytes(data[:-1])
    else:
        path.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    with pytest.raises(fop.CorruptCheckpointError, match="'s0"):
        fop.restore(tmp_path / "c", like=tree)
    if damage == "flip a data byte":  # located to the leaves in the damaged inner chunk
        with pytest.raises(fop.CorruptCheckpointError) as info:
            fop.restore(tmp_path / "c", like=tree)
        assert "'s000'" not in str(info.value) and "'s049'" not in str(info.value)


def _mesh(rows, cols):
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(rows, cols), ("a", "b"))


def _sharded_tree(mesh):
    P = jax.sharding.PartitionSpec
    rng = np.random.default_rng(4)
    specs = {"rows": P("a", None), "cols": P(None, "b"), "both": P("a", "b"), "rep": P()}
    return {
        name: jax.device_put(
            rng.standard_normal((2048, 1536), dtype=np.float32),
            jax.sharding.NamedSharding(mesh, spec),
        )
        for name, spec in specs.items()
    }


def _like(tree, mesh=None, spec=None):
    def one(x):
        sharding = x.sharding
        if mesh is not None:
            sharding = jax.sharding.NamedSharding(mesh, x.sharding.spec if spec is None else spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


@pytest.mark.parametrize("onto", ["same mesh", "4x2", "2x4 from 8x1", "replicated"])
def test_sharded_regions_are_read_directly_where_they_are_whole_chunks(tmp_path, monkeypatch, onto):
    """Resuming on the same mesh reads every shard straight from its chunks (in place,
    or through scratch where a chunk is not contiguous in the shard); other meshes
    read what they can directly and the rest through tensorstore; all bit-exact."""
    saved_on = _mesh(8, 1) if onto == "2x4 from 8x1" else _mesh(2, 4)
    tree = _sharded_tree(saved_on)
    fop.save(tmp_path / "c", tree, format_version=1)
    if onto == "replicated":
        like = _like(tree, _mesh(2, 4), jax.sharding.PartitionSpec())
    else:
        target = {"same mesh": None, "4x2": _mesh(4, 2), "2x4 from 8x1": _mesh(2, 4)}[onto]
        like = _like(tree, target)
    calls = {"direct": 0, "declined": 0, "copy": 0}
    real_read, real_copy = _chunk_files.ChunkReader.read, _chunk_files._read_chunk_copy

    def read(self, *args):
        result = real_read(self, *args)
        calls["direct" if result is not None else "declined"] += 1
        return result

    def copy(*args):
        calls["copy"] += 1
        return real_copy(*args)

    monkeypatch.setattr(_chunk_files.ChunkReader, "read", read)
    monkeypatch.setattr(_chunk_files, "_read_chunk_copy", copy)
    out = fop.restore(tmp_path / "c", like=like)
    for name, value in tree.items():
        assert out[name].sharding == like[name].sharding, name
        np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(value), err_msg=name)
    if onto == "same mesh":  # every shard is whole chunks, each contiguous in it
        assert calls["declined"] == 0 and calls["direct"] > 0 and calls["copy"] == 0
    elif onto == "replicated":  # "cols" and "both": chunks narrower than the array's rows
        assert calls["declined"] == 0 and calls["copy"] > 0
    else:
        assert calls["direct"] > 0


def test_a_damaged_chunk_fails_a_sharded_direct_read_naming_the_leaf(tmp_path):
    tree = _sharded_tree(_mesh(2, 4))
    fop.save(tmp_path / "c", tree, format_version=1)
    replicated = _like(tree, _mesh(2, 4), jax.sharding.PartitionSpec())
    for name, like in (("rows", _like(tree)), ("cols", replicated)):  # in place; scratch
        index = sorted(tree).index(name)
        chunk = sorted((tmp_path / "c" / "d" / str(index) / "c").rglob("*"))[-1]
        data = chunk.read_bytes()
        chunk.write_bytes(data[:7] + bytes([data[7] ^ 1]) + data[8:])
        with pytest.raises(fop.CorruptCheckpointError, match=f"'{name}'"):
            fop.restore(tmp_path / "c", like=like)
        chunk.write_bytes(data)


def test_names_that_leave_the_checkpoint_are_refused(tmp_path):
    values = np.ones((4,), np.float32)
    reader = _chunk_files.ChunkReader(str(tmp_path))
    try:
        for sub in ("../x", "d/../../x", "/abs"):
            with pytest.raises(ValueError, match="invalid storage name"):
                reader.read(sub, (4,), (4,), np.float32)
            with pytest.raises(ValueError, match="invalid storage name"):
                reader.read_batch(sub, 4, 4, 4, np.float32)
    finally:
        reader.close()
    with _chunk_writer.ChunkFileWriter(str(tmp_path / "w")) as writer:
        (future,) = writer.array("../x", (4,), (4,), (slice(None),), values)
        with pytest.raises(ValueError, match="invalid storage name"):
            future.result()
    assert sorted(os.listdir(tmp_path)) == []
