"""The copy that checksums as it copies (``_zarr/_copycrc.c``, optional, and its
fallback in ``_zarr/crcs.py``): the bytes copied, and the crc32c of exactly the
``crc32c`` package's ``crc32c(data, value)``, for every way the kernel has (SSE4.2
with cached and with non-temporal stores, the portable C path), sizes 0, 1, odd ones
and ones around its blocks, unaligned source and destination, crcs continued over
pieces and over zero padding; the same through the fallback (the kernel absent,
monkeypatched), and ``copy_with_crcs`` giving ``chunk_crcs``'s values both ways."""

from __future__ import annotations

import crc32c
import ml_dtypes
import numpy as np
import pytest

from flax_orbax_plugin._zarr import chunks as _crcs

K = _crcs._copycrc
needs_kernel = pytest.mark.skipif(K is None, reason="the C extension is not built here")
BLOCK = 65600  # the kernel's bytes per stream (then 1088): sizes around 3 of them
SIZES = [0, 1, 2, 7, 8, 15, 16, 17, 31, 33, 255, 4095, 4097, 3 * BLOCK - 1, 3 * BLOCK]
SIZES += [3 * BLOCK + 1, 3 * BLOCK + 3 * 1088 + 17, 6 * BLOCK + 17, (1 << 20) + 3]
SIZES += [3 * 1088 - 1, 3 * 1088, 3 * 1088 + 5, 6 * 1088 + 16]


def _impls() -> list[int]:
    if K is None:
        return []
    return [K.AUTO, K.PORTABLE] + ([K.SSE42, K.SSE42_NT] if K.HARDWARE else [])


def _buffers(rng, n: int, src_off: int, dst_off: int):
    src = rng.integers(0, 256, n + src_off, dtype=np.uint8)[src_off:]
    dst = np.full(n + dst_off + 8, 0xAB, np.uint8)
    return dst, src


@needs_kernel
@pytest.mark.parametrize("impl", _impls())
def test_kernel_copies_and_gives_the_crc32c_of_the_package(impl):
    rng = np.random.default_rng(impl)
    sizes = SIZES + [int(n) for n in rng.integers(0, 200_000, 12)]
    for n in sizes:
        for src_off, dst_off in [(0, 0), (1, 0), (0, 3), (5, 13), (8, 7)]:
            dst, src = _buffers(rng, n, src_off, dst_off)
            start = int(rng.integers(0, 1 << 32))
            got = K.copy_crc(dst[dst_off : dst_off + n], src, start, impl)
            assert got == crc32c.crc32c(src, start), (n, src_off, dst_off)
            assert np.array_equal(dst[dst_off : dst_off + n], src), (n, src_off, dst_off)
            assert (dst[:dst_off] == 0xAB).all() and (dst[dst_off + n :] == 0xAB).all()


@needs_kernel
@pytest.mark.parametrize("impl", _impls())
def test_kernel_crc_continues_over_pieces_and_zero_padding(impl):
    rng = np.random.default_rng(100 + impl)
    for _ in range(20):
        n = int(rng.integers(0, 300_000))
        src = rng.integers(0, 256, n, dtype=np.uint8)
        dst = np.empty_like(src)
        cuts = sorted(int(c) for c in rng.integers(0, n + 1, int(rng.integers(0, 6))))
        crc = 0
        for a, b in zip([0, *cuts], [*cuts, n], strict=True):
            crc = K.copy_crc(dst[a:b], src[a:b], crc, impl)
        assert crc == crc32c.crc32c(src)
        assert np.array_equal(dst, src)
        pad = int(rng.integers(0, 70_000))
        assert K.extend_zeros(crc, pad) == crc32c.crc32c(np.zeros(pad, np.uint8), crc)


