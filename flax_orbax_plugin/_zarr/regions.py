"""Regions of an array in whole chunks, each at most a budget of bytes (``verify``
reads an array one such region at a time). Pure functions: any thread."""

from __future__ import annotations

import itertools
import math

__all__ = ["covering", "nbytes", "within"]


def covering(shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int, budget: int):
    """Regions (tuples of slices) of whole chunks covering an array, each at most ``budget``
    bytes where one chunk is not larger: slabs along the first axis where they fit, else
    along the next within one chunk of the first, and so on. A generator."""
    if not shape or math.prod(shape) * itemsize <= budget:
        yield None
        return
    ndim = len(shape)
    axis = ndim - 1
    for k in range(ndim):  # the first axis along which a run of whole chunks fits
        if math.prod(chunk[: k + 1]) * math.prod(shape[k + 1 :]) * itemsize <= budget:
            axis = k
            break
    per_chunk = math.prod(chunk[: axis + 1]) * math.prod(shape[axis + 1 :]) * itemsize
    step = chunk[axis] * max(1, budget // per_chunk)
    outer = (range(0, shape[a], chunk[a]) for a in range(axis))
    for starts in itertools.product(*outer):
        cells = zip(starts, chunk[:axis], shape[:axis], strict=True)
        head = tuple(slice(a, min(a + c, n)) for a, c, n in cells)
        tail = tuple(slice(0, n) for n in shape[axis + 1 :])
        for lo in range(0, shape[axis], step):
            yield (*head, slice(lo, min(lo + step, shape[axis])), *tail)


def within(shape: tuple[int, ...], span, chunk, itemsize: int, budget: int):
    """covering regions of the part ``span`` (a tuple of slices; None: all) of an array."""
    if span is None:
        yield from covering(shape, chunk, itemsize, budget)
        return
    extents = tuple(s.stop - s.start for s in span)
    for region in covering(extents, chunk, itemsize, budget):
        if region is None:
            yield span
        else:
            pairs = zip(span, region, strict=True)
            yield tuple(slice(s.start + r.start, s.start + r.stop) for s, r in pairs)


def nbytes(region, shape: tuple[int, ...], itemsize: int) -> int:
    if region is None:
        return math.prod(shape) * itemsize
    return math.prod(s.stop - s.start for s in region) * itemsize
