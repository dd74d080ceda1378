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
* The emulator serves one request at a time (``http.server.HTTPServer``), and with
  http.server's listen backlog of 5 the connections past it were dropped and retried
  by curl a second later. Patched here: a backlog of 1024.

Where gcp-storage-emulator 2026.7.19 differs from GCS, and what this module does:

* Object listing ignores ``startOffset``/``endOffset``. tensorstore lists a key
  range as "prefix = the kvstore path, plus those offsets" and does not filter the
  answer, so ``KvStore.list(range)`` returns every key under the path and
  ``delete_range(range)`` deletes every key under it (a manager removing one old
  step would remove all of them). Patched here: the listing handler filters by
  the offsets, as GCS does.
* Suffix range reads (``Range: bytes=-N``) are answered with the whole object and
  status 200; tensorstore then fails with "Requested byte range [-N, ?) was ignored
  by server". zarr3 sharded arrays read their shard index that way. Patched here:
  a suffix range is turned into the equivalent ``bytes=<size-N>-``, and the
  object's generation is sent as ``x-goog-generation`` as GCS does (without it a
  ranged read fails with "Malformed StorageGeneration").
* In memory it still re-serialized all of its metadata (every object and soft-deleted
  generation the session ever wrote) on each create and delete, so a session's
  requests got slower the longer it ran. Patched here: in memory that file (which
  only a restart from a data directory reads) is not written.
* The emulator speaks HTTP/1.0, so http.server never answers ``Expect: 100-continue``
  (it does for HTTP/1.1 only), and curl sends that header with every upload over
  1 MiB: each such write waited curl's 1 s for the "100 Continue" before sending its
  body (a 2 MB write: 1.01 s; a test's shards of a few MiB: seconds). Patched here:
  the handler answers it, as GCS does (2 MB: 0.012 s).
* Not patched: ``ifGenerationMatch=0`` is ignored, so a create-if-absent
  conditional write (``if_equal=<missing generation>``) succeeds even when the
  object exists. Real GCS honours it. Do not test conditional-write semantics here.
"""

from __future__ import annotations

import http.server
import importlib.util
import logging
import re
import time
from functools import partial

from _s3_server import (
    ObjectStoreLocation,
    _apply_env,
    _wait_listening,
    free_port,
    unique_bucket_name,
)


def available() -> bool:
    return importlib.util.find_spec("gcp_storage_emulator") is not None


_PATCHED = False


def _patch_emulator() -> None:
    """Makes the emulator honour list offsets and suffix ranges (see the docstring)."""
    global _PATCHED
    if _PATCHED:
        return
    from gcp_storage_emulator import server, storage
    from gcp_storage_emulator.handlers import objects

    original_ls, original_download = objects.ls, objects.download

    def ls(request, response, storage, *args, **kwargs):
        start = (request.query.get("startOffset") or [None])[0]
        end = (request.query.get("endOffset") or [None])[0]
        send = response.json

        def filtered(obj):
            if isinstance(obj, dict) and isinstance(obj.get("items"), list):
                obj = dict(obj)
                obj["items"] = [
                    it
                    for it in obj["items"]
                    if (start is None or it["name"] >= start) and (end is None or it["name"] < end)
                ]
            return send(obj)

        response.json = filtered
        return original_ls(request, response, storage, *args, **kwargs)

    def download(request, response, storage, *args, **kwargs):
        bucket, name = request.params["bucket_name"], request.params["object_id"]
        try:
            size = len(storage.get_file(bucket, name))
            generation = storage.get_file_obj(bucket, name).get("generation")
        except Exception:  # noqa: BLE001 - let the original answer 404
            return original_download(request, response, storage, *args, **kwargs)
        m = re.fullmatch(r"\s*bytes=-(\d+)\s*", request.get_header("range", "") or "")
        if m:
            headers = request._request_handler.headers
            headers.replace_header("Range", f"bytes={max(0, size - int(m[1]))}-")
        if generation is not None:
            # GCS sends the generation with every media download; tensorstore needs it
            # on ranged reads ("Malformed StorageGeneration" without it).
            response["x-goog-generation"] = str(generation)
        return original_download(request, response, storage, *args, **kwargs)

    # In memory, every create and delete re-serialized the whole server's metadata (every
    # object and soft-deleted generation so far) into a ".meta" file that only a restart
    # from a data directory reads back: the cost of a write grew with all the writes of
    # the session before it. Nothing reads it in memory mode, so it is not written.
    original_write_config = storage.Storage._write_config_to_file

    def write_config_to_file(self):
        if not self._use_memory_fs:
            original_write_config(self)

    storage.Storage._write_config_to_file = write_config_to_file

    # One request at a time, and http.server's listen backlog of 5: tensorstore opens a
    # connection per concurrent request, the kernel drops the connections past the
    # backlog, and curl sends them again a second later (90 concurrent reads: 3.3 s
    # instead of 0.03 s). A deeper backlog queues them instead.
    class _HTTPServer(http.server.HTTPServer):
        request_queue_size = 1024

    def run(self):
        self._httpd = _HTTPServer(
            (self._host, self._port), partial(server.RequestHandler, self._storage)
        )
        self.is_running.set()
        self._httpd.serve_forever()

    server.APIThread.run = run

    # curl's "Expect: 100-continue" on an upload over 1 MiB: answered at once (see the
    # docstring); http.server answers it only when the handler speaks HTTP/1.1.
    original_parse = server.RequestHandler.parse_request

    def parse_request(self):
        ok = original_parse(self)
        expect = self.headers.get("Expect", "") if ok else ""
        if expect.lower() == "100-continue" and self.protocol_version < "HTTP/1.1":
            self.send_response_only(100)
            self.end_headers()
        return ok

    server.RequestHandler.parse_request = parse_request

    objects.ls, objects.download = ls, download  # for handlers that call them directly
    for _, methods in server.HANDLERS:
        for method, fn in list(methods.items()):
            if fn is original_ls:
                methods[method] = ls
            elif fn is original_download:
                methods[method] = download
    _PATCHED = True


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
        _patch_emulator()
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
