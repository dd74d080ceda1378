"""Sub-byte leaves stored packed: the bytes on disk are the FORMAT.md layout (a
little-endian bit stream per row, rows to whole bytes), their size is the values'
bits, and a record claiming packed storage where it cannot be is refused."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._errors import CorruptCheckpointError
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._zarr import subbyte as _subbyte

SUB_BYTE = sorted(n for n, e in _layout.DTYPES.items() if e.bits < 8)


def _values(name: str, shape) -> np.ndarray:
    bits = _layout.DTYPES[name].bits
    rng = np.random.default_rng(bits)
    raw = rng.integers(0, 1 << bits, int(np.prod(shape)), dtype=np.uint8)
    return raw.view(_layout.dtype_from_name(name)).reshape(shape)


def _reference_rows(values: np.ndarray, bits: int) -> bytes:
    """FORMAT.md's layout one value at a time: each row a little-endian bit stream,
    value j at bits [j*bits, (j+1)*bits), padded with zero bits to a whole byte."""
    out = b""
    for row in values.reshape(-1, values.shape[-1]):
        stream = 0
        for j, byte in enumerate(row.view(np.uint8).tolist()):
            stream |= byte << (j * bits)
        out += stream.to_bytes(-(-len(row) * bits // 8), "little")
    return out


@pytest.mark.parametrize("name", SUB_BYTE)
def test_rows_pack_and_unpack_as_the_format_says(name):
    bits = _layout.DTYPES[name].bits
    values = _values(name, (3, 7))
    packed = _subbyte.pack_rows(values, bits)
    assert packed.tobytes() == _reference_rows(values, bits)
    dtype = values.dtype
    back = _subbyte.unpack_rows(packed, bits, 7, 0, dtype)
    assert back.tobytes() == values.tobytes()
    g = _subbyte.group(bits)
    for start in range(1, 7):  # a region starting inside a byte: read from its group
        first = start - start % g
        cut = _subbyte.unpack_rows(
            packed[:, first * bits // 8 :], bits, 7 - start, start - first, dtype
        )
        assert cut.tobytes() == np.ascontiguousarray(values[:, start:]).tobytes()


def _chunk_files(path: str, index: int) -> dict[str, bytes]:
    root = os.path.join(path, "d", str(index), "c")
    out = {}
    for top, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(top, n), "rb") as f:
                out[os.path.relpath(os.path.join(top, n), root)] = f.read()
    return out


@pytest.mark.parametrize("name", SUB_BYTE)
def test_chunk_files_hold_the_packed_rows(tmp_path, name):
    """A (1100, 1001) leaf: its chunk files are the rows packed (odd length: the last
    byte of each 4-bit row half used) plus a crc32c each, and read back exactly."""
    bits = _layout.DTYPES[name].bits
    values = _values(name, (1100, 1001))
    path = str(tmp_path / "c")
    fop.save(path, {"w": values}, format_version=1)
    doc = json.loads(open(os.path.join(path, _layout.METADATA_FILE), "rb").read())
    (record,) = doc["leaves"]
    assert record["storage"]["type"] == "packed_array" and record["dtype"] == name
    files = _chunk_files(path, 0)
    rows = record["storage"]["chunk_shape"][0]
    row_bytes = -(-1001 * bits // 8)
    assert sum(len(b) for b in files.values()) == -(-1100 // rows) * (rows * row_bytes + 4)
    first = files[os.path.join("0", "0")]
    assert first[: 3 * row_bytes] == _reference_rows(values[:3], bits)
    got = fop.restore(path)["w"]
    assert got.dtype == values.dtype and got.tobytes() == values.tobytes()


@pytest.mark.parametrize("format_version", [1, 2])
def test_stored_bytes_are_the_values_bits(tmp_path, format_version):
    """The bytes a save stores for a leaf of 1 MiB of values of each sub-byte dtype, against
    the same values one per byte (uint8)."""
    stored = {}
    for name in [*SUB_BYTE, "uint8"]:
        path = tmp_path / f"{name}-{format_version}"
        values = (
            _values(name, (1024, 1040)) if name != "uint8" else np.zeros((1024, 1040), np.uint8)
        )
        fop.save(str(path), {"w": values}, format_version=format_version)
        data = path / ("data" if format_version == 2 else "d")
        stored[name] = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
        stored[name] -= sum(f.stat().st_size for f in data.rglob("zarr.json"))
    for name in SUB_BYTE:
        bits = _layout.DTYPES[name].bits
        ratio = stored[name] / stored["uint8"]
        assert abs(ratio - bits / 8) < 0.002, (name, stored[name], stored["uint8"])


def _reseal(path: str, edit) -> None:
    """Edits _METADATA.json with ``edit(doc)`` and reseals it (its checksum in the
    marker): a crafted checkpoint only validation can catch."""
    meta = os.path.join(path, _layout.METADATA_FILE)
    doc = json.loads(open(meta, "rb").read())
    edit(doc)
    raw = json.dumps(doc).encode()
    with open(meta, "wb") as f:
        f.write(raw)
    marker = os.path.join(path, _layout.COMMIT_FILE)
    body = json.loads(open(marker, "rb").read())
    body.pop("checksum")
    body["files"][_layout.METADATA_FILE] = _layout.sha256(raw)
    with open(marker, "wb") as f:
        f.write(_layout.seal(body))


def _leaf(doc: dict, path: str) -> dict:
    (record,) = [r for r in doc["leaves"] if r["path"] == path]
    return record


@pytest.mark.parametrize(
    "dtype,chunk",
    [("float32", [4, 8]), ("int4", [4, 3])],  # not a sub-byte dtype; chunks of 1.5 bytes
)
def test_a_packed_array_record_that_cannot_be_is_refused(tmp_path, dtype, chunk):
    path = str(tmp_path / "c")
    values = _values("int4", (8, 8)) if dtype == "int4" else np.zeros((8, 8), np.float32)
    fop.save(path, {"w": values, "big": np.zeros((600, 600), np.float32)})

    def edit(doc):
        record = _leaf(doc, "w")
        record["dtype"] = dtype
        record["storage"] = {"type": "packed_array", "chunk_shape": chunk}

    _reseal(path, edit)
    with pytest.raises(CorruptCheckpointError, match=r"\('w'\)\.storage\.type"):
        fop.restore(path)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"size": 64}, r"storage\.size: expected 32 \(bytes of its packed values\)"),
        ({"dtype": "int8"}, r"storage\.type: expected 'batch' \(a int8 is not packed\)"),
        ({"batch": "0.int4"}, r"storage\.batch"),
    ],
)
def test_a_packed_batch_record_that_cannot_be_is_refused(tmp_path, change, field):
    """A 64-value int4 leaf's slot is 32 bytes of the uint8 batch."""
    path = str(tmp_path / "c")
    fop.save(path, {"w": _values("int4", (8, 8)), "n": np.zeros(4, ml_dtypes.int4)[:0]})

    def edit(doc):
        record = _leaf(doc, "w")
        assert record["storage"]["type"] == "packed_batch" and record["storage"]["size"] == 32
        for key, value in change.items():
            (record if key == "dtype" else record["storage"])[key] = value
        if "batch" in change:
            doc["batches"]["0.int4"] = dict(doc["batches"]["0.uint8"], dtype="int4")

    _reseal(path, edit)
    with pytest.raises(CorruptCheckpointError, match=r"\('w'\)\." + field):
        fop.restore(path)
