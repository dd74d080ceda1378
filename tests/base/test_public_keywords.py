"""An unknown keyword at any public entry point names the keyword it most likely meant
(``_base.keywords.named_keywords``), as the manager's options do.

Every public function and class is tried, with each of its keywords misspelt: a name a
new entry point adds is covered without a test of its own."""

from __future__ import annotations

import inspect

import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import _api

_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_CALLED = {"CheckpointManager", "CheckpointCallback"}  # the objects users call methods of


def _entry_points():
    """(name, callable) of each public function, the constructor of each public class
    users make (not the records the library makes: ``_api._MADE_INSIDE``) and each
    public method of the manager and the callback."""
    for name in fop.__all__:
        value = getattr(fop, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            continue
        if name in _api._MADE_INSIDE:
            continue
        if inspect.isfunction(value) or isinstance(value, type):
            yield name, value
        if name in _CALLED:
            for method in dir(value):
                attr = inspect.getattr_static(value, method)
                if not method.startswith("_") and inspect.isfunction(attr):
                    yield f"{name}.{method}", attr


def _misspellings():
    for owner, fn in _entry_points():
        target = fn.__init__ if isinstance(fn, type) else fn
        if inspect.unwrap(target).__code__.co_flags & inspect.CO_VARKEYWORDS:
            continue  # takes **options: refused by its own table (test_options)
        for p in inspect.signature(target).parameters.values():
            if p.kind in _KINDS and p.name not in ("self", "cls") and len(p.name) >= 4:
                yield pytest.param(owner, fn, p.name, id=f"{owner}:{p.name}")


CASES = list(_misspellings())


def test_the_public_surface_is_covered():
    owners = {case.values[0] for case in CASES}
    for expected in ("save", "restore", "restore_params", "Tier", "KeepBest", "verify"):
        assert expected in owners
    assert "CheckpointManager.wrap_step" in owners  # a method of a mixin
    assert "CheckpointCallback.on_train_start" in owners
    assert "KeepBest" in owners and "Fuse" in owners


def test_what_the_package_calls_inside_is_left_unwrapped():
    # a rule's own methods run every step, a Location's on every call: never wrapped
    assert not hasattr(fop.EverySteps.wants, "__wrapped__")
    assert not hasattr(fop.Location.child, "__wrapped__")
    assert not hasattr(fop.Location.__init__, "__wrapped__")


class _StandIn:
    """A method's stand-in ``self``: a manager's calls refused from its own hook ask its
    events first (``events.refuse_from_hooks``: before the region the keyword is
    refused in); not from a hook here."""

    _stall_s = _scope = None

    class _book:
        class events:
            @staticmethod
            def refuse_in_hook(call):
                return None


@pytest.mark.parametrize(("owner", "fn", "name"), CASES)
def test_a_misspelt_keyword_names_the_one_meant(owner, fn, name):
    wrong = name[:-1] + ("x" if name[-1] != "x" else "y")  # one letter off
    args = (_StandIn(),) if "." in owner else ()  # a method, unbound: a stand-in self
    with pytest.raises(TypeError, match=rf"'{wrong}': did you mean {name}=\?") as caught:
        fn(*args, **{wrong: 1})
    assert name in str(caught.value).rsplit("its keywords:", 1)[1]


def test_known_keywords_still_pass_through():
    assert fop.Tier("/tmp/unused-tier-path", keep=2).keep == 2
    assert fop.KeepBest(2, metric="loss", mode="max").mode == "max"
    assert fop.EverySteps(n=5) == fop.EverySteps(5)
