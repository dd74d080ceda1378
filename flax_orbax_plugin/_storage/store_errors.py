"""An object store's refusal, said once: tensorstore's status text of an ``s3://`` or
``gs://`` store worded as a :class:`StoreAccessError` naming the bucket and what to do;
the ``errors=`` of a public entry (:func:`refusals`). Pure functions: any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.location``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from .._errors import CheckpointError, StoreAccessError
from .location import spec_from_path
from .s3_credentials import aws_credentials_present

_NO_CREDENTIALS = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile) for s3://, or "
    "GOOGLE_APPLICATION_CREDENTIALS / `gcloud auth application-default login` for gs://"
)


# By tensorstore's status text: (pattern, what happened, what to do); the first wins.
_REFUSALS = (
    (
        r"NoSuchBucket|bucket does not exist|404.*bucket",
        "no such bucket",
        "check the bucket's name (and the endpoint/project it lives in)",
    ),
    (
        r"PROVIDER_INVALID_ENVIRONMENT|Failed to get credentials|Failed to create credentials",
        "no credentials could be loaded",
        _NO_CREDENTIALS,
    ),
    (
        r"PERMISSION_DENIED|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|"
        r"http_response_code='40[13]'|UNAUTHENTICATED",
        "access denied",
        "check that these credentials may read (and, to write, write) this bucket",
    ),
    (
        r"Could not connect to server|Couldn't connect|Failed to connect|Could not resolve "
        r"host|Couldn't resolve host|curl_code='(6|7|28)'",
        "cannot be reached",
        "check the endpoint (AWS_ENDPOINT_URL, TENSORSTORE_GCS_HTTP_URL) and the network",
    ),
    (  # a reply without the store's own body (GCS emulators answer a missing bucket so)
        r"Failed to parse response metadata",
        "no such bucket, or its reply could not be read",
        "check the bucket's name and the endpoint (TENSORSTORE_GCS_HTTP_URL: a GCS server?)",
    ),
)


_BUCKET_IN_BODY = re.compile(r"<BucketName>([^<]+)</BucketName>")


def refusal(error: BaseException, spec: dict[str, Any]) -> StoreAccessError | None:
    """The :class:`StoreAccessError` that ``error`` (tensorstore's, on the s3 or gcs
    store of ``spec``) means, or None. Access denied with no AWS credentials in the
    environment is reported as missing credentials (the request went out anonymous)."""
    driver = spec.get("driver")
    if driver not in ("s3", "gcs") or not isinstance(error, ValueError):
        return None
    if isinstance(error, CheckpointError):  # ours already says what happened
        return None
    text = str(error)
    url = f"{'s3' if driver == 's3' else 'gs'}://{spec.get('bucket', '')}"
    for pattern, what, todo in _REFUSALS:
        if re.search(pattern, text):
            if what == "access denied" and driver == "s3" and not aws_credentials_present():
                what = "no credentials could be loaded (the request went anonymous)"
                todo = _NO_CREDENTIALS
            detail = text.splitlines()[0][:300] if text else ""
            return StoreAccessError(f"{url}: {what}; {todo}", url=url, reason=what, detail=detail)
    return None


def _specs(places: Iterable[Any]) -> list[dict[str, Any]]:
    out = []
    for place in places:
        try:  # a Location's spec, or what the argument names
            out.append(spec_from_path(getattr(place, "spec", place)))
        except (ValueError, TypeError):  # not a place (None too): its own check reports it
            pass
    return out


def arguments(*names: str) -> Callable[[dict[str, Any]], list[Any]]:
    """The ``places`` of :func:`refusals` for an entry point whose places are
    the arguments ``names`` (a path, a URL, a spec dict or a Location each)."""
    return lambda bound: [bound.get(n) for n in names]


def refusals(
    places: Callable[[dict[str, Any]], Iterable[Any]],
) -> Callable[[BaseException, dict[str, Any]], StoreAccessError | None]:
    """The ``errors=`` of a public entry (``_base.distributed.public``): a tensorstore
    refusal (a ``ValueError``) of one of the object stores that ``places(bound)`` names
    (``bound``: the call's arguments by name, ``self`` included), as
    :class:`StoreAccessError` (on the bucket the error's body names first); else None."""

    def translate(error: BaseException, bound: dict[str, Any]) -> StoreAccessError | None:
        if not isinstance(error, ValueError):
            return None
        specs = [s for s in _specs(places(bound)) if s.get("driver") in ("s3", "gcs")]
        named = _BUCKET_IN_BODY.search(str(error))  # S3's body names the bucket
        if named and not any(s.get("bucket") == named.group(1) for s in specs):
            specs = [{"driver": "s3", "bucket": named.group(1)}]  # a place of no argument
        elif named:
            specs.sort(key=lambda s: s.get("bucket") != named.group(1))
        return next((r for s in specs if (r := refusal(error, s)) is not None), None)

    return translate
