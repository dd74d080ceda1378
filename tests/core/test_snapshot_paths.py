"""The blocking phase's ways to snapshot (issue 26): the device path (pinned_host
staging, streaming under a host memory budget) exercised on CPU through
``_device_copy.CPU_AS_DEVICE``, CPU arrays under a budget, direct I/O and the
background threads' priority."""

from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_orbax_plugin as fop
from flax_orbax_plugin._base import env as _env
from flax_orbax_plugin._core import device_copy as _device_copy
from flax_orbax_plugin._core import host_snapshot as _host_snapshot
from flax_orbax_plugin._zarr import packed_writer as _chunk_writer
from flax_orbax_plugin._zarr import packed_writer as _packed_writer


def _state(devices, v: float):
    mesh = Mesh(np.array(devices).reshape(4, 2), ("x", "y"))
    w = np.arange(512 * 2048, dtype=np.float32).reshape(512, 2048) + v  # 4 MiB
    r = np.arange(2048 * 1024, dtype=np.float32).reshape(2048, 1024) - v  # 8 MiB: 2 chunks
    return {
        "w": jax.device_put(w, NamedSharding(mesh, P("x", "y"))),  # 8 shards of 512 KiB
        "r": jax.device_put(r, NamedSharding(mesh, P())),  # replicated
        "b": jax.device_put(jnp.full((8,), v)),  # small: batched
        "n": np.full((1024, 1024), v, np.float32),  # numpy, 4 MiB: an array of its own
    }


_donate = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x * 0 - 7, s), donate_argnums=0)


@pytest.fixture
def device_path(monkeypatch):
    """CPU arrays take the accelerator path; records every device snapshot, every region
    it starts and every one it materializes (their sizes), calling the real functions."""
    monkeypatch.setattr(_device_copy, "CPU_AS_DEVICE", True)
    seen = {"started": [], "materialized": [], "snapshots": [], "fetched": []}
    start, materialize = _device_copy.start, _host_snapshot.materialize
    snapshot, fetch = _device_copy.snapshot, _device_copy.fetch

    def spy_start(data, part, *, kind):
        out = start(data, part, kind=kind)
        seen["started"].append((kind, out.array.sharding.memory_kind, out.nbytes))
        return out

    def spy_materialize(data):
        if isinstance(data, _device_copy.Deferred):
            seen["materialized"].append(data.nbytes)
        return materialize(data)

    def spy_snapshot(arrays):
        copies, why = snapshot(arrays)
        seen["snapshots"].append((len(arrays), copies is not None, why))
        return copies, why

    def spy_fetch(data, part):
        seen["fetched"].append(threading.current_thread() is threading.main_thread())
        return fetch(data, part)

    monkeypatch.setattr(_device_copy, "start", spy_start)
    monkeypatch.setattr(_host_snapshot, "materialize", spy_materialize)
    monkeypatch.setattr(_device_copy, "snapshot", spy_snapshot)
    monkeypatch.setattr(_device_copy, "fetch", spy_fetch)
    return seen


def _expected(state):
    return jax.tree_util.tree_map(np.array, state)


def test_the_device_staging_copies_on_the_device_and_fetches_in_the_background(
    tmp_path, devices, device_path
):
    state = _state(devices, 1.0)
    expected = _expected(state)
    handle = fop.save_async(tmp_path / "ck", state)
    junk = _donate({"w": state["w"], "r": state["r"]})  # the next step, at once
    jax.block_until_ready(junk)
    assert state["w"].is_deleted()  # donated: the save holds copies of its own
    state["n"][:] = -1  # the caller's numpy array changed after save_async returned
    handle.wait()
    assert device_path["snapshots"] == [(2, True, "")]  # w and r (b is small): one copy
    assert not device_path["started"]  # nothing staged to host while blocking
    fetched = device_path["fetched"]
    assert fetched and not any(fetched)  # every region fetched off the saving thread
    got = fop.restore(tmp_path / "ck", expected)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, expected)


