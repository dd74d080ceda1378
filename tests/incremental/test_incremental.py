"""Incremental manager steps (``CheckpointManager(incremental=True)``): an unchanged leaf
is hard-linked from the previous committed step, never on a mismatch or doubt."""

import contextlib
import dataclasses
import io
import json
import logging
import math
import os

import _paths
import _proc
import jax
import numpy as np
import pytest
from _files import flip_byte
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._errors import CorruptCheckpointError
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._incremental import reuse as _copies
from flax_orbax_plugin._incremental import reuse as _incremental
from flax_orbax_plugin._incremental import reuse as _links
from flax_orbax_plugin._zarr import arrays as _arrays

HERE = os.path.dirname(os.path.abspath(__file__))  # this test module, for child processes

MiB = 1 << 20
W1, W2, ADAPTER = 768 * 1024 * 4, 512 * 1024 * 4, 512 * 1024 * 4  # bytes


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    monkeypatch.setattr(_arrays, "CHUNK_TARGET_BYTES", 1 * MiB)  # several chunks per leaf


def _state(adapter_value=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "base": {
                "w1": rng.standard_normal((768, 1024), dtype=np.float32),  # 3 MiB, 3 chunks
                "w2": rng.integers(0, 1 << 30, (512, 1024), dtype=np.int32),  # 2 MiB
            },
            "adapter": np.full((512, 1024), adapter_value, np.float32),  # 2 MiB
            "bias": np.zeros((16,), np.float32),  # batched, never reused
        }
    }


def _save(mngr, step, state):
    mngr.save(step, state, ignore_policy=True)
    mngr.wait()
    return mngr.last_save


def _leaf_files(directory, step, path):
    """{relative file: os.stat} of the chunk files of leaf ``path`` in ``params``."""
    item = os.path.join(directory, str(step), "params")
    with open(os.path.join(item, "_METADATA.json")) as f:
        leaves = json.load(f)["leaves"]
    (i,) = [i for i, r in enumerate(leaves) if r["path"] == path]
    root = os.path.join(item, "d", str(i))
    out = {}
    for top, _, files in os.walk(root):
        for name in files:
            full = os.path.join(top, name)
            out[os.path.relpath(full, root)] = os.stat(full, follow_symlinks=False)
    return out, leaves[i]


def _same_inodes(directory, a, b, path):
    fa, _ = _leaf_files(directory, a, path)
    fb, _ = _leaf_files(directory, b, path)
    chunks = [n for n in fa if n.startswith("c/")]
    assert chunks and set(fa) == set(fb)
    return [fa[n].st_ino == fb[n].st_ino for n in chunks]


def _assert_equal(want, got):
    for k, v in want.items():
        if isinstance(v, dict):
            _assert_equal(v, got[k])
        else:
            assert np.asarray(got[k]).dtype == v.dtype and np.asarray(got[k]).tobytes() == (
                v.tobytes()
            ), k


def test_frozen_base_is_linked_and_only_the_adapter_is_written(tmp_path):
    d = str(tmp_path)
    states = [_state(adapter_value=s) for s in range(3)]
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        first = _save(mngr, 1, states[0])
        second = _save(mngr, 2, states[1])
        third = _save(mngr, 3, states[2])
    adapter, base = ADAPTER, W1 + W2
    assert first.bytes_reused == 0 and first.bytes_written >= base + adapter
    for r in (second, third):
        assert r.bytes_reused == base
        assert r.bytes_written == adapter + 64  # the adapter and the batch of small leaves
        assert r.as_scalars()["checkpoint/bytes_reused"] == base
    for path in ("base/w1", "base/w2"):
        assert all(_same_inodes(d, 1, 3, path))
        files, record = _leaf_files(d, 3, path)
        assert record["digest"].startswith("xxh3_128r:") and len(record["digest"]) == 10 + 32
        chunks = [st for n, st in files.items() if n.startswith("c/")]
        assert len(chunks) >= 2 and all(st.st_nlink == 3 for st in chunks)
        assert files["zarr.json"].st_nlink == 1  # written fresh, as for any leaf
    assert not any(_same_inodes(d, 1, 2, "adapter"))
    rows = _list_rows(d)
    assert [rows[s][:2] for s in "123"] == [[cli.human_bytes(first.bytes_written), "0 B"]] + [
        ["2.0 MiB", "5.0 MiB"]
    ] * 2
    with fop.CheckpointManager(d, read_only=True) as mngr:
        for step, want in zip((1, 2, 3), states, strict=True):
            _assert_equal(want, mngr.restore(step=step))
    _assert_equal(states[2]["params"], fop.restore_params(d, states[2]["params"]))
    assert all(r.ok for r in fop.verify(d, all_steps=True))


def test_deleting_the_first_step_keeps_the_linked_data(tmp_path):
    d = str(tmp_path)
    with fop.CheckpointManager(d, incremental=True, keep=1, format_version=1) as mngr:
        _save(mngr, 1, _state(1.0))
        r = _save(mngr, 2, _state(2.0))
        assert r.bytes_reused > 0
        assert mngr.steps() == [2]  # retention removed step 1
        _assert_equal(_state(2.0), mngr.restore())
    files, _ = _leaf_files(d, 2, "base/w1")
    assert all(st.st_nlink == 1 for st in files.values())  # the only name left
    assert all(r.ok for r in fop.verify(d, all_steps=True))


def test_a_leaf_changed_by_one_element_is_rewritten(tmp_path):
    d = str(tmp_path)
    a, b = _state(), _state()
    b["params"]["base"]["w1"][700, 3] = np.nextafter(b["params"]["base"]["w1"][700, 3], 9)
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, a)
        r = _save(mngr, 2, b)
        assert r.bytes_reused == W2 + ADAPTER  # all but w1
        assert not any(_same_inodes(d, 1, 2, "base/w1"))
        assert all(_same_inodes(d, 1, 2, "base/w2"))
        _assert_equal(a, mngr.restore(step=1))
        _assert_equal(b, mngr.restore(step=2))


def test_changed_shape_dtype_or_chunks_is_rewritten(tmp_path, monkeypatch):
    d = str(tmp_path)
    a = _state()
    b = _state()
    b["params"]["base"]["w2"] = b["params"]["base"]["w2"].view(np.float32)  # same bytes
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, a)
        monkeypatch.setattr(_arrays, "CHUNK_TARGET_BYTES", 2 * MiB)  # other chunks for w1
        r = _save(mngr, 2, b)
        assert r.bytes_reused == 0
        _assert_equal(b, mngr.restore(step=2))


