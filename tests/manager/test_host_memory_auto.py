"""The host-memory ceiling that adapts (issue 53 item 2): ``host_memory="auto"`` is
half the memory free when a save starts, the smaller of the kernel's MemAvailable and
the cgroup's limit less its usage, and the figure is in the save's SaveStarted event
(with whether the save streamed under it); a save whose ceiling is below one row of a
leaf is refused, naming the leaf and both figures, before anything is written.

The readings are made controllable by pointing the module's readers at files of the
test's own (the /proc/meminfo line and the cgroup files are read as on a real host)."""

from __future__ import annotations

import os

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import host_memory as _host_memory
from flax_orbax_plugin._errors import OptionError
from flax_orbax_plugin._manager.events import SaveStarted

ROW = 1024 * 8  # one row of "w": 1024 float64 values


def state():
    return {"params": {"w": np.arange(64 * 1024, dtype=np.float64).reshape(64, 1024)}}


@pytest.fixture
def memory(tmp_path, monkeypatch):
    """Sets what the host says is free: ``memory(available=..., limit=..., usage=...)``
    writes a meminfo file and cgroup v2 files that the module reads instead of /proc and
    /sys (None: that reading is absent)."""
    meminfo = tmp_path / "meminfo"
    cg_max, cg_current = tmp_path / "memory.max", tmp_path / "memory.current"
    real_open = open

    def reader():
        try:
            with real_open(meminfo) as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    monkeypatch.setattr(_host_memory, "_meminfo_available", reader)
    monkeypatch.setattr(_host_memory, "_CGROUP_V2", (str(cg_max), str(cg_current)))
    monkeypatch.setattr(_host_memory, "_CGROUP_V1", (str(tmp_path / "no1"), str(tmp_path / "no2")))

    def set_memory(*, available=None, limit=None, usage=None):
        for path, text in (
            (meminfo, None if available is None else f"MemAvailable:   {available // 1024} kB\n"),
            (cg_max, None if limit is None else f"{limit}\n"),
            (cg_current, None if usage is None else f"{usage}\n"),
        ):
            if text is None:
                path.unlink(missing_ok=True)
            else:
                path.write_text("MemTotal: 1 kB\n" + text if path == meminfo else text)

    return set_memory


def test_available_is_the_smaller_of_meminfo_and_the_cgroup(memory):
    memory(available=8 << 30, limit=3 << 30, usage=1 << 30)
    assert _host_memory.available_bytes() == 2 << 30
    assert _host_memory.resolve("auto") == 1 << 30  # AUTO_FRACTION of it
    memory(available=1 << 30, limit=3 << 30, usage=1 << 30)
    assert _host_memory.available_bytes() == 1 << 30
    memory(available=1 << 30)  # no cgroup files: MemAvailable alone
    assert _host_memory.available_bytes() == 1 << 30
    memory(available=None)  # nothing readable: no bound
    assert _host_memory.available_bytes() is None and _host_memory.resolve("auto") is None


def saves(directory, **options):
    events = []
    with fop.CheckpointManager(directory, on_event=events.append, **options) as m:
        m.save(1, state())
        m.wait()
        restored = m.restore(like=None)
    return [e for e in events if isinstance(e, SaveStarted)], restored


def test_auto_figure_is_in_the_save_event_and_not_streamed_when_the_state_fits(tmp_path, memory):
    memory(available=64 << 30, limit=(1 << 30) + (1 << 20), usage=1 << 20)
    started, restored = saves(tmp_path / "run")
    assert [(e.step, e.host_memory, e.streamed) for e in started] == [(1, 1 << 29, False)]
    np.testing.assert_array_equal(restored["params"]["w"], state()["params"]["w"])


def test_auto_streams_when_the_state_does_not_fit_the_memory_free(tmp_path, memory):
    # 512 KiB of state, 96 KiB free (cgroup): "auto" allows 48 KiB, and the save streams.
    memory(available=64 << 30, limit=(200 << 10), usage=(104 << 10))
    started, restored = saves(tmp_path / "run")
    assert [(e.host_memory, e.streamed) for e in started] == [(48 << 10, True)]
    np.testing.assert_array_equal(restored["params"]["w"], state()["params"]["w"])


def test_auto_follows_the_memory_free_at_each_save(tmp_path, memory):
    events = []
    with fop.CheckpointManager(tmp_path / "run", on_event=events.append) as m:
        memory(available=4 << 30)
        m.save(1, state())
        m.wait()
        memory(available=256 << 10)
        m.save(2, state())
        m.wait()
    started = [(e.step, e.host_memory, e.streamed) for e in events if isinstance(e, SaveStarted)]
    assert started == [(1, 2 << 30, False), (2, 128 << 10, True)]


def nothing_written(directory) -> bool:
    return [n for n in os.listdir(directory) if not n.startswith(".")] == []


def test_a_ceiling_below_a_row_is_refused_before_writing(tmp_path, memory):
    memory(available=64 << 30)
    run = tmp_path / "run"
    with fop.CheckpointManager(run, host_memory=ROW - 1) as m:
        with pytest.raises(OptionError) as e:
            m.save(1, state())
        assert m.all_steps() == []
    text = str(e.value)
    assert f"host_memory={ROW - 1}" in text and f"{ROW - 1} bytes" in text
    assert "'params/w'" in text or "params/w" in text
    assert f"holds {ROW} bytes" in text and "nothing was written" in text
    assert nothing_written(run)


def test_auto_below_a_row_is_refused_before_writing_with_the_figure(tmp_path, memory):
    memory(available=64 << 30, limit=(1 << 20) + ROW, usage=1 << 20)  # ROW free: ROW/2 allowed
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as m:
        with pytest.raises(OptionError) as e:
            m.save(1, state())
    text = str(e.value)
    assert "host_memory='auto'" in text and f"ceiling of {ROW // 2} bytes" in text
    assert f"holds {ROW} bytes" in text
    assert nothing_written(run)