def test_device_fetch_brings_a_large_region_over_in_pieces(monkeypatch):
    monkeypatch.setattr(_device_copy, "FETCH_PIECE", 4096)
    x = jnp.arange(100 * 37, dtype=jnp.float32).reshape(100, 37)
    seen = []
    real = np.asarray

    def counting(a, *args, **kw):
        if isinstance(a, jax.Array):
            seen.append(a.shape)
        return real(a, *args, **kw)

    monkeypatch.setattr(_device_copy.np, "asarray", counting)
    got = _device_copy.fetch(x, (slice(3, 90), slice(None)))
    np.testing.assert_array_equal(got, real(x)[3:90])
    assert len(seen) > 1 and all(s[0] * 37 * 4 <= 4096 for s in seen)  # pieces of rows


@pytest.mark.parametrize("kind", ["pinned", "host"])
def test_the_other_stagings_copy_before_returning_and_survive_donation(
    tmp_path, devices, device_path, monkeypatch, kind
):
    monkeypatch.setattr(_device_copy, "staging_for", lambda platform: kind)
    state = _state(devices, 1.0)
    expected = _expected(state)
    handle = fop.save_async(tmp_path / "ck", state)
    jax.block_until_ready(_donate({"w": state["w"], "r": state["r"]}))
    handle.wait()
    started = device_path["started"]
    memory = "pinned_host" if kind == "pinned" else "device"
    assert started and {(k, m) for k, m, _ in started} == {(kind, memory)}
    got = fop.restore(tmp_path / "ck", expected)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, expected)


def test_short_device_memory_falls_back_to_host_and_the_event_says_why(
    tmp_path, devices, device_path, monkeypatch
):
    monkeypatch.setattr(_device_copy, "free_bytes", lambda device: 1024)
    state = _state(devices, 3.0)
    expected = _expected(state)
    events = []
    with fop.CheckpointManager(tmp_path / "run", on_event=events.append) as mngr:
        mngr.save(1, {"params": state})
        jax.block_until_ready(_donate({"w": state["w"], "r": state["r"]}))
        mngr.wait()
        got = mngr.restore(step=1)["params"]
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, expected)
    assert device_path["snapshots"] and not device_path["snapshots"][0][1]
    blocking = [e for e in events if type(e).__name__ == "SaveBlockingDone"]
    assert blocking[0].staging.startswith("host (device memory short")


@pytest.mark.parametrize("version", [1, 2])
def test_a_budget_streams_device_regions_in_pieces(tmp_path, devices, device_path, version):
    budget = 16 << 20  # pieces of at most 4 MiB: the replicated 8 MiB array in two
    state = _state(devices, 2.0)
    expected = _expected(state)
    run = tmp_path / "run"
    with fop.CheckpointManager(run, host_memory_budget=budget, format_version=version) as mngr:
        mngr.save(1, {"params": state})
        jax.block_until_ready(_donate({"w": state["w"], "r": state["r"]}))  # the next step
        assert state["w"].is_deleted()  # donated: the save holds copies of its own
        mngr.wait()
        got = mngr.restore(step=1)["params"]
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, expected)
    started = device_path["started"]
    assert started and all(kind == "streamed" for kind, _, _ in started)
    assert all(k == "device" for _, k, _ in started)  # nothing copied to host while blocking
    pieces = device_path["materialized"]
    assert sum(pieces) == 4 * 512 * 2048 + 4 * 2048 * 1024  # every region went through it
    assert max(pieces) <= budget // 4  # each copied on its own, a quarter of the budget
    assert len(pieces) == 8 + 2  # w's 8 shards; r cut in two


@pytest.mark.parametrize("version", [1, 2])
def test_cpu_arrays_under_a_budget_are_written_before_the_save_returns(
    tmp_path, devices, monkeypatch, version
):
    state = _state(devices, 3.0)
    expected = _expected(state)
    writer = _chunk_writer.ChunkFileWriter if version == 1 else _packed_writer.PackedWriter
    real = writer._write_file

    def slow(self, name, pieces):  # every file written late: a save that returned
        time.sleep(0.05)  # before its writes would see the changes below
        return real(self, name, pieces)

    monkeypatch.setattr(writer, "_write_file", slow)
    handle = fop.save_async(
        tmp_path / "ck", state, host_memory_budget=1 << 20, format_version=version
    )
    state["n"][:] = -1  # the views' memory changed right after the return
    for k in ("w", "r"):
        state[k].delete()
    handle.wait()
    got = fop.restore(tmp_path / "ck", expected)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, expected)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1G", 2**63])  # 2**63: as memory_limit_bytes
