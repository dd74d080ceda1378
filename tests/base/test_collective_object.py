"""The one collective object (``_base.distributed.Region``, issue 52): every operation's
entry hands one down, always, and the code below calls its methods instead of asking
whether there are several processes. Several processes: tests/end_to_end/test_distributed.py
and test_liveness.py run the same methods across real processes."""

from __future__ import annotations

import ast
import pathlib

import pytest

import flax_orbax_plugin
from flax_orbax_plugin._base import distributed as _distributed
from flax_orbax_plugin._errors import CheckpointError


def test_a_region_that_spans_draws_its_own_names_and_one_outside_draws_the_processs():
    spanning = _distributed.Region("probe", "7")
    assert spanning.spans
    assert spanning.next_operation_id("x") == "fop/x/7.0"
    assert spanning.next_operation_id("y") == "fop/y/7.1"
    assert spanning.unique_name().endswith("x7y2")
    outside = _distributed.Region("probe")
    assert not outside.spans
    first, second = outside.next_operation_id("x"), outside.next_operation_id("x")
    assert first != second and first.rsplit("/", 1)[1].isdigit()
    assert outside.drawn == 0  # its names are the process's sequence, not its own


def test_one_process_rounds_return_at_once():
    region = _distributed.Region("probe", "8")
    assert region.gather_json("k", {"a": 1}) == [{"a": 1}]
    assert region.broadcast_str("k", "v") == "v"
    region.barrier("k")
    region.publish("k", "v")
    region.agree("k", None, what="probe")
    error = CheckpointError("mine")
    with pytest.raises(CheckpointError, match="mine"):
        region.agree("k", error, what="probe")


def test_the_entry_hands_a_region_to_the_body_on_every_call():
    seen = []

    @_distributed.public("probe-entry")
    def body(*, region):
        seen.append(region)

    body()
    body()
    assert all(isinstance(r, _distributed.Region) for r in seen)
    assert seen[0] is not seen[1]  # each call draws its own


def _asks_for_none(node: ast.AST, names: set[str]) -> bool:
    """``<a region> is None`` (or ``is not``): a name annotated as a Region, or an
    attribute ``.region`` / ``._region`` (a request's, a handle's, the tier rounds')."""
    if not (isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.Is, ast.IsNot))):
        return False
    right, left = node.comparators[0], node.left
    if not (isinstance(right, ast.Constant) and right.value is None):
        return False
    if isinstance(left, ast.Attribute):
        return left.attr in ("region", "_region")
    return isinstance(left, ast.Name) and left.id in names


def test_no_code_below_the_entries_asks_whether_there_is_a_region():
    """``region is None`` was the old spelling of "one process or not collective": the
    object is always there now. (The byte readers' ``region``, a slice they read, is no
    Region; liveness's judge of a bare wait, outside any operation, takes None.)"""
    root = pathlib.Path(flax_orbax_plugin.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "liveness.py":
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs
            names = {a.arg for a in args if a.annotation and "Region" in ast.unparse(a.annotation)}
            for node in ast.walk(fn):
                if _asks_for_none(node, names):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
