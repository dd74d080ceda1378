"""Each host its own local directory (a manager with ``persistent=``): every process
writes all it holds, commits its own copy, the bucket gets the hosts' parts once, and
restore reads each host's own files (way a) or the bucket (way c). Real processes,
separate directories, a shared directory as the persistent tier."""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._format.layout import MANIFEST_FILE

HERE = os.path.dirname(os.path.abspath(__file__))  # this module, for child processes
WAIT_S = 60


class _Ways(logging.Handler):
    """The restore ways the manager logged."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.ways: list[str] = []
        self.all: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        self.all.append(text)
        for way in ("(way a)", "(way c)"):
            if way in text:
                self.ways.append(way[1:-1])


def _files(directory: str, step: int) -> list[str]:
    root = os.path.join(directory, str(step))
    found = (os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    return sorted(os.path.relpath(p, root) for p in found)


def _wipe(directory: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _restore(ctx, local, url, like):
    """Opens a manager on this host's directory, restores, returns (values, way, step)."""
    import jax

    ways = _Ways()
    logger = logging.getLogger("flax_orbax_plugin")
    logger.addHandler(ways)
    logger.setLevel(logging.INFO)
    try:
        with fop.CheckpointManager(local, persistent=url) as mngr:
            got = mngr.restore(like=like)
            step = mngr.restored_step
    finally:
        logger.removeHandler(ways)
    mine = {}
    for item, leaves in got.items():
        for k, v in leaves.items():  # this process's shards, compared by the test
            shards = sorted(v.addressable_shards, key=lambda s: s.device.id)
            mine[f"{item}/{k}"] = [np.asarray(s.data).tolist() for s in shards]
            assert v.sharding == like[item][k].sharding
    jax.block_until_ready(got)
    return {"values": mine, "ways": ways.ways, "step": step}


def _expected(ctx, step, like):
    import _mp_workers as W

    state = W.make_state(ctx, step)
    out = {}
    for item, leaves in state.items():
        for k, v in leaves.items():
            host = np.asarray(jax_gather(v))
            shards = sorted(like[item][k].addressable_shards, key=lambda s: s.device.id)
            out[f"{item}/{k}"] = [host[s.index].tolist() for s in shards]
    return out


def jax_gather(v):
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(v, tiled=True)


def per_host_run(ctx, base, url):
    """Every case in one job of 2 processes, each on ``base/host<i>``."""
    import _mp_workers as W
    import jax
    from jax.sharding import Mesh, NamedSharding

    local = os.path.join(base, f"host{ctx.process_id}")
    out = {}
    with fop.CheckpointManager(local, keep=2, persistent=url) as mngr:
        out["per_host"] = mngr._book.per_host
        for step in (1, 2, 3):
            mngr.save(step, W.make_state(ctx, step), extras={"step": step})
        mngr.wait()
        out["replicated"] = mngr.persistent.wait(WAIT_S)
        out["shares"] = {str(k): v for k, v in mngr.persistent.copied_files.items()}
    out["local_steps"] = sorted(int(n) for n in os.listdir(local) if n.isdigit())
    out["files"] = _files(local, 3)
    like = W.make_state(ctx, 0)
    want = _expected(ctx, 3, like)
    # (a) every host holds step 3: each reads its own files.
    r = _restore(ctx, local, url, like)
    out["a"] = {"ways": r["ways"], "step": r["step"], "exact": r["values"] == want}
    # One host's directory wiped (a replaced host): every host reads the bucket's step.
    ctx.client.wait_at_barrier("wiped-one", 30_000)
    if ctx.process_id == 1:
        _wipe(local)
    ctx.client.wait_at_barrier("wiped-one-done", 30_000)
    r = _restore(ctx, local, url, like)
    out["one_wiped"] = {"ways": r["ways"], "step": r["step"], "exact": r["values"] == want}
    # The copy down was committed with each host's marker: the next restore reads there.
    r = _restore(ctx, local, url, like)
    out["after_c"] = {"ways": r["ways"], "step": r["step"], "exact": r["values"] == want}
    # A changed mesh (devices in reverse order): host copies do not hold the new
    # shards; the bucket's step, resharded.
    mesh = Mesh(np.array(ctx.devices[::-1]), ctx.mesh.axis_names)
    like2 = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, a.sharding.spec)), like)
    # Make every host hold its own copy again (way a would be possible on the old mesh).
    with fop.CheckpointManager(local, keep=2, persistent=url) as mngr:
        mngr.save(4, W.make_state(ctx, 4), extras={"step": 4})
        mngr.wait()
        assert mngr.persistent.wait(WAIT_S)
    r = _restore(ctx, local, url, like2)
    want4 = _expected(ctx, 4, like2)
    out["mesh"] = {"ways": r["ways"], "step": r["step"], "exact": r["values"] == want4}
    # Every directory wiped: the bucket.
    ctx.client.wait_at_barrier("wiped-all", 30_000)
    _wipe(local)
    r = _restore(ctx, local, url, like)
    out["all_wiped"] = {
        "ways": r["ways"],
        "step": r["step"],
        "exact": r["values"] == _expected(ctx, 4, like),
    }
    return out


@pytest.mark.distributed
def test_per_host_directories_save_replicate_and_restore_by_way(tmp_path):
    from _multiprocess import run_processes

    base, url = str(tmp_path / "hosts"), str(tmp_path / "bucket")
    run = run_processes(
        "test_per_host:per_host_run",
        2,
        devices_per_process=2,
        args={"base": base, "url": url},
        env={"FOP_COORDINATION_TIMEOUT_S": "20", "PYTHONPATH": HERE},
        heartbeat_timeout_s=30,
        timeout_s=150,
    ).check()
    r0, r1 = run[0].result, run[1].result
    for r in (r0, r1):
        assert r["per_host"] and r["replicated"]
        assert r["local_steps"] == [2, 3]
        assert "_HOST.json" in r["files"] and MANIFEST_FILE in r["files"]
        assert r["a"] == {"ways": ["way a"], "step": 3, "exact": True}
        assert r["one_wiped"] == {"ways": ["way c"], "step": 3, "exact": True}
        assert r["after_c"] == {"ways": ["way a"], "step": 3, "exact": True}
        assert r["mesh"] == {"ways": ["way c"], "step": 4, "exact": True}
        assert r["all_wiped"] == {"ways": ["way c"], "step": 4, "exact": True}
    # Each host holds its own shards (not the other's) and the replicated leaves.
    assert r0["files"] != r1["files"]
    # The bucket holds each file once: the hosts' shares are disjoint.
    shares = [set(r0["shares"]["3"]), set(r1["shares"]["3"])]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    with fop.CheckpointManager(url, read_only=True) as reader:
        assert reader.steps()[-1] == 4
        assert reader.restore(step=3, items="extras") == {"step": 3}
