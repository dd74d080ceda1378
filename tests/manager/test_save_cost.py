"""A manager save costs the same requests whatever the number of steps kept (issue 23).

A writer keeps its committed steps in memory (listed once, at its first need): the
save of a new step then lists nothing per step and reads no manifest. Counted on a
real S3 server (moto, in this process) by kind of request (``tests/support/_s3_requests.py``):
the second save of a manager opened on a directory holding 2 steps and one holding
200 cost exactly the same LIST, GET, HEAD, PUT and DELETE requests. The 198 extra
steps are planted as manifests of a real step (renumbered), so the test takes no 200
saves; it fails on the code before the change (GET 3 against 201 per save).
"""

import dataclasses

import numpy as np
from _s3_requests import S3Requests

import flax_orbax_plugin as fop
from flax_orbax_plugin._format import layout as _layout
from flax_orbax_plugin._format import steps as _steps
from flax_orbax_plugin._format.layout import MANIFEST_FILE
from flax_orbax_plugin._storage.location import Location

pytest_plugins = ["_servers"]

STATE = {"params": {"w": np.arange(64, dtype=np.float32), "b": np.ones(8, np.float32)}}


def _plant_manifests(where, source: int, steps) -> None:
    """Steps ``steps`` as the manifest of committed step ``source`` with their own step
    number (the listing and the step check look at nothing else), written at once."""
    manifest = _layout.read_manifest(_steps.step_location(Location.from_path(where.url), source))
    kv = where.kvstore()
    futures = [
        kv.write(f"{s}/{MANIFEST_FILE}", dataclasses.replace(manifest, step=s).to_bytes())
        for s in steps
    ]
    for f in futures:
        f.result()


def _second_save_requests(url, first: int) -> dict:
    mngr = fop.CheckpointManager(url, keep=None, async_save=False)
    with S3Requests() as counter:
        mngr.save(first, STATE)  # the first need lists the steps: once per manager
        counter.take()
        mngr.save(first + 1, STATE)
        counted = counter.take()
    assert mngr.steps() == list(range(1, first + 2))  # the planted steps were listed
    mngr.close()
    return counted


def test_requests_per_save_do_not_grow_with_the_steps_kept(s3_server):
    few, many = (s3_server.location(s3_server.create_bucket(), "ckpt") for _ in range(2))
    for where in (few, many):
        with fop.CheckpointManager(where.url, keep=None) as mngr:
            mngr.save(1, STATE)
            mngr.save(2, STATE)
    _plant_manifests(many, 2, range(3, 201))
    with_2 = _second_save_requests(few.url, 3)
    with_200 = _second_save_requests(many.url, 201)
    assert with_2 == with_200
    assert with_2.get("GET", 0) == 0  # no manifest read per save
    assert with_2["PUT"] >= 3  # it did save: data, metadata, the manifest


def test_listing_the_steps_costs_one_listing_whatever_the_steps_kept(s3_server):
    """``steps()`` read each step's manifest (one GET per step: 53 ms at 2 steps, over a
    second at 60); now one listing of the keys says which steps are committed."""
    few, many = (s3_server.location(s3_server.create_bucket(), "ckpt") for _ in range(2))
    for where in (few, many):
        with fop.CheckpointManager(where.url, keep=None) as mngr:
            mngr.save(1, STATE)
            mngr.save(2, STATE)
    _plant_manifests(many, 2, range(3, 61))
    counts = {}
    for where, steps in ((few, [1, 2]), (many, list(range(1, 61)))):
        with fop.CheckpointManager(where.url, read_only=True) as reader, S3Requests() as counter:
            assert reader.steps() == steps and reader.all_steps() == steps
            assert reader.latest_step() == steps[-1]
            counts[len(steps)] = counter.take()
    assert counts[2] == counts[60], counts
    assert counts[2].get("GET", 0) == 0 and counts[2].get("HEAD", 0) == 0, counts
