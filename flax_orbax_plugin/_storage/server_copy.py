"""Server-side copies of objects inside one bucket: the bytes never pass through this host.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.server_copy``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from .location import Location

_GCS_PUBLIC = "https://storage.googleapis.com"
_GCS_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
_HTTP_TIMEOUT_S = 300.0
_POOL = 32  # connections per copier (the number of copies in flight is the caller's)


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """What a store says about one object: its size and tag (S3: the ETag; GCS:
    ``crc32c`` and ``md5Hash``; None where none). ``content_tag``: the tag depends on the
    bytes alone (not so for an S3 ETag of a multipart upload or an SSE-KMS/SSE-C
    object). ``generation`` pins the object in a later copy (S3: its ETag; GCS: its
    generation)."""

    size: int
    tag: str | None = None
    generation: str | None = None
    content_tag: bool = True


class CopyError(OSError):
    """A listing, copy or delete the store refused (or that failed on the way)."""


class Copier:
    """Copies, lists and deletes objects in one bucket; keys are full object keys."""

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every object whose key starts with ``prefix``."""
        raise NotImplementedError

    def copy(self, src: str, dst: str, source: ObjectInfo) -> ObjectInfo:
        """Copies ``src`` to ``dst`` on the server, only if ``src`` is still the object
        ``source`` describes; returns what the store reports for ``dst``."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Deletes one object (no error if it is absent)."""
        raise NotImplementedError

    batch_limit = 0  # keys one batch delete request takes (0: the store has none)

    def delete_batch(self, keys: list[str]) -> None:
        """Deletes up to :attr:`batch_limit` objects in one request (absent ones are no
        error); :class:`CopyError` naming the keys the store refused."""
        raise NotImplementedError

    def read_range(self, key: str, start: int, stop: int, source: ObjectInfo) -> bytes:
        """Bytes ``[start, stop)`` of ``key``, only if it is still the object ``source``
        describes; :class:`CopyError` when the store answers another length."""
        raise NotImplementedError


def copier_for(location: Location) -> tuple[Copier | None, str]:
    """``(copier, "")`` for the bucket of ``location``, or ``(None, why)``."""
    spec = location.spec
    spec.pop("path", None)
    driver = spec.get("driver")
    if driver not in _COPIERS:
        return None, f"the {driver!r} kvstore driver has no server-side copy"
    make, names = _COPIERS[driver]
    return make(json.dumps(spec, sort_keys=True), tuple(os.environ.get(k) for k in names))


# -- S3 -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _s3_copier(spec_json: str, env: tuple) -> tuple[Copier | None, str]:
    del env  # part of the cache key only: credentials may change between tests
    spec = json.loads(spec_json)
    try:
        import botocore.config  # optional: botocore only for S3 server-side copies
        import botocore.session
        from botocore import UNSIGNED
    except ImportError:
        return None, "botocore is not installed (pip install flax_orbax_plugin[s3])"
    creds = spec.get("aws_credentials") or {}
    session = botocore.session.Session(profile=creds.get("profile"))
    anonymous = creds.get("type") == "anonymous"
    try:
        if not anonymous and session.get_credentials() is None:
            return None, "botocore finds no AWS credentials"
        config: dict[str, Any] = {
            "max_pool_connections": _POOL,
            "retries": {"max_attempts": 5, "mode": "standard"},
        }
        if spec.get("endpoint"):
            config["s3"] = {"addressing_style": "path"}  # as tensorstore talks to it
        if anonymous:
            config["signature_version"] = UNSIGNED
        client = session.create_client(
            "s3",
            endpoint_url=spec.get("endpoint"),
            region_name=spec.get("aws_region") or session.get_config_variable("region"),
            config=botocore.config.Config(**config),
        )
    except Exception as e:  # noqa: BLE001  (any botocore setup problem: no copier)
        return None, f"no S3 client: {type(e).__name__}: {e}"
    return _S3Copier(client, spec["bucket"]), ""


