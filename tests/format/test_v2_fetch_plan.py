"""Format version 2 restored from an object store: the fetch plan of ``_zarr.chunks``.

Against the real moto S3 server in this process, counting the requests it answers
(``tests/support/_s3_requests.py``): a whole restore fetches each data file with one
GET; a partial one only the ranges holding its chunks; a memory bound smaller than a
data file splits the fetches and still restores every value; a damaged byte inside a
whole-object fetch is still found by its chunk's crc32c."""

import collections
import json

import jax
import numpy as np
import pytest
import tensorstore as ts
from _s3_requests import S3Requests
from _trees import assert_same_tree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin._zarr import packed_reader as packed_ranges

pytest_plugins = ["_servers"]


def _tree():
    rng = np.random.default_rng(7)
    return {
        "w": rng.random((700, 1100), dtype=np.float32),  # 3 MiB: several chunks
        "emb": rng.random((3000, 512)).astype(np.float32),  # 6 MiB
        "small": {f"l{i}": np.full((i + 1,), i, np.int32) for i in range(50)},
    }


def _data_gets(lines):
    """{data file: [statuses]} of the GETs of ``.bin`` objects among ``lines``."""
    out: dict[str, list[int]] = {}
    for kind, path, status in lines:
        if kind == "GET" and path.endswith(".bin"):
            out.setdefault(path.rsplit("/", 1)[-1], []).append(status)
    return out


def test_s3_restore_fetches_each_data_file_once_and_a_partial_one_only_its_ranges(
    s3_location,
):
    tree = _tree()
    v1, v2 = s3_location.join("v1"), s3_location.join("v2")
    fop.save(v1.url, tree, format_version=1)
    fop.save(v2.url, tree, format_version=2, data_file_bytes=4 << 20)
    bins = [k.rsplit("/", 1)[-1] for k in v2.keys() if k.endswith(".bin")]
    assert len(bins) >= 3, bins
    with S3Requests() as requests:
        requests.take()
        assert_same_tree(tree, fop.restore(v1.url))
        gets_v1 = requests.take().get("GET", 0)
        assert_same_tree(tree, fop.restore(v2.url))
        lines = requests.take_lines()
        # Only the emb leaf, replicated over two devices: none of the other leaves' bytes.
        mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
        like = {
            "emb": jax.ShapeDtypeStruct((3000, 512), np.float32, sharding=NamedSharding(mesh, P()))
        }
        got = fop.restore(v2.url, like=like, partial=True)
        partial = _data_gets(requests.take_lines())
    whole = _data_gets(lines)
    # One plain GET (200, the whole object) per data file; every chunk file is one in v1.
    assert whole == {name: [200] for name in bins}, whole
    gets_v2 = sum(1 for kind, _, _ in lines if kind == "GET")
    # and the JSON documents: _COMMITTED (read twice today), _METADATA.json, data/0.json.
    assert gets_v2 <= len(bins) + 4 and gets_v2 < gets_v1, (gets_v2, gets_v1)
    np.testing.assert_array_equal(np.asarray(got["emb"]), tree["emb"])
    # emb's files only: whole where its chunks fill 3/4 of one, else one byte range.
    leaves = json.loads(v2.read("_METADATA.json"))["leaves"]
    (emb,) = [i for i, leaf in enumerate(leaves) if leaf["path"] == "emb"]
    index = json.loads(v2.read("data/0.json"))
    sizes = [f["bytes"] for f in index["files"]]
    held = collections.Counter()
    for key, (number, _, length, _) in index["chunks"].items():
        if key.startswith(f"d/{emb}/c/"):
            held[number] += length
    want = {
        index["files"][n]["name"]: [200 if b >= 0.75 * sizes[n] else 206] for n, b in held.items()
    }
    assert partial == want and set(partial) < set(bins), (partial, want)


