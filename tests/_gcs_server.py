"""A GCS emulator (PyPI ``gcp-storage-emulator``) on 127.0.0.1 that tensorstore's ``gcs``
kvstore driver can talk to.

How tensorstore 0.1.86 is pointed at it (checked):

* ``TENSORSTORE_GCS_HTTP_URL=http://127.0.0.1:PORT`` in the environment. It is read
  each time a gcs kvstore is opened (not cached per process), so it can be set late.
* ``GOOGLE_AUTH_TOKEN_FOR_TESTING=<anything>`` skips the credential search (without
  it tensorstore logs that no gcloud credentials exist and goes on unauthenticated,
  which the emulator accepts too).
* Leave ``TENSORSTORE_GCS_HTTP_VERSION`` unset (or "1"): with "2" curl expects HTTP/2
  prior knowledge, the emulator speaks HTTP/1.0, and every request fails with
  ``CURLE_HTTP2 Remote peer returned unexpected data while we expected SETTINGS
  frame`` and is retried until the caller gives up.
* Both the spec ``{"driver": "gcs", "bucket": B, "path": "prefix/"}`` and the URL
  ``gs://B/prefix/`` work (unlike s3, the endpoint comes from the environment).
* KvStore write/read/list/delete_range and zarr3 with the crc32c codec work.
* Quirk: the emulator ignores ``ifGenerationMatch=0``, so a create-if-absent
  conditional write (``if_equal=<missing generation>``) succeeds even when the
  object exists. Real GCS honours it. Do not test conditional-write semantics here.
* The emulator serves one request at a time (``http.server.HTTPServer``).
"""

from __future__ import annotations

import logging
import time

from _s3_server import (
    ObjectStoreLocation,
    _apply_env,
    _wait_listening,
    free_port,
    unique_bucket_name,
)


def available() -> bool:
    try:
        import gcp_storage_emulator.server  # noqa: F401
    except ImportError:
        return False
    return True


class GCSServer:
    """gcp-storage-emulator in a thread of this process, in memory."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self._server = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict:
        return {
            "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        }

    def start(self, timeout: float = 30.0) -> GCSServer:
        from gcp_storage_emulator.server import create_server

        logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
        self._server = create_server("127.0.0.1", self.port, in_memory=True)
        self._server.start()
        _wait_listening(self.port, timeout)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> GCSServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def create_bucket(self, name: str | None = None) -> str:
        import json
        import urllib.request

        name = name or unique_bucket_name()
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            if resp.status != 200:
                raise RuntimeError(f"creating bucket {name}: HTTP {resp.status}")
        return name

    def location(self, bucket: str, prefix: str = "") -> ObjectStoreLocation:
        return ObjectStoreLocation("gs", bucket, prefix.strip("/"), self.endpoint, self.env)

    def apply_env(self):
        return _apply_env(self.env)


if __name__ == "__main__":
    with GCSServer() as srv:
        b = srv.create_bucket("scratch")
        print("endpoint", srv.endpoint, "bucket", b, flush=True)
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
