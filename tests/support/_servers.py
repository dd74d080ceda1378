"""Pytest plugin: object-store servers on 127.0.0.1.

Load it from ``tests/conftest.py`` with::

    pytest_plugins = ["_servers"]

(or per test module, the same line). Fixtures:

* ``s3_server`` (session): a moto S3 server in a thread; while it runs, this
  process's environment has AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_REGION and
  AWS_ENDPOINT_URL pointing at it (child processes inherit them).
* ``s3_location`` (function): an ``ObjectStoreLocation`` in a fresh bucket:
  ``.spec`` (a working tensorstore kvstore spec dict), ``.url`` (``s3://bucket/ckpt``),
  ``.keys()``, ``.read(key)``, ``.delete(key)``, ``.join(sub)``, ``.env``.
* ``gcs_server`` / ``gcs_location``: the same over gcp-storage-emulator; skipped
  when that package is not installed. ``.url`` (``gs://bucket/ckpt``) works as is.
"""

from __future__ import annotations

import pytest
from _gcs_server import GCSServer
from _gcs_server import available as gcs_available
from _s3_server import S3Server


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server(mode="thread").start()
    undo = server.apply_env()
    try:
        yield server
    finally:
        undo()
        server.stop()


@pytest.fixture
def s3_location(s3_server):
    bucket = s3_server.create_bucket()
    return s3_server.location(bucket, "ckpt")


@pytest.fixture(scope="session")
def gcs_server():
    if not gcs_available():
        pytest.skip("gcp-storage-emulator is not installed (pip install gcp-storage-emulator)")
    server = GCSServer().start()
    undo = server.apply_env()
    try:
        yield server
    finally:
        undo()
        server.stop()


@pytest.fixture
def gcs_location(gcs_server):
    bucket = gcs_server.create_bucket()
    return gcs_server.location(bucket, "ckpt")