@needs_kernel
def test_kernel_takes_any_contiguous_buffer_and_refuses_the_rest():
    src = bytes(range(256)) * 9
    dst = bytearray(len(src))
    assert K.copy_crc(dst, src) == crc32c.crc32c(src)
    assert bytes(dst) == src
    words = np.arange(1001, dtype=np.float32)  # any dtype: its bytes
    out = np.zeros_like(words)
    assert K.copy_crc(out, words, 7) == crc32c.crc32c(words.tobytes(), 7)
    assert np.array_equal(out, words)
    with pytest.raises(ValueError, match="bytes"):
        K.copy_crc(bytearray(3), b"abcd")
    with pytest.raises((TypeError, BufferError)):  # a read-only destination
        K.copy_crc(b"abcd", b"abcd")
    with pytest.raises((ValueError, BufferError, TypeError)):  # not contiguous
        K.copy_crc(np.zeros(8, np.uint8), np.zeros(16, np.uint8)[::2])
    with pytest.raises(ValueError, match="2\\*\\*32"):
        K.copy_crc(bytearray(1), b"a", 1 << 32)
    with pytest.raises((OverflowError, ValueError)):
        K.copy_crc(bytearray(1), b"a", -1)
    with pytest.raises(ValueError):
        K.extend_zeros(0, -1)
    with pytest.raises(RuntimeError):
        K.copy_crc(bytearray(1), b"a", 0, 99)


@pytest.fixture(params=["kernel", "fallback"])
def way(request, monkeypatch):
    """The kernel where built, and the fallback (the extension made absent)."""
    if request.param == "kernel":
        if K is None:
            pytest.skip("the C extension is not built here")
    else:
        monkeypatch.setattr(_crcs, "_copycrc", None)
        monkeypatch.setattr(_crcs, "COPY_STEP", 4096)  # several pieces per chunk
    return request.param


def test_copy_crc_both_ways(way):
    assert _crcs.has_kernel() == (way == "kernel")
    rng = np.random.default_rng(7)
    for n in SIZES + [int(n) for n in rng.integers(0, 100_000, 8)]:
        for off in (0, 1, 3):
            src = rng.integers(0, 256, n + off, dtype=np.uint8)[off:]
            dst = np.empty(n + 1, np.uint8)[1:]
            start = int(rng.integers(0, 1 << 32))
            assert _crcs.copy_crc(dst, src, start) == crc32c.crc32c(src, start), n
            assert np.array_equal(dst, src)
        for pad in (0, 1, 3, 4099):
            want = crc32c.crc32c(np.zeros(pad, np.uint8), n)
            assert _crcs.extend_zeros(n, pad) == want


def test_the_fallback_by_argument_and_the_kernel_when_absent(monkeypatch):
    rng = np.random.default_rng(8)
    src = rng.integers(0, 256, 100_003, dtype=np.uint8)
    dst = np.empty_like(src)
    assert _crcs.copy_crc(dst, src, 5, kernel=False) == crc32c.crc32c(src, 5)
    assert np.array_equal(dst, src)
    monkeypatch.setattr(_crcs, "_copycrc", None)
    with pytest.raises(RuntimeError, match="not built"):
        _crcs.copy_crc(dst, src, 0, kernel=True)


CASES = [  # (dtype, shape, chunk): edge chunks on the first axis, on a trailing one
    (np.float32, (150, 101), (16, 101)),
    (np.float32, (3, 5001), (1, 2048)),
    (ml_dtypes.bfloat16, (77, 129), (8, 129)),
    (np.bool_, (300, 61), (64, 61)),
    (np.float64, (10007,), (1024,)),
    (np.int8, (5, 7, 9), (2, 7, 9)),
    (np.int8, (5, 7, 9), (2, 3, 9)),
]


@pytest.mark.parametrize("dtype, shape, chunk", CASES)
def test_copy_with_crcs_gives_the_crcs_a_chunk_file_stores(way, dtype, shape, chunk):
    rng = np.random.default_rng(9)
    data = rng.standard_normal(shape) * 50
    data = (data > 0) if dtype is np.bool_ else data.astype(dtype)
    whole = tuple(slice(0, n) for n in shape)
    want = _crcs.chunk_crcs(shape, chunk, whole, data)
    for rows in [(0, shape[0]), (chunk[0], shape[0]), (0, chunk[0])]:
        index = (slice(*rows), *whole[1:])
        src = data[index]
        dst = np.empty_like(src)
        out: dict = {}
        _crcs.copy_with_crcs(dst, src, shape, chunk, index, out, kernel=None)
        assert np.array_equal(dst, src)
        assert out and all(out[cell] == want[cell] for cell in out)
        grid = [-(-(b - a) // c) for (a, b), c in [(rows, chunk[0])]]
        assert len({cell[0] for cell in out}) == grid[0]
