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

    assert probe("x", limit=2) == ("x", None, 2)  # one process: no region drawn
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
