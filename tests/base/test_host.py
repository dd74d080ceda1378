"""Host buffers (``_host``): alignment, and the manager's snapshot pool."""

from __future__ import annotations

import threading

import numpy as np

from flax_orbax_plugin._base import host as _host
from flax_orbax_plugin._base import host_memory as _host_memory


def test_empty_is_aligned_and_contiguous():
    for shape, dtype in [((3, 5), np.float32), ((7,), np.int8), ((), np.float64), ((0, 4), "u2")]:
        a = _host.empty(shape, dtype)
        assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous
        assert a.size == 0 or a.ctypes.data % _host.ALIGNMENT == 0  # no bytes, no address


def test_pool_hands_back_given_back_memory_of_the_same_size():
    pool = _host_memory.BufferPool()
    a = pool.empty((256, 256), np.float32)  # 256 KiB: pooled
    addr = a.ctypes.data
    pool.give_back([a])
    assert pool.nbytes == a.nbytes
    b = pool.empty((512, 128), np.float32)  # same bytes, another shape and
    assert b.ctypes.data == addr and b.shape == (512, 128)
    assert pool.nbytes == 0
    c = pool.empty((512, 128), np.float32)  # b is out: fresh memory
    assert c.ctypes.data != addr
    d = pool.empty((100, 100), np.int16)  # no buffer of that size
    assert d.ctypes.data % _host.ALIGNMENT == 0


def test_pool_never_hands_out_a_buffer_that_was_not_given_back():
    pool = _host_memory.BufferPool()
    taken = [pool.empty((1 << 16,), np.uint8) for _ in range(4)]
    pool.give_back(taken[:2])
    again = [pool.empty((1 << 16,), np.uint8) for _ in range(3)]
    addrs = {t.ctypes.data for t in taken}
    assert {a.ctypes.data for a in again[:2]} == {t.ctypes.data for t in taken[:2]}
    assert again[2].ctypes.data not in addrs  # taken[2:] are still in use


def test_give_back_replaces_what_was_not_taken_since():
    pool = _host_memory.BufferPool()
    old = pool.empty((1 << 17,), np.uint8)
    pool.give_back([old])
    new = pool.empty((1 << 18,), np.uint8)  # another size: old stays free, unused
    pool.give_back([new])
    assert pool.nbytes == new.nbytes  # old was dropped: at most one save's worth


def test_small_buffers_are_not_pooled_and_copy_keeps_values():
    pool = _host_memory.BufferPool()
    small = pool.empty((10,), np.float32)
    pool.give_back([small])
    assert pool.nbytes == 0
    src = np.arange(1 << 16, dtype=np.float32).reshape(256, 256)[:, ::2]  # not contiguous
    out = pool.copy(src)
    np.testing.assert_array_equal(out, src)
    assert out.flags.c_contiguous and out.ctypes.data % _host.ALIGNMENT == 0


def test_pool_is_safe_across_threads():
    pool = _host_memory.BufferPool()
    errors = []

    def work(i):
        try:
            for _ in range(200):
                a = pool.empty((1 << 16,), np.uint8)
                a[:] = i
                assert (a == i).all()
                pool.give_back([a])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