def test_a_memory_bound_under_a_data_file_still_restores_and_damage_is_still_found(
    s3_location, monkeypatch
):
    tree = _tree()
    fop.save(s3_location.url, tree, format_version=2, data_file_bytes=8 << 20)
    monkeypatch.setattr(packed_ranges, "FETCH_BYTES", 1 << 20)
    monkeypatch.setattr(packed_ranges, "PIECE_BYTES", 1 << 20)
    with S3Requests() as requests:
        requests.take()
        assert_same_tree(tree, fop.restore(s3_location.url))
        split = _data_gets(requests.take_lines())
    assert {s for statuses in split.values() for s in statuses} <= {200, 206}, split
    monkeypatch.undo()
    # One flipped byte in the middle of a data file, fetched whole: its chunk's crc32c.
    kv = ts.KvStore.open(s3_location.join("data").spec).result()
    name = sorted(k for k in s3_location.keys() if k.endswith(".bin"))[0].rsplit("/", 1)[-1]
    raw = bytearray(kv.read(name).result().value)
    raw[len(raw) // 2] ^= 0xFF
    kv.write(name, bytes(raw)).result()
    with pytest.raises(fop.CorruptCheckpointError, match="crc32c"):
        fop.restore(s3_location.url)


def test_the_plan_merges_small_gaps_and_fetches_a_mostly_wanted_file_whole():
    mib = 1 << 20
    items = [(0, mib, "a"), (mib + 100, mib, "b"), (5 * mib, mib, "c")]
    ranges = packed_ranges.plan_file("0-0.bin", items, 100 * mib)
    assert [(r.start, r.stop, [k for *_, k in r.items]) for r in ranges] == [
        (0, 2 * mib + 100, ["a", "b"]),
        (5 * mib, 6 * mib, ["c"]),
    ]
    items = [(0, mib, "a"), (mib, mib, "b"), (3 * mib, mib, "c")]  # 3 of 4 MiB
    (whole,) = packed_ranges.plan_file("0-0.bin", items, 4 * mib)
    assert (whole.whole, whole.start, whole.stop) == (4 * mib, 0, 4 * mib)


def test_a_range_that_would_pass_the_memory_bound_is_fetched_in_pieces(monkeypatch):
    from flax_orbax_plugin._zarr.chunks import Segment

    kv = ts.KvStore.open("memory://").result()
    mib = 1 << 20
    chunks = {}
    for name in ("0-0.bin", "0-1.bin"):
        kv.write(name, bytes(range(256)) * (16 * mib // 256)).result()
        for i in range(16):
            chunks[f"d/{name[2]}/c/{i}"] = Segment(name, i * mib, mib, 0)
    monkeypatch.setattr(packed_ranges, "FETCH_BYTES", 20 * mib)
    monkeypatch.setattr(packed_ranges, "PIECE_BYTES", 4 * mib)
    reads = packed_ranges.RangeReads(kv, chunks, {"0-0.bin": 16 * mib, "0-1.bin": 16 * mib})
    reads.want(list(chunks))
    reads.plan()
    assert reads.gets == 1  # the plan started 0-0 (whole: 16 MiB); 0-1 does not fit
    first = reads.take("d/0/c/0", chunks["d/0/c/0"])
    assert reads.gets == 1 and bytes(first[:3]) == bytes([0, 1, 2])
    # 0-1 whole would hold 32 MiB: 4 MiB from the chunk that asked, then the rest.
    for i in (5, 6, 7, 8):
        value = reads.take(f"d/1/c/{i}", chunks[f"d/1/c/{i}"])
        assert len(value) == mib and bytes(value[:2]) == bytes([0, 1])
    assert reads.gets == 2
    for i in range(1, 16):  # 0-0 done: its 16 MiB released, the rest of 0-1 starts
        reads.take(f"d/0/c/{i}", chunks[f"d/0/c/{i}"])
    rest = [i for i in range(16) if i not in (5, 6, 7, 8)]
    for i in rest:
        assert len(reads.take(f"d/1/c/{i}", chunks[f"d/1/c/{i}"])) == mib
    assert reads.gets == 4  # 0-1's rest: [0, 5 MiB) and [9, 16 MiB), split by the gap
    assert reads.take("d/1/c/0", chunks["d/1/c/0"]) is None  # every wanted take done
