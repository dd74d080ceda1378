"""The library never raises its own DeprecationWarning from inside (issue 51 item 11).

``fop.restore`` of an Orbax checkpoint called ``restore_orbax(allow_cast=...)``, the
deprecated spelling, and so warned at the user's line (with ``cast="safe"`` too): under
``-W error`` the README's Orbax line failed. Every reading entry point over each
foreign format runs here with the library's DeprecationWarnings as errors.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import orbax.checkpoint as ocp
import pytest

import flax_orbax_plugin as fop

# The library's own deprecation texts (_like.onto_like.legacy_cast, _manager.options,
# _manager.checkpointables): none may come from a call that did not spell them.
_OWN = re.compile(r"is deprecated: write|deprecated, and gone in the next|are deprecated; take")


def _params():
    return {"dense": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}}


@pytest.fixture
def orbax_item(tmp_path):
    path = tmp_path / "orbax" / "params"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, _params())
    return path


@pytest.mark.parametrize("cast", [None, "safe", "unsafe"])
def test_restoring_an_orbax_checkpoint_warns_no_deprecation(orbax_item, cast):
    options = {} if cast is None else {"cast": cast}
    like = {"dense": {"kernel": np.zeros((2, 3), np.float16 if cast == "unsafe" else np.float32)}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fop.restore(orbax_item, like, **options)
        plain = fop.restore(orbax_item, **options)
        served = fop.restore_params(orbax_item, like=like, **options)
    ours = [str(w.message) for w in caught if _OWN.search(str(w.message))]
    assert ours == []
    for tree in (got, plain, served):
        np.testing.assert_array_equal(tree["dense"]["kernel"], _params()["dense"]["kernel"])


def test_the_deprecated_spelling_still_warns_when_the_user_writes_it(orbax_item):
    with pytest.warns(DeprecationWarning, match=r"restore_orbax\(allow_cast=False\)"):
        fop.restore_orbax(orbax_item, allow_cast=False)
