"""restore_params says which step it served (an INFO line): a serving loop that also
asks latest_step() while a writer commits could otherwise report another step."""

from __future__ import annotations

import logging

import numpy as np

import flax_orbax_plugin as fop


def test_restore_params_logs_the_step_it_served(tmp_path, caplog):
    with fop.CheckpointManager(tmp_path, async_save=False) as m:
        for step in (3, 8):
            m.save(step, {"params": {"w": np.full(2, step, np.float32)}})
    with caplog.at_level(logging.INFO, logger="flax_orbax_plugin"):
        got = fop.restore_params(tmp_path)
        fop.restore_params(tmp_path, step=3)
    assert got["w"][0] == 8
    assert f"restore_params: step 8 of {tmp_path}" in caplog.text
    assert f"restore_params: step 3 of {tmp_path}" in caplog.text