def test_a_damaged_previous_chunk_is_not_propagated(tmp_path, caplog):
    d = str(tmp_path)
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, _state())
        files, _ = _leaf_files(d, 1, "base/w1")
        name = sorted(n for n in files if n.startswith("c/"))[1]
        _, record = _leaf_files(d, 1, "base/w1")
        item = os.path.join(d, "1", "params")
        i = json.load(open(os.path.join(item, "_METADATA.json")))["leaves"].index(record)
        victim = os.path.join(item, "d", str(i), name)
        flip_byte(victim, 100)  # same size, one byte changed
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            r = _save(mngr, 2, _state())
        assert r.bytes_reused == W2 + ADAPTER  # w1 written from the snapshot
        assert "base/w1" in caplog.text and "crc32c" in caplog.text and name in caplog.text
        assert not any(_same_inodes(d, 1, 2, "base/w1"))
        files2, _ = _leaf_files(d, 2, "base/w1")
        assert all(st.st_nlink == 1 for st in files2.values())  # nothing left linked
        _assert_equal(_state(), mngr.restore(step=2))
        with pytest.raises(CorruptCheckpointError):
            mngr.restore(step=1)


def _resealed(data: bytes) -> bytes:
    """A chunk file's bytes with one payload element changed and a valid crc32c trailer
    for the new payload: undetectable by the chunk's own checksum."""
    import google_crc32c

    payload = bytearray(data[:-4])
    payload[100] ^= 0x40  # one float32 of w1 changed by a power of two
    return bytes(payload) + google_crc32c.value(bytes(payload)).to_bytes(4, "little")


def test_an_edited_and_resealed_previous_chunk_is_not_linked(tmp_path, caplog):
    """The leaf's digest is of the snapshot, not of the previous file: a previous chunk
    edited with a valid crc32c passes its own check, but its crc32c is not that of the
    snapshot's bytes for that chunk, so it is written, and the new step holds the new
    snapshot's values."""
    d = str(tmp_path)
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, _state())
        files, _ = _leaf_files(d, 1, "base/w1")
        name = sorted(n for n in files if n.startswith("c/"))[1]
        victim = _chunk_path(d, 1, "base/w1", name)
        with open(victim, "rb") as f:
            edited = _resealed(f.read())
        with open(victim, "r+b") as f:  # in place: the same inode, the same size
            f.write(edited)
        assert all(r.ok for r in fop.verify(d, step=1))  # the edit is a valid chunk
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            r = _save(mngr, 2, _state())
        assert "base/w1" in caplog.text and "not that of the snapshot" in caplog.text
        assert name in caplog.text
        assert r.bytes_reused == W2 + ADAPTER  # w1 written from the snapshot
        assert not any(_same_inodes(d, 1, 2, "base/w1"))
        files2, _ = _leaf_files(d, 2, "base/w1")
        assert all(st.st_nlink == 1 for st in files2.values())  # nothing left linked
        _assert_equal(_state(), mngr.restore(step=2))
    assert all(r.ok for r in fop.verify(d, all_steps=True))
    assert fop.restore_params(d, _state()["params"])["base"]["w1"].tobytes() == (
        _state()["params"]["base"]["w1"].tobytes()
    )


def test_snapshot_crcs_are_the_trailers_the_writer_stores(tmp_path):
    """``chunk_crcs`` gives, for every chunk of a region, the trailer of the file the
    chunk writer stores for it: whole chunks, edge chunks (zero-padded) and chunks that
    are not contiguous in the region (cut along a later axis)."""
    from flax_orbax_plugin._zarr import chunks as _crcs
    from flax_orbax_plugin._zarr import packed_writer as _chunk_writer

    shape, chunk = (7, 10), (3, 4)
    data = np.arange(70, dtype=np.float32).reshape(shape) * 1.5
    region = (slice(3, 7), slice(None))
    with _chunk_writer.ChunkFileWriter(str(tmp_path)) as writer:
        for future in writer.array("d/0", shape, chunk, region, data[3:]):
            future.result()
    crcs = _crcs.chunk_crcs(shape, chunk, region, data[3:])
    assert sorted(crcs) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    for cell, crc in crcs.items():
        stored = (tmp_path / "d" / "0" / "c" / str(cell[0]) / str(cell[1])).read_bytes()
        assert len(stored) == 3 * 4 * 4 + 4
        assert int.from_bytes(stored[-4:], "little") == crc
    assert _crcs.chunk_crcs(shape, chunk, (slice(2, 7), slice(None)), data[2:]) is None
    other = data[3:].copy()
    other[3, 9] += 1  # in the padded edge chunk (2, 2)
    changed = _crcs.chunk_crcs(shape, chunk, region, other)
    assert [c for c in crcs if crcs[c] != changed[c]] == [(2, 2)]
    big_endian = data[3:].astype(">f4")
    assert _crcs.chunk_crcs(shape, chunk, region, big_endian) == crcs


@pytest.mark.parametrize("damage", ["truncate", "remove", "symlink"])
def test_a_missing_short_or_symlinked_previous_chunk_means_write(tmp_path, damage, caplog):
    d = str(tmp_path)
    outside = tmp_path.parent / f"outside-{damage}"
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, _state())
        files, record = _leaf_files(d, 1, "base/w1")
        item = os.path.join(d, "1", "params")
        i = json.load(open(os.path.join(item, "_METADATA.json")))["leaves"].index(record)
        victim = os.path.join(item, "d", str(i), sorted(n for n in files if n[:2] == "c/")[-1])
        if damage == "truncate":
            os.truncate(victim, 1000)
        elif damage == "remove":
            os.remove(victim)
        else:
            os.replace(victim, outside)  # the real bytes, outside the checkpoint
            os.symlink(outside, victim)
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            r = _save(mngr, 2, _state())
        assert r.bytes_reused == W2 + ADAPTER and "base/w1" in caplog.text
        _assert_equal(_state(), mngr.restore(step=2))
        files2, _ = _leaf_files(d, 2, "base/w1")
        assert all(st.st_nlink == 1 and not os.path.islink(n) for n, st in files2.items())
    if damage == "symlink":
        assert outside.stat().st_nlink == 1  # never linked to, never followed


