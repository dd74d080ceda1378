"""Hostile ``transform=`` options (issue 32, the red-team pass over the one transform
checker), through every restore entry point, on local disk and memory://: each is a
TransformError naming the entry (or the saved path a callable failed on), never the
callable's own KeyError/ZeroDivisionError escaping from deep inside the read, and
the option types that are not a dict or a callable are refused whole."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

import flax_orbax_plugin as fop


def _raises_key_error(path):
    raise KeyError(path)


class _Failing:
    def __call__(self, path):
        return path.encode("ascii") and 1 / 0


class _DictSubclass(dict):  # a class is callable: DictSubclass('a/b') raises ValueError
    pass


HOSTILE = [
    # (transform, what the message must name)
    (_raises_key_error, r"transform\('layers_0/w'\) raised KeyError: 'layers_0/w'"),
    (_Failing(), r"transform\('layers_0/w'\) raised ZeroDivisionError: division by zero"),
    (_DictSubclass, r"transform\('layers_0/w'\) raised ValueError: dictionary update"),
    (lambda p: p.encode(), r"transform\('layers_0/w'\) returned bytes b'layers_0/w'"),
    ({b"layers": "block"}, r"every key is a regex pattern \(a str\); found bytes b'layers'"),
    ({"layers": b"block"}, r"transform\['layers'\]: expected a replacement str.*found bytes"),
    ({"layers": {"a": "b"}}, r"transform\['layers'\]: expected a replacement str.*found dict"),
    ([("layers", "block")], r"expected a dict \{regex: replacement\}.*found list"),
    ("layers", r"expected a dict \{regex: replacement\}.*found str 'layers'"),
    (b"layers", r"found bytes b'layers'"),
    ({"(l)": r"\99999999999999999999"}, r"invalid group reference.*1 group \(\\1\)"),
    ({"(l)": r"\g<99999999999999999999>"}, r"invalid group reference 99999999999999999999"),
    ({"(?P<n>l)": r"\g<m>"}, r"unknown group name 'm'.*named 'n'"),
    ({"l": r"\g<>"}, r"missing group name"),
]
IDS = ["raises", "instance-raises", "class", "returns-bytes", "bytes-key", "bytes-value"]
IDS += ["nested-dict", "list-of-pairs", "str", "bytes", "huge-group", "huge-g", "named"]
IDS += ["empty-g"]


def tree():
    return {"params": {"layers_0": {"w": np.ones(2, np.float32)}}}


@pytest.fixture(scope="module", params=["local", "memory"])
def run(request, tmp_path_factory):
    if request.param == "local":
        directory = str(tmp_path_factory.mktemp("hostile") / "run")
    else:
        directory = f"memory://hostile-transforms/{next(_RUNS)}"
    with fop.CheckpointManager(directory, async_save=False) as mngr:
        mngr.save(1, tree())
    return directory


_RUNS = itertools.count()


def _callback(run, transform):
    cb = fop.CheckpointCallback(run, resume=True)
    try:
        cb.on_train_start(tree(), transform=transform)
    finally:
        cb.close()


def _manager(run, transform):
    with fop.CheckpointManager(run, read_only=True) as mngr:
        mngr.restore(like=tree(), transform=transform)


ENTRY_POINTS = {
    "restore": lambda r, t: fop.restore(f"{r}/1/params", tree()["params"], transform=t),
    "restore-no-like": lambda r, t: fop.restore(f"{r}/1/params", transform=t),
    "manager": _manager,
    "callback": _callback,
    "restore_params": lambda r, t: fop.restore_params(r, tree()["params"], transform=t),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("transform,message", HOSTILE, ids=IDS)
def test_hostile_transform_is_a_transform_error(run, entry, transform, message):
    with pytest.raises(fop.TransformError, match=message) as info:
        ENTRY_POINTS[entry](run, transform)
    assert isinstance(info.value, fop.CheckpointError)


def test_the_callables_own_error_is_chained(run):
    with pytest.raises(fop.TransformError) as info:
        fop.restore_params(run, tree()["params"], transform=_raises_key_error)
    assert isinstance(info.value.__cause__, KeyError)


def test_an_interrupt_inside_the_callable_is_not_swallowed(run):
    def interrupted(path):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fop.restore_params(run, tree()["params"], transform=interrupted)


def test_a_rule_that_matches_no_saved_path_is_warned_of(run):
    """A typo in a rule used to change nothing, silently; a rule that matches only what
    an earlier rule made of a path counts as matching (the rules apply in order)."""
    params = tree()["params"]
    with pytest.warns(UserWarning, match=r"transform rule 'NOPE' matched no saved leaf path"):
        fop.restore_params(run, params, transform={"NOPE": "x"})
    chained = {"layers_0": "tmp", "tmp": "block_0"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fop.restore_params(run, {"block_0": params["layers_0"]}, transform=chained)
    np.testing.assert_array_equal(got["block_0"]["w"], params["layers_0"]["w"])