class _S3Copier(Copier):
    def __init__(self, client: Any, bucket: str):
        self._client = client
        self._bucket = bucket

    def _call(self, op: str, **kwargs) -> dict:
        from botocore.exceptions import BotoCoreError, ClientError  # optional, as above

        try:
            return getattr(self._client, op)(Bucket=self._bucket, **kwargs)
        except (BotoCoreError, ClientError) as e:
            raise CopyError(f"S3 {op} in bucket {self._bucket}: {e}") from e

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        out, token = {}, None
        while True:
            kw = {"Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            page = self._call("list_objects_v2", **kw)
            for obj in page.get("Contents", ()):
                etag = _etag(obj.get("ETag"))
                # Multipart ETags are no MD5 of the bytes; SSE-KMS ones are not either,
                # but a listing does not say: a copy's answer does (below).
                multipart = etag is not None and "-" in etag
                out[obj["Key"]] = ObjectInfo(int(obj["Size"]), etag, etag, not multipart)
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return out

    def copy(self, src: str, dst: str, source: ObjectInfo) -> ObjectInfo:
        kw: dict[str, Any] = {"Key": dst, "CopySource": {"Bucket": self._bucket, "Key": src}}
        if source.generation:
            kw["CopySourceIfMatch"] = f'"{source.generation}"'
        answer = self._call("copy_object", **kw)
        etag = _etag(answer.get("CopyObjectResult", {}).get("ETag"))
        encrypted = str(answer.get("ServerSideEncryption", "")).startswith("aws:kms") or bool(
            answer.get("SSECustomerAlgorithm")
        )
        # CopyObject reports no size: the caller checks it in a listing.
        return ObjectInfo(source.size, etag, etag, source.content_tag and not encrypted)

    def delete(self, key: str) -> None:
        self._call("delete_object", Key=key)

    batch_limit = 1000  # DeleteObjects takes at most 1000 keys

    def delete_batch(self, keys: list[str]) -> None:
        objects = [{"Key": k} for k in keys]
        answer = self._call("delete_objects", Delete={"Objects": objects, "Quiet": True})
        errors = answer.get("Errors") or []
        if errors:
            shown = "; ".join(
                f"{e.get('Key')}: {e.get('Code')} {e.get('Message')}" for e in errors[:5]
            )
            raise CopyError(
                f"S3 DeleteObjects in bucket {self._bucket} refused {len(errors)} of "
                f"{len(keys)} keys: {shown}"
            )

    def read_range(self, key: str, start: int, stop: int, source: ObjectInfo) -> bytes:
        kw: dict[str, Any] = {"Key": key, "Range": f"bytes={start}-{stop - 1}"}
        if source.generation:
            kw["IfMatch"] = f'"{source.generation}"'
        answer = self._call("get_object", **kw)
        try:
            body = answer["Body"].read(stop - start + 1)
        except Exception as e:
            raise CopyError(f"S3 get_object {key} in bucket {self._bucket}: {e}") from e
        finally:
            answer["Body"].close()
        return _exact(body, start, stop, f"S3 {self._bucket}/{key}")


def _etag(value: str | None) -> str | None:
    return value.strip('"') if value else None


# -- GCS ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _gcs_copier(spec_json: str, env: tuple) -> tuple[Copier | None, str]:
    emulator, test_token, _ = env
    bucket = json.loads(spec_json)["bucket"]
    if emulator:
        return _GCSCopier(emulator.rstrip("/"), bucket, lambda: test_token), ""
    try:
        import google.auth  # optional: google-auth only for GCS server-side copies
        import google.auth.transport.requests
    except ImportError:
        return None, "google-auth (with requests) is not installed"
    try:
        credentials, _ = google.auth.default(scopes=[_GCS_SCOPE])
    except Exception as e:  # noqa: BLE001  (DefaultCredentialsError and the like)
        return None, f"google.auth finds no credentials: {e}"
    lock = threading.Lock()

    def token() -> str | None:
        with lock:  # refreshed by one thread at a time, when expired
            if not credentials.valid:
                credentials.refresh(google.auth.transport.requests.Request())
            return credentials.token

    return _GCSCopier(_GCS_PUBLIC, bucket, token), ""


class _GCSCopier(Copier):
    def __init__(self, base: str, bucket: str, token):
        self._base = f"{base}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o"
        self._bucket = bucket
        self._token = token

    def _request(self, method: str, url: str, body: bytes | None = None) -> dict:
        raw = self._send(method, url, body)
        try:
            return json.loads(raw) if raw else {}
        except ValueError as e:
            raise CopyError(f"GCS {method} {url}: not JSON") from e

    def _send(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        limit: int | None = None,
    ) -> bytes:
        """The answer's body (at most ``limit`` bytes unless None); a DELETE of an absent
        object answers b"" (no error)."""
        headers = dict(headers or {})
        if body is not None:
            headers["Content-Type"] = "application/json"
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=_HTTP_TIMEOUT_S) as resp:
                return resp.read(limit)
        except urllib.error.HTTPError as e:
            if method == "DELETE" and e.code == 404:
                return b""
            raise CopyError(f"GCS {method} {url}: HTTP {e.code} {e.reason}") from e
        except (urllib.error.URLError, OSError) as e:
            raise CopyError(f"GCS {method} {url}: {e}") from e

    def _object(self, key: str) -> str:
        return f"{self._base}/{urllib.parse.quote(key, safe='')}"

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        out, token = {}, None
        while True:
            query = {"prefix": prefix, **({"pageToken": token} if token else {})}
            page = self._request("GET", f"{self._base}?{urllib.parse.urlencode(query)}")
            for obj in page.get("items") or ():
                if obj["name"].startswith(prefix):  # emulators may ignore the prefix
                    out[obj["name"]] = _gcs_info(obj)
            token = page.get("nextPageToken")
            if not token:
                return out

    def copy(self, src: str, dst: str, source: ObjectInfo) -> ObjectInfo:
        bucket = urllib.parse.quote(self._bucket, safe="")
        url = f"{self._object(src)}/rewriteTo/b/{bucket}/o/{urllib.parse.quote(dst, safe='')}"
        query: dict[str, str] = {}
        if source.generation:
            query["ifSourceGenerationMatch"] = source.generation
        while True:  # large objects take several calls, each resuming the last
            answer = self._request(
                "POST", f"{url}?{urllib.parse.urlencode(query)}" if query else url, b"{}"
            )
            if answer.get("done", True):
                return _gcs_info(answer.get("resource") or answer)
            query["rewriteToken"] = answer["rewriteToken"]

    def delete(self, key: str) -> None:
        self._request("DELETE", self._object(key))

    def read_range(self, key: str, start: int, stop: int, source: ObjectInfo) -> bytes:
        query = {"alt": "media"}
        if source.generation:
            query["ifGenerationMatch"] = source.generation
        url = f"{self._object(key)}?{urllib.parse.urlencode(query)}"
        headers = {"Range": f"bytes={start}-{stop - 1}"}
        body = self._send("GET", url, headers=headers, limit=stop - start + 1)
        return _exact(body, start, stop, f"GCS {self._bucket}/{key}")


def _exact(body: bytes, start: int, stop: int, shown: str) -> bytes:
    """``body`` when it is the ``stop - start`` bytes asked for (one byte more is read,
    to notice a store that ignored the range)."""
    if len(body) != stop - start:
        raise CopyError(
            f"{shown}: asked for bytes {start}-{stop - 1} ({stop - start} bytes), "
            f"the store answered {len(body)}{'+' if len(body) > stop - start else ''}"
        )
    return body


_COPIERS = {  # driver: its copier by (spec, environment), the variables it depends on
    "s3": (_s3_copier, ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE")),
    "gcs": (
        _gcs_copier,
        (
            "TENSORSTORE_GCS_HTTP_URL",
            "GOOGLE_AUTH_TOKEN_FOR_TESTING",
            "GOOGLE_APPLICATION_CREDENTIALS",
        ),
    ),
}


def _gcs_info(obj: dict) -> ObjectInfo:
    tags = [obj[k] for k in ("crc32c", "md5Hash") if obj.get(k)]
    generation = obj.get("generation")
    return ObjectInfo(
        int(obj.get("size", -1)),
        "/".join(tags) or None,
        None if generation is None else str(generation),
    )
