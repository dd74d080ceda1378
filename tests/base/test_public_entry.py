"""One entry decorator per public operation (``_base.distributed.public``, issue 52): the
misspelt keyword, the collective region and a store's refusal are one wrapper, not three
decorators in three wings."""

from __future__ import annotations

import inspect

import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import distributed as _distributed
from flax_orbax_plugin._errors import StoreAccessError

OPERATIONS = [
    "save",
    "save_async",
    "is_committed",
    "restore",
    "restore_params",
    "metadata",
    "verify",
    "import_orbax",
    "import_msgpack",
    "restore_orbax",
    "restore_msgpack",
    "to_safetensors",
    "from_safetensors",
]


@pytest.mark.parametrize("name", OPERATIONS)
def test_each_public_operation_passes_one_entry(name):
    fn = getattr(fop, name)
    assert getattr(fn, "_fop_named", False), name  # its keywords are checked
    body = fn.__wrapped__
    assert not hasattr(body, "__wrapped__"), f"{name}: more than one wrapper"
    assert "region" not in inspect.signature(fn).parameters


def test_the_entry_names_the_keyword_meant_and_says_a_refusal_in_words():
    refused = ValueError("NoSuchBucket")

    def errors(error, bound):
        if error is refused:
            return StoreAccessError(f"{bound['path']}: no such bucket")
        return None

    @_distributed.public("probe", errors=errors)
    def probe(path, *, region, limit=1):
        if path == "bad":
            raise refused
        if path == "other":
            raise ValueError("passes unchanged")
        return (path, region, limit)

    path, region, limit = probe("x", limit=2)
    assert (path, limit) == ("x", 2)
    # one process: the body gets a collective object that spans nothing (no tag drawn)
    assert isinstance(region, _distributed.Region) and region.kind == "probe"
    assert region.tag is None and not region.spans
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'limt': did you mean"):
        probe("x", limt=2)
    with pytest.raises(StoreAccessError, match="bad: no such bucket"):
        probe("bad")
    with pytest.raises(ValueError, match="passes unchanged"):
        probe("other")
    assert list(inspect.signature(probe).parameters) == ["path", "limit"]

    @_distributed.public(errors=errors)  # not collective: no region handed
    def single(path):
        return path

    assert single("y") == "y"


class _Mixin:
    def shared(self, path, *, depth=1):
        if path == "bad":
            raise ValueError("NoSuchBucket")
        return ("shared", path, depth)


def _probe_class():
    """A class under ``public`` (the class form): its errors name the store of ``path``;
    ``ask`` is a collective entry of its own, its region's stall and scope read from
    the instance."""

    def errors(error, bound):
        if str(error) == "NoSuchBucket":
            return StoreAccessError(f"{bound.get('path')}: no such bucket")
        return None

    @_distributed.public(errors=errors)
    class Probe(_Mixin):
        def __init__(self, path, *, limit=1):
            if path == "bad":
                raise ValueError("NoSuchBucket")
            self.path, self.limit, self._stall, self._scope = path, limit, 7.0, "t"

        def run(self, path, *, times=1):
            if path == "bad":
                raise ValueError("NoSuchBucket")
            return ("run", path, times)

        @_distributed.public("probe-ask", errors=errors, stall="_stall", scope="_scope")
        def ask(self, path, *, region, count=0):
            if path == "bad":
                raise ValueError("NoSuchBucket")
            return ("ask", path, region, count)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def _inner(self, path):
            raise ValueError("NoSuchBucket")

        @property
        def size(self):
            return self.limit

        @classmethod
        def make(cls, path):
            return cls(path)

        @staticmethod
        def helper(path):
            raise ValueError("NoSuchBucket")

    return Probe


def _entries(fn):
    """The wrappers of ``fn`` that are entries of ``public`` (its ``call``)."""
    layers = []
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_filename == _distributed.__file__:
            layers.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    return layers


def test_public_on_a_class_makes_each_public_method_an_entry():
    Probe = _probe_class()
    for name in ("__init__", "__enter__", "__exit__", "run", "shared", "ask"):
        assert len(_entries(vars(Probe)[name])) == 1, name  # one entry, the mixin's too
    for name in ("_inner", "size", "make", "helper"):
        attr = vars(Probe)[name]
        assert not _entries(getattr(attr, "__func__", getattr(attr, "fget", attr))), name
    assert isinstance(vars(Probe)["make"], classmethod)
    assert isinstance(vars(Probe)["helper"], staticmethod)
    probe = Probe("x", limit=3)
    assert probe.run("x", times=2) == ("run", "x", 2)
    assert probe.shared("y") == ("shared", "y", 1)
    what, path, region, count = probe.ask("z", count=4)
    assert (what, path, count) == ("ask", "z", 4)
    assert region.kind == "probe-ask" and not region.spans  # one process: no tag drawn
    assert probe.size == 3 and Probe.make("m").path == "m"
    with Probe("w") as entered:
        assert entered.path == "w"
    assert "region" not in inspect.signature(Probe.ask).parameters


def test_a_class_entry_names_the_keyword_meant_and_words_a_refusal():
    Probe = _probe_class()
    probe = Probe("x")
    with pytest.raises(TypeError, match=r"Probe\(\) got an unexpected keyword argument 'limt'"):
        Probe("x", limt=2)
    with pytest.raises(TypeError, match=r"Probe\.run\(\) got .* 'tims': did you mean times="):
        probe.run("x", tims=2)
    with pytest.raises(TypeError, match=r"Probe\.shared\(\) got .* 'dept': did you mean depth="):
        probe.shared("x", dept=2)
    with pytest.raises(TypeError, match=r"Probe\.ask\(\) got .* 'cont': did you mean count="):
        probe.ask("x", cont=2)
    for call in (lambda: Probe("bad"), lambda: probe.run("bad"), lambda: probe.shared("bad")):
        with pytest.raises(StoreAccessError, match="bad: no such bucket"):
            call()
    with pytest.raises(StoreAccessError, match="bad: no such bucket"):
        probe.ask("bad")
    with pytest.raises(ValueError, match="NoSuchBucket"):  # not an entry: left as it is
        Probe.helper("bad")
    with pytest.raises(ValueError, match="NoSuchBucket"):
        probe._inner("bad")


def test_a_kind_is_refused_on_a_class():
    with pytest.raises(TypeError, match="a kind is a method's"):

        @_distributed.public("probe")
        class Wrong:
            pass


@pytest.mark.parametrize(
    ("cls", "names"),
    [
        (fop.CheckpointManager, ("save", "restore", "wait", "delete", "step_parts", "gc")),
        (fop.CheckpointManager, ("close", "leave", "wrap_step", "reserve", "__init__")),
        (fop.CheckpointManager, ("__enter__", "__exit__", "steps", "latest_step")),
        (fop.CheckpointCallback, ("__init__", "on_train_start", "on_step_end", "close")),
        (fop.SaveHandle, ("__init__", "wait", "cancel", "done")),
    ],
)
def test_each_public_method_passes_one_entry(cls, names):
    for name in names:
        method = inspect.getattr_static(cls, name)
        assert len(_entries(method)) == 1, f"{cls.__name__}.{name}"
        inner = inspect.unwrap(method)
        assert inner.__code__.co_filename != _distributed.__file__
        assert not hasattr(_distributed, "collective_method")
