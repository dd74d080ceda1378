"""Comparing restored trees in tests."""

from __future__ import annotations

import numpy as np


def assert_same_tree(a: dict, b: dict) -> None:
    """``a`` and ``b`` (nested dicts of arrays) have the same keys and equal arrays
    (the failing leaf's key in the message)."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_same_tree(a[k], b[k])
        else:
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)