def test_a_different_recorded_digest_means_write(tmp_path):
    prev = _layout.LeafRecord(
        "w",
        (("dict", "w"),),
        "array",
        (4, 4),
        "float32",
        None,
        _layout.ArrayStorage((2, 4)),
        digest="xxh3_128:" + "0" * 32,
    )
    doc = _layout.CheckpointDocument((prev,), {})
    same = {0: prev}
    other = {0: dataclasses.replace(prev, digest="xxh3_128:" + "1" * 32)}
    no_digest = {0: dataclasses.replace(prev, digest=None)}
    assert _incremental.plan_reuse(same, doc) == {0: 0}
    assert _incremental.plan_reuse(other, doc) == {}
    assert _incremental.plan_reuse(no_digest, doc) == {}


def test_digest_depends_on_bounds_and_bytes_not_on_the_order_of_regions():
    import xxhash

    x = np.arange(48, dtype=np.float32).reshape(6, 8)
    rec = _layout.LeafRecord("x", (("dict", "x"),), "array", (6, 8), "float32")

    def digest(*writes_per_process):  # every process's entries, merged
        entries = [e for w in writes_per_process for e in _incremental.region_digests(rec, w)]
        return _incremental.leaf_digest(entries)

    cols = [((slice(None), slice(0, 4)), x[:, :4]), ((slice(None), slice(4, 8)), x[:, 4:])]
    rows = [((slice(3, 6), slice(0, 8)), x[3:]), ((slice(0, 3), slice(None)), x[:3])]
    whole = [((slice(None), slice(None)), x)]
    assert digest(cols).startswith("xxh3_128r:") and len(digest(cols)) == 10 + 32
    assert digest(cols) == digest(cols[::-1]) == digest(cols[1:], cols[:1])  # any order
    assert len({digest(cols), digest(rows), digest(whole)}) == 3  # another split
    y = x.copy()
    y[5, 7] += 1
    assert digest([(r, y[r]) for r, _ in cols]) != digest(cols)  # another byte
    # The same region hashes under other bounds: another digest.
    z = np.zeros((6, 8), np.float32)
    halves = [((slice(0, 3), slice(None)), z[:3]), ((slice(3, 6), slice(None)), z[3:])]
    entries = _incremental.region_digests(rec, halves)
    shifted = [(((1, 4), (0, 8)), entries[0][1]), (((4, 7), (0, 8)), entries[1][1])]
    assert _incremental.leaf_digest(shifted) != digest(halves)
    # The definition (FORMAT.md): XXH3-128 of sorted "start:stop,...=<hash>" lines.
    h = [xxhash.xxh3_128(x[:, a:b].copy().tobytes()).hexdigest() for a, b in ((0, 4), (4, 8))]
    text = f"0:6,0:4={h[0]}\n0:6,4:8={h[1]}\n".encode()
    assert digest(cols) == "xxh3_128r:" + xxhash.xxh3_128(text).hexdigest()
    big = [(r, d.astype(">f4")) for r, d in cols]  # big-endian input: the same bytes hashed
    assert digest(big) == digest(cols)
    with pytest.raises(ValueError):
        _incremental.region_digests(rec, [((slice(0, 3), slice(None)), x)])


def test_each_process_reuses_the_chunks_its_regions_cover():
    rec = _layout.LeafRecord(
        "x", (("dict", "x"),), "array", (6, 8), "float32", None, _layout.ArrayStorage((3, 2))
    )
    assert _incremental.chunks_of(rec, [((0, 6), (4, 8))]) == [
        ("c", "0", "2"),
        ("c", "0", "3"),
        ("c", "1", "2"),
        ("c", "1", "3"),
    ]
    assert _incremental.chunks_of(rec, [((0, 3), (0, 2)), ((3, 6), (0, 2))]) == [
        ("c", "0", "0"),
        ("c", "1", "0"),
    ]
    assert _incremental.chunks_of(rec, [((0, 6), (1, 8))]) is None  # not on a boundary
    assert _incremental.chunks_of(rec, [((0, 4), (0, 8))]) is None
    assert _incremental.chunks_of(rec, []) == []
    edge = dataclasses.replace(rec, shape=(7, 8))  # the last chunk row is padded
    assert _incremental.chunks_of(edge, [((6, 7), (0, 2))]) == [("c", "2", "0")]


def test_sharded_jax_arrays(tmp_path, devices):
    mesh = jax.sharding.Mesh(np.array(devices).reshape(4, 2), ("a", "b"))
    rows = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)
    state = {
        "params": {
            "rows": jax.device_put(rows, NamedSharding(mesh, P("a", None))),
            "cols": jax.device_put(rows + 1, NamedSharding(mesh, P(None, "b"))),
            "adapter": jax.device_put(np.ones((512, 1024), np.float32), NamedSharding(mesh, P())),
        }
    }
    d = str(tmp_path)
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, state)
        state["params"]["adapter"] = state["params"]["adapter"] * 2
        r = _save(mngr, 2, state)
        assert r.bytes_reused == 2 * rows.nbytes  # "rows" and "cols" (sharded on axis 1)
        assert all(_same_inodes(d, 1, 2, "rows"))
        assert all(_same_inodes(d, 1, 2, "cols"))
        got = mngr.restore(step=2)
    np.testing.assert_array_equal(got["params"]["rows"], rows)
    np.testing.assert_array_equal(got["params"]["cols"], rows + 1)
    np.testing.assert_array_equal(got["params"]["adapter"], 2)


def _all_inodes(directory, step, path) -> set[int]:
    files, _ = _leaf_files(directory, step, path)
    return {st.st_ino for name, st in files.items() if name.startswith("c/")}


