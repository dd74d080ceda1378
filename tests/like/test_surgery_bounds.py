"""Surgery ops checked whole when made, and their messages bounded (issue 51 item 8).

``fop.Transpose(path, (1.0, 0.0))`` was accepted (1.0 == 1), then a raw TypeError at
restore; a stack of saved layers 0, 2 and 1,000,000 built a 15.8 MB message listing
every missing number (near 10**9 it would have needed gigabytes to build).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import shown


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda: fop.Transpose("w", (1.0, 0.0)), r"Transpose: axes must be a permutation.*1\.0"),
        (lambda: fop.Transpose("w", (True, False)), r"Transpose: axes.*True"),
        (lambda: fop.Transpose("w", "10"), r"Transpose: axes"),
        (lambda: fop.Split("w", ["a", "b"], 0, sizes=[1.0, 2]), r"Split: sizes must be 2 ints"),
        (lambda: fop.Split("w", ["a", "b"], 0, sizes=[True, 2]), r"Split: sizes"),
        (lambda: fop.Split("w", ["a", "b"], 1.0), r"Split: axis must be an int"),
        (
            lambda: fop.Stack("t", "l_{i}/x_{i}"),
            r"Stack: sources must be a pattern with \{i\} \(once",
        ),
        (lambda: fop.Unstack("t", "l_{i}{i}"), r"Unstack: targets must be a pattern with \{i\}"),
        (lambda: fop.Fuse("t", ["a", "b"], axis=False), r"Fuse: axis must be an int"),
        (lambda: fop.Rename("a", 3), r"Rename: new must be a leaf path"),
    ],
)
def test_every_op_checks_its_arguments_when_made(make, text):
    with pytest.raises(fop.TransformError, match=text):
        make()


def test_numpy_ints_are_taken_as_ints():
    assert fop.Transpose("w", [np.int64(1), np.int32(0)]).axes == (1, 0)
    split = fop.Split("w", ["a", "b"], np.int64(0), sizes=[np.int32(1), 2])
    assert split.sizes == (1, 2) and type(split.sizes[0]) is int


def test_a_transpose_of_float_axes_never_reaches_the_restore(tmp_path):
    fop.save(tmp_path / "c", {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    with pytest.raises(fop.TransformError, match="Transpose: axes"):
        fop.restore(
            tmp_path / "c",
            {"w": np.zeros((3, 2), np.float32)},
            surgery=[fop.Transpose("w", (1.0, 0.0))],
        )
    got = fop.restore(
        tmp_path / "c", {"w": np.zeros((3, 2), np.float32)}, surgery=[fop.Transpose("w", (1, 0))]
    )
    np.testing.assert_array_equal(got["w"], np.arange(6, dtype=np.float32).reshape(2, 3).T)


def test_missing_layers_are_summarised_as_ranges(tmp_path):
    tree = {f"layers_{i}": {"w": np.full(2, i, np.float32)} for i in (0, 2, 1_000_000)}
    fop.save(tmp_path / "c", tree)
    started = time.perf_counter()
    with pytest.raises(fop.StructureError) as e:
        fop.restore(
            tmp_path / "c",
            {"scan": {"w": np.zeros((3, 2), np.float32)}},
            surgery=[fop.Stack("scan/", "layers_{i}/")],
        )
    assert time.perf_counter() - started < 5
    text = str(e.value)
    assert len(text) < 4000, len(text)
    assert "found no layer [1, 3..999999]" in text


def test_the_message_helpers_are_bounded():
    assert shown.listed(range(3)) == "0, 1, 2"
    assert shown.listed(range(1000), limit=2) == "0, 1 ... and 998 more"
    assert shown.listed(["x" * 10_000]).endswith("...") and len(shown.listed(["x" * 10_000])) == 200
    assert shown.gaps([0, 2, 10**9]) == [(1, 1), (3, 10**9 - 1)]
    many = shown.gaps(list(range(0, 2000, 2)))
    text = shown.number_ranges(many)
    assert text.endswith("... and 991 more ranges (991 numbers)") and len(text) < 200