def test_a_bad_budget_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="host_memory_budget"):
        fop.save(tmp_path / "ck", {"w": np.zeros(4)}, host_memory_budget=bad)
    with pytest.raises(ValueError, match="host_memory_budget"):
        fop.CheckpointManager(tmp_path / "run", host_memory_budget=bad)


def _chunk_bytes(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if "/c/" in f"/{rel}":
                with open(os.path.join(dirpath, f), "rb") as fh:
                    out[rel] = fh.read()
    return out


def test_direct_io_writes_the_same_bytes_as_buffered_writes(tmp_path, devices, monkeypatch):
    state = _state(devices, 4.0)
    direct = []
    real = _chunk_writer.ChunkFileWriter._write_direct

    def spy(self, fd, first):
        done = real(self, fd, first)
        direct.append(done)
        return done

    monkeypatch.setattr(_chunk_writer.ChunkFileWriter, "_write_direct", spy)
    with fop.CheckpointManager(
        tmp_path / "a", format_version=1
    ) as mngr:  # pooled, page-aligned buffers
        mngr.save(1, {"params": state})
    assert any(direct), "no chunk was written with O_DIRECT"
    monkeypatch.setenv("FOP_DIRECT_IO", "0")
    direct.clear()
    with fop.CheckpointManager(tmp_path / "b", format_version=1) as mngr:
        mngr.save(1, {"params": state})
    assert not direct
    a, b = _chunk_bytes(tmp_path / "a" / "1"), _chunk_bytes(tmp_path / "b" / "1")
    assert a and a == b
    got = fop.CheckpointManager(tmp_path / "a", read_only=True).restore(step=1)["params"]
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, _expected(state))


def test_bulk_threads_run_below_the_training_threads(tmp_path, devices, monkeypatch):
    niceness = {}
    real = _env.lower

    def spy():
        real()
        niceness[threading.current_thread().name] = os.getpriority(
            os.PRIO_PROCESS, threading.get_native_id()
        )

    monkeypatch.setattr(_env, "lower", spy)
    fop.save(tmp_path / "ck1", _state(devices, 5.0))  # default: the process's priority
    assert niceness and all(v == 0 for v in niceness.values()), niceness
    niceness.clear()
    monkeypatch.setenv("FOP_BACKGROUND_NICE", "10")
    fop.save(tmp_path / "ck", _state(devices, 5.0))
    assert niceness and all(v == 10 for v in niceness.values()), niceness
    assert all(name.startswith("fop-chunk") for name in niceness)  # the commit's: not lowered
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 10  # caller's own


@pytest.mark.parametrize("views", [False, True], ids=["pooled", "zero-copy views"])
def test_version_2_data_files_take_direct_writes_at_page_boundaries(
    tmp_path, devices, monkeypatch, views
):
    """Pooled buffers start on a page; zero-copy views of jax buffers start a few cache
    lines past one: their segments are placed at a file offset congruent to their
    address, so the pages after the first boundary are still written directly."""
    from flax_orbax_plugin._zarr import packed_writer as _packed_writer

    state = _state(devices, 6.0)
    direct = []
    real = _packed_writer.PackedWriter._write_direct_at

    def spy(self, file, view, offset):
        done = real(self, file, view, offset)
        address = np.frombuffer(view, np.uint8).ctypes.data
        direct.append((done, offset % 4096, address % 4096, len(view) % 4096))
        return done

    monkeypatch.setattr(_packed_writer.PackedWriter, "_write_direct_at", spy)
    skips = []
    real_span = _packed_writer.direct_span

    def span_spy(first, minimum=4096):
        skip, length = real_span(first, minimum)
        skips.append(skip)
        return skip, length

    monkeypatch.setattr(_packed_writer, "direct_span", span_spy)
    options = {"reuse_host_buffers": False} if views else {}
    with fop.CheckpointManager(tmp_path / "run", format_version=2, **options) as mngr:
        mngr.save(1, {"params": state})
        mngr.wait()
        got = mngr.restore(step=1)["params"]
    assert direct and all(d == (True, 0, 0, 0) for d in direct), direct
    if views:  # jax's buffers start past a page boundary: skipped, then direct
        assert any(skips), skips
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, _expected(state))
    assert all(r.ok for r in fop.verify(tmp_path / "run"))
