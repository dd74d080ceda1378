"""fop.import_orbax / fop.import_msgpack check their options by their declarations
before the source is read or the output made (issue 32)."""

from __future__ import annotations

import re

import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format.steps import MAX_STEP


@pytest.mark.parametrize("entry", ["import_orbax", "import_msgpack"])
@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"step": "7"}, f"step must be an int step in [0, {MAX_STEP}] or None, found str '7'"),
        ({"step": -1}, f"step must be an int step in [0, {MAX_STEP}] or None, found int -1"),
        ({"force": "yes"}, "force must be True or False, found str 'yes'"),  # was: taken
        ({"format_version": 3}, "format_version must be one of 1, 2 or None, found int 3"),
    ],
)
def test_an_importer_refuses_a_hostile_option_before_reading(tmp_path, entry, kwargs, words):
    with pytest.raises(fop.OptionError, match="^" + re.escape(words)):
        getattr(fop, entry)(tmp_path / "no_source", tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()