def test_a_leaf_sharded_along_axis_1_is_linked_and_another_sharding_written(tmp_path, devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    w = np.random.default_rng(1).standard_normal((1024, 2048), dtype=np.float32)  # 8 MiB
    cols = NamedSharding(mesh, P(None, "x"))  # 8 shards of 1024 x 256 (1 MiB, one chunk)

    def state(sharding, a):
        adapter = np.full((512, 1024), a, np.float32)
        return {"params": {"w": jax.device_put(w, sharding), "adapter": adapter}}

    states = [state(cols, 1.0), state(cols, 2.0), state(NamedSharding(mesh, P("x")), 3.0)]
    d = str(tmp_path)
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        results = [_save(mngr, step, s) for step, s in enumerate(states, 1)]
    second, third = results[1:]
    assert second.bytes_reused == w.nbytes and second.bytes_written == ADAPTER
    assert all(_same_inodes(d, 1, 2, "w"))
    files, record = _leaf_files(d, 2, "w")
    assert sorted(n for n in files if n.startswith("c/")) == [f"c/0/{k}" for k in range(8)]
    assert record["digest"] == _leaf_files(d, 1, "w")[1]["digest"]
    assert record["digest"].startswith("xxh3_128r:")
    # P("x"): the same bytes split another way: another digest, written.
    assert third.bytes_reused == 0 and third.bytes_written == w.nbytes + ADAPTER
    assert _leaf_files(d, 3, "w")[1]["digest"] != record["digest"]
    assert not _all_inodes(d, 3, "w") & _all_inodes(d, 2, "w")
    with fop.CheckpointManager(d, read_only=True) as mngr:
        for step in (1, 2, 3):
            got = mngr.restore(step=step)["params"]
            assert got["w"].tobytes() == w.tobytes()
            assert got["adapter"].tobytes() == states[step - 1]["params"]["adapter"].tobytes()
    assert all(r.ok for r in fop.verify(d, all_steps=True))


def test_another_split_with_the_same_chunks_gets_another_digest(tmp_path, devices):
    """Replicated, then sharded in two along axis 0: the chunks are 1024 x 256 both
    times, the bytes equal; only the digest tells the splits apart (written), and the
    next step with the same split links."""
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("x",))
    w = np.arange(2048 * 256, dtype=np.float32).reshape(2048, 256)  # 2 MiB
    shardings = [P(), P("x"), P("x")]
    d = str(tmp_path)
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        results = [
            _save(mngr, step, {"params": {"w": jax.device_put(w, NamedSharding(mesh, spec))}})
            for step, spec in enumerate(shardings, 1)
        ]
        for step in (1, 2, 3):
            assert mngr.restore(step=step)["params"]["w"].tobytes() == w.tobytes()
    records = [_leaf_files(d, step, "w")[1] for step in (1, 2, 3)]
    assert [r["storage"]["chunk_shape"] for r in records] == [[1024, 256]] * 3
    assert records[0]["digest"] != records[1]["digest"] == records[2]["digest"]
    assert [r.bytes_reused for r in results] == [0, 0, w.nbytes]


# -- several processes ---------------------------------------------------------------------

BASE_SHAPE = (1024, 2048)  # 8 MiB; on 4 devices along axis 1: 1024 x 512 shards, 2 chunks each


def _mp_base():
    return np.random.default_rng(7).standard_normal(BASE_SHAPE, dtype=np.float32)


def mp_frozen_base(ctx, directory, steps, keep=None, format_version=1):
    """Run in each of 2 real JAX processes (2 CPU devices each): saves ``steps`` of a
    frozen base sharded along axis 1 over the 4 devices and an adapter replicated on
    all of them (its chunk rows split between the processes), through one incremental
    manager (of ``format_version``) on a directory both share; returns this process's
    bytes per step and the key-value names left under ``fop/reuse/`` once every
    process is done."""
    from flax_orbax_plugin._zarr import arrays as _arrays

    _arrays.CHUNK_TARGET_BYTES = 1 * MiB
    base = _mp_base()
    cols = NamedSharding(ctx.mesh, P(None, "data"))
    everywhere = NamedSharding(ctx.mesh, P())
    out = {}
    manager = fop.CheckpointManager(
        directory, incremental=True, keep=keep, format_version=format_version
    )
    with manager as mngr:
        for step in steps:
            adapter = np.full((512, 1024), float(step), np.float32)
            state = {
                "params": {
                    "base": jax.make_array_from_callback(base.shape, cols, lambda i: base[i]),
                    "adapter": jax.make_array_from_callback(
                        adapter.shape, everywhere, lambda i, a=adapter: a[i]
                    ),
                }
            }
            r = _save(mngr, step, state)
            out[str(step)] = [r.bytes_written, r.bytes_reused]
        out["steps"] = mngr.steps()
    ctx.client.wait_at_barrier("test_incremental/released", 30_000)
    out["left"] = [k for k, _ in ctx.client.key_value_dir_get("fop/reuse/")]
    return out


def _run_mp(directory, steps, keep=None):
    from _multiprocess import run_processes

    return run_processes(
        "test_incremental:mp_frozen_base",
        2,
        devices_per_process=2,
        args={"directory": directory, "steps": steps, "keep": keep},
        env={"FOP_COORDINATION_TIMEOUT_S": "20"},
        heartbeat_timeout_s=30,
        timeout_s=120,
    ).check()


def _assert_mp_step(reader, step):
    got = reader.restore(step=step)["params"]
    assert got["base"].tobytes() == _mp_base().tobytes()
    assert got["adapter"].tobytes() == np.full((512, 1024), float(step), np.float32).tobytes()


