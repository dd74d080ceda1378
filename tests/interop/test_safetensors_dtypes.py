"""safetensors export and import for every dtype the spec names, checked by the real
``safetensors`` library (its parser and, where it has them, its writer); an honest
refusal naming the leaf and the dtype where the spec has none."""

from __future__ import annotations

import json
import re
import struct

import jax
import numpy as np
import pytest
import safetensors
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin._errors import CorruptCheckpointError, StructureError
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._interop.safetensors import headers as _headers
from flax_orbax_plugin._interop.safetensors import reader as _reader


def _raw_file(entries: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A safetensors file built by hand: {name: (tag, shape, data)}."""
    header, offset, body = {}, 0, b""
    for name, (tag, shape, data) in entries.items():
        header[name] = {"dtype": tag, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        body += data
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _spec_tags() -> set[str]:
    """Every dtype tag the installed safetensors library's parser knows (its own list,
    from its refusal of an unknown tag)."""
    with pytest.raises(Exception) as info:  # the library's own error type
        safetensors.deserialize(_raw_file({"t": ("NOT_A_DTYPE", [1], b"\0")}))
    listed = str(info.value).split("expected one of", 1)[1]
    return set(re.findall(r"`([A-Z0-9_]+)`", listed))


TAGGED = sorted((e.safetensors, n) for n, e in _layout.DTYPES.items() if e.safetensors)


def test_every_tag_of_the_spec_has_a_dtype():
    tags = _spec_tags()
    assert {"F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "F8_E4M3", "F8_E5M2", "BF16"} <= tags
    assert tags == set(_headers.DTYPES), "a safetensors tag missing from the dtype table"


def _packed_by_hand(values: np.ndarray, bits: int) -> bytes:
    """The spec's packing written out one bit at a time (an independent reference):
    value k at bits [k*bits, (k+1)*bits) of a little-endian bit stream."""
    stream = 0
    for k, byte in enumerate(values.reshape(-1).view(np.uint8).tolist()):
        stream |= (byte & ((1 << bits) - 1)) << (k * bits)
    return stream.to_bytes(values.size * bits // 8, "little")


def _sample(name: str, shape=(4, 6)) -> np.ndarray:
    dtype = _layout.dtype_from_name(name)
    count = int(np.prod(shape))
    if name == "bool":
        return (np.arange(count) % 3 == 0).reshape(shape)
    bits = _layout.DTYPES[name].bits
    if bits < 8:
        return (np.arange(count) % (1 << bits)).astype(np.uint8).view(dtype).reshape(shape)
    raw = np.random.default_rng(bits).integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("tag,name", TAGGED)
def test_export_is_what_the_library_parses(tmp_path, tag, name):
    values = _sample(name)
    out = tmp_path / "m.safetensors"
    fop.to_safetensors({"w": values}, out)
    ((tensor, info),) = safetensors.deserialize(out.read_bytes())
    assert tensor == "w" and info["dtype"] == tag and info["shape"] == [4, 6]
    bits = _layout.DTYPES[name].bits
    want = values.tobytes() if bits >= 8 else _packed_by_hand(values, bits)
    assert bytes(info["data"]) == want
    _same(fop.from_safetensors(out)["w"], values)


def _same(got, want: np.ndarray) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def _library_name(name: str) -> str:
    return {"float4_e2m1fn": "float4_e2m1fn_x2"}.get(name, name)


@pytest.mark.parametrize("tag,name", TAGGED)
def test_import_of_the_library_s_own_files(tmp_path, tag, name):
    """Files the library writes (its serializer, for every dtype it writes; F6 it only
    parses, so those are written by hand and checked by its parser)."""
    values = _sample(name)
    bits = _layout.DTYPES[name].bits
    data = values.tobytes() if bits >= 8 else _packed_by_hand(values, bits)
    buf = np.frombuffer(data, np.uint8).copy()
    shape = [4, 6 // 2] if name == "float4_e2m1fn" else [4, 6]  # the library's x2 shape
    try:
        spec = safetensors.TensorSpec(
            dtype=_library_name(name), shape=shape, data_ptr=buf.ctypes.data, data_len=buf.size
        )
        raw = safetensors.serialize({"w": spec})
    except Exception as e:  # noqa: BLE001 - the library has no writer for this dtype
        assert tag.startswith("F6_"), e
        raw = _raw_file({"w": (tag, [4, 6], data)})
    ((_, info),) = safetensors.deserialize(raw)  # the library's parser accepts it
    assert info["dtype"] == tag and info["shape"] == [4, 6]
    path = tmp_path / "lib.safetensors"
    path.write_bytes(raw)
    _same(fop.from_safetensors(path)["w"], values)
    like = {"w": np.zeros((4, 6), values.dtype)}
    _same(fop.from_safetensors(path, like)["w"], values)


@pytest.mark.parametrize("name", ["float4_e2m1fn", "float6_e2m3fn"])
def test_packed_regions_read_onto_shards(tmp_path, devices, name):
    """Shards whose rows start inside a byte (3 four-bit values: 12 bits a row) read
    exactly their values; a 6-bit tensor the same."""
    values = _sample(name, (8, 3))
    path = tmp_path / "m.safetensors"
    fop.to_safetensors({"w": values}, path)
    (t,) = _headers.read_safetensors_index(path).values()
    regions = [(slice(1, 2), slice(0, 3)), (slice(3, 7), slice(1, 2)), (slice(5, 8), slice(2, 3))]
    with open(path, "rb") as f:
        for rows, cols in regions:
            _same(_reader._read_region(f.fileno(), t, (rows, cols)), values[rows, cols])
    dtype = _layout.dtype_from_name(name)
    try:
        jax.device_put(np.zeros(2, dtype))
    except Exception:  # noqa: BLE001 - jax's CPU backend holds no float6
        return
    sharding = NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), P("x"))
    like = {"w": jax.ShapeDtypeStruct(values.shape, dtype, sharding=sharding)}
    got = fop.from_safetensors(path, like)["w"]
    assert got.sharding == sharding
    _same(got, values)


@pytest.mark.parametrize("name", sorted(n for n, e in _layout.DTYPES.items() if not e.safetensors))
def test_a_dtype_the_spec_has_not_is_refused_naming_leaf_and_dtype(tmp_path, name):
    values = _sample(name, (2, 4))
    with pytest.raises(StructureError, match=rf"leaf 'params/w': dtype {name} has no safetensors"):
        fop.to_safetensors({"params": {"w": values}}, tmp_path / "m.safetensors")
    assert not list(tmp_path.iterdir())


def test_packed_values_that_leave_half_a_byte_are_refused(tmp_path):
    values = _sample("float4_e2m1fn", (3,))
    with pytest.raises(StructureError, match=r"leaf 'w': 3 values of float4_e2m1fn are 12 bits"):
        fop.to_safetensors({"w": values}, tmp_path / "m.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_raw_file({"w": ("F4", [3], b"\0\0")}))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w': F4\[3\] is 12 bits"):
        fop.from_safetensors(bad)


def test_export_from_a_checkpoint_holding_low_bit_dtypes(tmp_path):
    tree = {name: _sample(name) for _, name in TAGGED}
    ckpt = str(tmp_path / "c")
    fop.save(ckpt, tree)
    out = tmp_path / "m.safetensors"
    fop.to_safetensors(ckpt, out)
    parsed = dict(safetensors.deserialize(out.read_bytes()))
    assert {info["dtype"] for info in parsed.values()} == {tag for tag, _ in TAGGED}
    got = fop.from_safetensors(out)
    for name, values in tree.items():
        _same(got[name], values)