@pytest.mark.distributed
def test_two_processes_link_their_own_chunks_of_a_frozen_base(tmp_path):
    d = str(tmp_path / "steps")
    base = math.prod(BASE_SHAPE) * 4
    run = _run_mp(d, [1, 2])
    for r in run.results:  # each process: half the base (2 of 4 shards), half the adapter
        assert r["1"] == [(base + ADAPTER) // 2, 0]
        assert r["2"] == [ADAPTER // 2, base // 2]
        assert r["steps"] == [1, 2] and r["left"] == []  # the exchanged values deleted
    assert all(_same_inodes(d, 1, 2, "base"))
    assert not any(_same_inodes(d, 1, 2, "adapter"))
    files, record = _leaf_files(d, 2, "base")
    assert len([n for n in files if n.startswith("c/")]) == 8  # 4 shards, 2 chunks each
    assert record["digest"].startswith("xxh3_128r:")
    assert record["digest"] == _leaf_files(d, 1, "base")[1]["digest"]
    assert _leaf_files(d, 2, "adapter")[1]["digest"] != _leaf_files(d, 1, "adapter")[1]["digest"]
    with fop.CheckpointManager(d, read_only=True) as reader:
        for step in (1, 2):
            _assert_mp_step(reader, step)
    # Step 3 with keep=2 deletes step 1: the later steps stay whole.
    run = _run_mp(d, [3], keep=2)
    for r in run.results:
        assert r["3"] == [ADAPTER // 2, base // 2] and r["steps"] == [2, 3]
    assert not os.path.exists(os.path.join(d, "1"))
    assert all(_same_inodes(d, 2, 3, "base"))
    files, _ = _leaf_files(d, 3, "base")
    assert all(st.st_nlink == 2 for n, st in files.items() if n.startswith("c/"))
    with fop.CheckpointManager(d, read_only=True) as reader:
        for step in (2, 3):
            _assert_mp_step(reader, step)
    assert all(r.ok for r in fop.verify(d, all_steps=True))
    # Step 3's name of one chunk replaced by a damaged copy (step 2's stays whole): the
    # process whose region holds it fails its link and writes its regions of the base;
    # the other still links its own, and step 4 restores bit-exact.
    victim = _chunk_path(d, 3, "base", "c/0/3")
    with open(victim, "rb") as f:
        data = bytearray(f.read())
    data[100] ^= 0xFF
    os.remove(victim)
    with open(victim, "wb") as f:
        f.write(data)
    run = _run_mp(d, [4])
    assert sorted(r["4"] for r in run.results) == [
        [ADAPTER // 2, base // 2],
        [ADAPTER // 2 + base // 2, 0],
    ]
    two, four = _leaf_files(d, 2, "base")[0], _leaf_files(d, 4, "base")[0]
    shared = {n: two[n].st_ino == st.st_ino for n, st in four.items() if n.startswith("c/")}
    assert len(shared) == 8 and sum(shared.values()) == 4  # half linked, half written
    assert not shared["c/0/3"]
    with fop.CheckpointManager(d, read_only=True) as reader:
        _assert_mp_step(reader, 4)
    assert all(r.ok for r in fop.verify(d, step=4))


def _chunk_path(directory, step, path, name):
    files, record = _leaf_files(directory, step, path)
    item = os.path.join(directory, str(step), "params")
    with open(os.path.join(item, "_METADATA.json")) as f:
        i = json.load(f)["leaves"].index(record)
    assert name in files
    return os.path.join(item, "d", str(i), name)


def test_link_leaf_links_only_the_chunks_asked_for_and_undoes_only_its_own(tmp_path):
    """What one process of several does: links its chunks; on a failure it removes its
    own links and leaves the other processes' files alone."""
    from flax_orbax_plugin._storage.location import Location

    d = str(tmp_path / "steps")
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, _state())
    files, record = _leaf_files(d, 1, "base/w1")
    rec = _layout.leaf_from_json(record, "m", 0)
    i = json.load(open(os.path.join(d, "1", "params", "_METADATA.json")))["leaves"].index(record)
    names = sorted(n for n in files if n.startswith("c/"))
    assert len(names) == 3  # 768 x 1024 float32 in chunks of 256 rows
    source = Location.from_path(os.path.join(d, "1", "params"))
    target = Location.from_path(str(tmp_path / "new"))
    mine = [tuple(n.split("/")) for n in names[1:]]
    w1 = _state()["params"]["base"]["w1"]
    writes = [((slice(256, 768), slice(None)), w1[256:])]  # this process's snapshot
    got = _links.link_leaf(source, i, target, 0, rec, writes=writes, chunks=mine, nbytes=12345)
    assert got == 12345
    linked = sorted(
        os.path.relpath(os.path.join(t, f), tmp_path / "new" / "d" / "0")
        for t, _, fs in os.walk(tmp_path / "new")
        for f in fs
    )
    assert linked == names[1:]
    assert all(
        os.stat(tmp_path / "new" / "d" / "0" / n).st_ino == files[n].st_ino for n in names[1:]
    )
    # Another process's file beside them; this process's second chunk is damaged.
    other = tmp_path / "again" / "d" / "0" / "c" / "0" / "0"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"theirs")
    victim = _chunk_path(d, 1, "base/w1", names[2])
    with open(victim, "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 1]))
    again = Location.from_path(str(tmp_path / "again"))
    assert _links.link_leaf(source, i, again, 0, rec, writes=writes, chunks=mine, nbytes=1) is None
    left = [os.path.join(t, f) for t, _, fs in os.walk(tmp_path / "again") for f in fs]
    assert left == [str(other)] and other.read_bytes() == b"theirs"


def test_copy_leaf_copies_only_the_chunks_asked_for_and_deletes_only_its_own(s3_location):
    from flax_orbax_plugin._storage import server_copy as _server_copy
    from flax_orbax_plugin._storage.location import Location

    url = s3_location.url
    with fop.CheckpointManager(url, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, _state())
    files, record, prefix = _remote_leaf(s3_location, 1, "base/w1")
    rec = _layout.leaf_from_json(record, "m", 0)
    j = int(prefix.rstrip("/").rsplit("/", 1)[1])
    names = sorted(n for n in files if n.startswith("c/"))
    mine = [tuple(n.split("/")) for n in names[1:]]
    w1 = _state()["params"]["base"]["w1"]
    writes = [((slice(256, 768), slice(None)), w1[256:])]  # this process's snapshot
    source = Location.from_path(f"{url}/1/params")
    copier, why = _server_copy.copier_for(source)
    assert copier is not None, why
    target = Location.from_path(f"{url}/new")
    got = _copies.copy_leaf(copier, source, j, target, 0, rec, writes=writes, chunks=mine, nbytes=7)
    assert got == 7
    copied = {k: s3_location.read(k) for k in s3_location.keys() if k.startswith("new/")}
    assert sorted(copied) == [f"new/d/0/{n}" for n in names[1:]]
    assert all(copied[f"new/d/0/{n}"] == files[n] for n in names[1:])
    # Another process's chunk beside them; the store fails this process's last copy
    # after making it (a fault injected over the real server): its copies go, theirs stay.
    s3_location.kvstore().write("again/d/0/c/0/0", b"theirs").result()

    class FailsLast(_server_copy.Copier):
        def list(self, prefix):
            return copier.list(prefix)

        def delete(self, key):
            copier.delete(key)

        def read_range(self, key, start, stop, info):
            return copier.read_range(key, start, stop, info)

        def copy(self, src, dst, info):
            out = copier.copy(src, dst, info)
            if dst.endswith(names[-1]):
                raise _server_copy.CopyError(f"{dst}: injected failure")
            return out

    again = Location.from_path(f"{url}/again")
    assert (
        _copies.copy_leaf(FailsLast(), source, j, again, 0, rec, writes=writes, chunks=mine) is None
    )
    assert [k for k in s3_location.keys() if k.startswith("again/")] == ["again/d/0/c/0/0"]
    # A short source chunk of this process is refused before any copy.
    s3_location.kvstore().write(prefix + names[2], files[names[2]][:100]).result()
    assert _copies.copy_leaf(copier, source, j, again, 0, rec, writes=writes, chunks=mine) is None
    assert [k for k in s3_location.keys() if k.startswith("again/")] == ["again/d/0/c/0/0"]


def test_off_by_default_and_in_standalone_saves(tmp_path):
    d = str(tmp_path / "steps")
    with fop.CheckpointManager(d, format_version=1) as mngr:
        _save(mngr, 1, _state())
        r = _save(mngr, 2, _state())
        assert r.bytes_reused == 0 and "checkpoint/bytes_reused" not in r.as_scalars()
        assert not any(_same_inodes(d, 1, 2, "base/w1"))
    _, record = _leaf_files(d, 2, "base/w1")
    assert "digest" not in record
    fop.save(str(tmp_path / "one"), _state()["params"], format_version=1)
    meta = json.load(open(tmp_path / "one" / "_METADATA.json"))
    assert not any("digest" in r for r in meta["leaves"])


def test_previous_step_without_the_item_or_digests(tmp_path):
    d = str(tmp_path)
    with fop.CheckpointManager(d, format_version=1) as mngr:  # step 1 written without digests
        _save(mngr, 1, _state())
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        assert _save(mngr, 2, {"other": _state()["params"]}).bytes_reused == 0
        assert _save(mngr, 3, _state()).bytes_reused == 0  # step 2 has no params
        assert _save(mngr, 4, _state()).bytes_reused > 0
        _assert_equal(_state(), mngr.restore(step=4))


def test_digest_field_is_validated():
    raw = {
        "path": "w",
        "keys": [["dict", "w"]],
        "kind": "array",
        "shape": [4],
        "dtype": "float32",
        "sharding": None,
        "storage": {"type": "array", "chunk_shape": [4]},
        "digest": "xxh3_128:" + "ab" * 16,
    }
    rec = _layout.leaf_from_json(raw, "m.json", 0)
    assert rec.digest == raw["digest"] and rec.to_json() == raw
    for bad in ("xxh3_128:XYZ", 5, "", "nocolon" + "0" * 32, "../x:" + "0" * 32):
        with pytest.raises(CorruptCheckpointError, match=r"leaves\[0\] \('w'\)\.digest"):
            _layout.leaf_from_json(dict(raw, digest=bad), "m.json", 0)
    del raw["digest"]
    assert _layout.leaf_from_json(raw, "m.json", 0).digest is None


KILLED_CHILD = """
import sys
import numpy as np
import flax_orbax_plugin as fop
from flax_orbax_plugin._zarr import arrays as _arrays
_arrays.CHUNK_TARGET_BYTES = 1 << 20
sys.path.insert(0, sys.argv[2])  # this test's wing (tests/support: child_env)
from test_incremental import _state
keep = int(sys.argv[3]) or None
with fop.CheckpointManager(sys.argv[1], incremental=True, keep=keep, format_version=1) as m:
    m.save(2, _state(2.0))
    m.wait()
"""


def _killed_step_2(directory: str, phase: str, env: dict | None = None) -> None:
    """Runs KILLED_CHILD (saving step 2, with ``keep=1`` for ``mid_retention``) with
    ``FOP_KILL_AT=phase``; checks it died by SIGKILL."""
    import subprocess
    import sys

    child_env = _proc.child_env(JAX_PLATFORMS="cpu", FOP_KILL_AT=phase, **(env or {}))
    keep = "1" if phase == "mid_retention" else "0"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_CHILD, directory, HERE, keep],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr


@pytest.mark.parametrize("phase", ["mid_write", "after_marker", "mid_retention"])
def test_a_kill_during_an_incremental_step_leaves_the_earlier_one_whole(tmp_path, phase):
    """Killed after the links (mid_write: the first chunk write follows them), after the
    commit marker, or while retention deletes step 1: the next writer restores a whole
    step and nothing partial is listed."""
    d = str(tmp_path)
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, _state(1.0))
    _killed_step_2(d, phase)
    with fop.CheckpointManager(d, incremental=True, format_version=1) as mngr:
        steps = mngr.steps()
        assert steps == {"mid_write": [1], "after_marker": [1, 2], "mid_retention": [2]}[phase]
        assert sorted(os.listdir(d)) == sorted([".writer.lock", *map(str, steps)])
        for s in steps:
            _assert_equal(_state(float(s)), mngr.restore(step=s))
        r = _save(mngr, 3, _state(3.0))
        assert r.bytes_reused == W1 + W2
    assert all(r.ok for r in fop.verify(d, all_steps=True))


# -- object stores: server-side copies -------------------------------------------------------

pytest_plugins = ["_servers"]


@pytest.fixture(params=["s3", "gcs"])
def bucket(request):
    """A fresh prefix on the real S3 server (moto) or the GCS emulator."""
    return request.getfixturevalue(f"{request.param}_location")


def _remote_leaf(bucket, step, path):
    """({chunk key relative to d/<i>/: bytes}, record) of leaf ``path`` of ``params``."""
    leaves = json.loads(bucket.read(f"{step}/params/_METADATA.json"))["leaves"]
    (i,) = [i for i, r in enumerate(leaves) if r["path"] == path]
    prefix = f"{step}/params/d/{i}/"
    keys = [k for k in bucket.keys() if k.startswith(prefix)]
    return {k[len(prefix) :]: bucket.read(k) for k in keys}, leaves[i], prefix


def _list_rows(url):
    """``{step: [written, reused, ...]}`` from ``flax-orbax list``'s table."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["list", url]) == 0
    rows = {}
    for line in out.getvalue().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0].isdigit():
            rows[cells[0]] = cells[2:]
    return rows


def test_object_store_copies_the_frozen_base_on_the_server(bucket, caplog):
    url = bucket.url
    states = [_state(adapter_value=s) for s in range(3)]
    with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
        with fop.CheckpointManager(url, incremental=True, keep=2, format_version=1) as mngr:
            first = _save(mngr, 1, states[0])
            second = _save(mngr, 2, states[1])
    assert "incremental save" not in caplog.text  # nothing fell back to a write
    assert first.bytes_reused == 0 and first.bytes_written >= W1 + W2 + ADAPTER
    assert second.bytes_reused == W1 + W2
    assert second.bytes_written == ADAPTER + 64  # the adapter and the batch of small leaves
    for path in ("base/w1", "base/w2"):
        a, _, _ = _remote_leaf(bucket, 1, path)
        b, record, _ = _remote_leaf(bucket, 2, path)
        chunks = [n for n in a if n.startswith("c/")]
        assert len(chunks) >= 2 and set(a) == set(b)  # every chunk copied, zarr.json fresh
        assert all(a[n] == b[n] for n in chunks) and record["digest"].startswith("xxh3_128r:")
    with fop.CheckpointManager(url, read_only=True) as mngr:
        for step in (1, 2):
            _assert_equal(states[step - 1], mngr.restore(step=step))
    rows = _list_rows(url)
    assert rows["1"][:2] == [cli.human_bytes(first.bytes_written), "0 B"]
    assert rows["2"][:2] == ["2.0 MiB", "5.0 MiB"]  # the adapter (+64 B); w1 and w2
    with fop.CheckpointManager(url, incremental=True, keep=1, format_version=1) as mngr:
        third = _save(mngr, 3, states[2])  # copied from step 2, which retention then deletes
        assert third.bytes_reused == W1 + W2 and mngr.steps() == [3]
        _assert_equal(states[2], mngr.restore())
    assert not [k for k in bucket.keys() if k.startswith(("1/", "2/"))]
    _assert_equal(states[2]["params"], fop.restore_params(url, states[2]["params"]))
    assert [r.ok for r in fop.verify(url, all_steps=True)] == [True]


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_a_missing_or_short_previous_chunk_object_means_write(s3_location, damage, caplog):
    url = s3_location.url
    with fop.CheckpointManager(url, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, _state())
        files, _, prefix = _remote_leaf(s3_location, 1, "base/w1")
        victim = prefix + sorted(n for n in files if n.startswith("c/"))[-1]
        if damage == "truncate":
            s3_location.kvstore().write(victim, files[victim[len(prefix) :]][:1000]).result()
        else:
            s3_location.delete(victim)
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            r = _save(mngr, 2, _state())
        assert r.bytes_reused == W2 + ADAPTER and r.bytes_written == W1 + 64
        assert "base/w1" in caplog.text and victim.split("/", 1)[1] in caplog.text
        assert ("missing" if damage == "remove" else "expected") in caplog.text
        _assert_equal(_state(), mngr.restore(step=2))
        copied, _, _ = _remote_leaf(s3_location, 2, "base/w1")
        assert set(copied) == set(files)  # written whole: nothing left of the copies
    assert [r.ok for r in fop.verify(url, all_steps=True)] == [False, True]


def test_a_copy_that_differs_from_its_source_is_deleted_and_the_leaf_written(
    s3_location, monkeypatch, caplog
):
    """A fault injected on the real server: right after one chunk is copied, another
    writer replaces the copy with other bytes of the same size; the listing after the
    copies shows another ETag, so the leaf's copies are deleted and it is written."""
    from flax_orbax_plugin._storage import server_copy as _server_copy

    url = s3_location.url
    real = _server_copy.copier_for

    class Tampered(_server_copy.Copier):
        def __init__(self, inner):
            self.inner, self.hit = inner, []

        def list(self, prefix):
            return self.inner.list(prefix)

        def delete(self, key):
            self.inner.delete(key)

        def read_range(self, key, start, stop, source):
            return self.inner.read_range(key, start, stop, source)

        def copy(self, src, dst, source):
            out = self.inner.copy(src, dst, source)
            if not self.hit and "/d/" in dst:
                self.hit.append(dst)
                key = dst[len(s3_location.prefix) + 1 :]
                s3_location.kvstore().write(key, b"\0" * source.size).result()
            return out

    with fop.CheckpointManager(url, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, _state())
        copier, _ = real(fop._storage.location.Location.from_path(url))
        tampered = Tampered(copier)
        monkeypatch.setattr(_server_copy, "copier_for", lambda loc: (tampered, ""))
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            r = _save(mngr, 2, _state())
        assert len(tampered.hit) == 1 and "not the same object" in caplog.text
        assert r.bytes_reused == W1 + W2 + ADAPTER - r.bytes_written + 64
        assert r.bytes_written in (W1 + 64, W2 + 64, ADAPTER + 64)  # that one leaf
        _assert_equal(_state(), mngr.restore(step=2))
    assert all(r.ok for r in fop.verify(url, all_steps=True))


def test_an_edited_and_resealed_previous_chunk_object_is_not_copied(bucket, caplog):
    """On S3 and GCS: the source chunk's crc32c trailer (read by range, pinned to the
    object listed) must equal the crc32c of the snapshot's bytes for that chunk; an
    edited and resealed chunk is not copied, the leaf is written."""
    url = bucket.url
    with fop.CheckpointManager(url, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, _state())
        files, _, prefix = _remote_leaf(bucket, 1, "base/w1")
        name = sorted(n for n in files if n.startswith("c/"))[1]
        bucket.kvstore().write(prefix + name, _resealed(files[name])).result()
        assert [r.ok for r in fop.verify(url, all_steps=True)] == [True]  # a valid chunk
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            r = _save(mngr, 2, _state())
        assert "base/w1" in caplog.text and "not that of the snapshot" in caplog.text
        assert name in caplog.text
        assert r.bytes_reused == W2 + ADAPTER and r.bytes_written == W1 + 64
        _assert_equal(_state(), mngr.restore(step=2))
        copied, _, _ = _remote_leaf(bucket, 2, "base/w1")
        assert set(copied) == set(files) and copied[name] == files[name]  # the snapshot's
    assert [r.ok for r in fop.verify(url, all_steps=True)] == [True, True]
    got = fop.restore_params(url, _state()["params"])["base"]["w1"]
    assert got.tobytes() == _state()["params"]["base"]["w1"].tobytes()


def test_copy_check_compares_tags_only_where_they_hash_the_bytes():
    from flax_orbax_plugin._storage.server_copy import ObjectInfo as Info

    same = _copies._same_copy
    src = Info(10, "a", "a")
    assert same(src, Info(10, "a"), Info(10, "a"))
    assert not same(src, Info(10, "b"), Info(10, "b"))  # other bytes than the source's
    assert not same(src, Info(10, "a"), Info(9, "a")) and not same(src, Info(10, "a"), None)
    kms = Info(10, "k", "k", content_tag=False)  # an SSE-KMS copy: an ETag of its own
    assert same(src, kms, Info(10, "k"))
    assert not same(src, kms, Info(10, "z"))  # changed after the copy
    multipart = Info(10, "m-2", "m-2", content_tag=False)
    assert same(multipart, Info(10, "a"), Info(10, "a"))


def test_no_copier_for_memory_stores_writes_everything_and_says_why(caplog):
    url = f"memory://incremental-{os.getpid()}-{id(caplog)}"
    with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
        with fop.CheckpointManager(url, incremental=True, format_version=1) as mngr:
            _save(mngr, 1, _state())
            r2 = _save(mngr, 2, _state())
            r3 = _save(mngr, 3, _state())
            _assert_equal(_state(), mngr.restore(step=3))
    assert r2.bytes_reused == r3.bytes_reused == 0 and r3.bytes_written == W1 + W2 + ADAPTER + 64
    lines = [m for m in caplog.messages if "no reuse" in m]
    assert len(lines) == 1 and "'memory'" in lines[0] and "no server-side copy" in lines[0]


NO_BOTOCORE_CHILD = """
import logging, sys
sys.modules["botocore"] = None  # as if not installed: every import of it fails
sys.modules["boto3"] = None
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")
import numpy as np
import flax_orbax_plugin as fop
x = {"w": np.arange(1 << 18, dtype=np.float32)}
with fop.CheckpointManager(sys.argv[1], incremental=True) as m:
    for step in (1, 2):
        m.save(step, x, ignore_policy=True)
        m.wait()
        print("RESULT", m.last_save.bytes_written, m.last_save.bytes_reused)
    got = m.restore(step=2)
print("EQUAL", got["w"].tobytes() == x["w"].tobytes())
"""


def test_without_botocore_s3_steps_are_written_in_full(s3_location):
    import subprocess
    import sys

    repo = _paths.REPO
    env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu", **s3_location.env)
    proc = subprocess.run(
        [sys.executable, "-c", NO_BOTOCORE_CHILD, s3_location.url],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.count("RESULT 1048576 0") == 2 and "EQUAL True" in out
    why = [line for line in out.splitlines() if line.startswith("LOG") and "no reuse" in line]
    assert len(why) == 1 and "botocore is not installed" in why[0]


@pytest.mark.parametrize("phase", ["mid_write", "after_marker", "mid_retention"])
def test_a_kill_during_an_incremental_s3_step_leaves_the_earlier_one_whole(s3_location, phase):
    """As on local disk: killed while chunks are being copied and the adapter written
    (mid_write), after the marker, or while retention deletes step 1."""
    url = s3_location.url
    with fop.CheckpointManager(url, incremental=True, format_version=1) as mngr:
        _save(mngr, 1, _state(1.0))
    _killed_step_2(url, phase, s3_location.env)
    with fop.CheckpointManager(url, incremental=True, format_version=1) as mngr:
        steps = mngr.steps()
        assert steps == {"mid_write": [1], "after_marker": [1, 2], "mid_retention": [2]}[phase]
        for s in steps:
            _assert_equal(_state(float(s)), mngr.restore(step=s))
        r = _save(mngr, 3, _state(3.0))
        assert r.bytes_reused == W1 + W2
        _assert_equal(_state(3.0), mngr.restore(step=3))
    assert all(r.ok for r in fop.verify(url, all_steps=True))


def test_incremental_local_steps_replicate_whole_to_the_persistent_tier(s3_location, tmp_path):
    """The local tier hard-links; the bucket receives whole steps, and a fresh machine
    restores the latest of them bit-exact."""
    url = s3_location.url
    states = [_state(adapter_value=s) for s in range(3)]
    with fop.CheckpointManager(
        tmp_path / "a", incremental=True, persistent=url, format_version=1
    ) as mngr:
        for step, state in enumerate(states, 1):
            assert _save(mngr, step, state).bytes_reused == (step > 1) * (W1 + W2)
        mngr.persistent.wait()
    assert all(_same_inodes(str(tmp_path / "a"), 1, 3, "base/w1"))
    with fop.CheckpointManager(url, read_only=True) as remote:
        assert remote.steps()[-1] == 3
        _assert_equal(states[2], remote.restore(step=3))
    assert all(r.ok for r in fop.verify(url, all_steps=True))
    with fop.CheckpointManager(tmp_path / "b", persistent=url, format_version=1) as fresh:
        _assert_equal(states[2], fresh.restore())
        assert fresh.steps() == [3]


@pytest.mark.parametrize("version", [1, 2])
def test_small_frozen_leaves_rewritten_each_step_are_reported(tmp_path, caplog, version):
    # A leaf of 1 MiB or less is batched and written again at every step, frozen or not
    # (was: silently, then only at INFO, issue 51 item 9); one WARNING per manager
    # directory and item says which, their size in all, and why.
    state = _state()
    state["params"]["norm"] = {"scale": np.ones((256,), np.float32)}  # frozen and small
    with fop.CheckpointManager(tmp_path, incremental=True, format_version=version) as mngr:
        with caplog.at_level(logging.WARNING, logger="flax_orbax_plugin"):
            _save(mngr, 1, state)
            assert "small leaves" not in caplog.text  # nothing to reuse at a first step
            second = _save(mngr, 2, state)
            _save(mngr, 3, state)
    records = [r for r in caplog.records if "small leaves" in r.getMessage()]
    assert len(records) == 1, records
    assert records[0].levelno == logging.WARNING
    line = records[0].getMessage()
    assert line.startswith("incremental steps: 2 small leaves of item 'params' (1.1 KiB (1088")
    assert "never reused" in line and "written again at every step" in line
    assert line.endswith("'bias', 'norm/scale'")
    assert second.bytes_reused >= W1 + W2 + ADAPTER  # the big frozen leaves are reused
