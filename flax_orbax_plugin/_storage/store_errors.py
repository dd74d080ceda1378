"""An object store's refusal, said once: no such bucket, no credentials, access denied.

Tensorstore reports these as a ``ValueError`` carrying the store's XML or JSON body.
:func:`refusal` reads that text once, here, for every caller: the command line prints
its line (exit code 3), and every public entry point of the Python API raises
:class:`~flax_orbax_plugin.StoreAccessError`, naming the bucket, what happened and what
to do: a function through its entry decorator (``_base.regions.public``, handed
:func:`refusals`), a public class through :func:`raises_store_errors_in_methods`.
Anything else passes unchanged.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

from .._errors import CheckpointError, StoreAccessError
from .kvstore import spec_from_path

__all__ = [
    "arguments",
    "raises_store_errors",
    "raises_store_errors_in_methods",
    "refusal",
    "refusals",
    "store_error_line",
]

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
)
_UNREACHABLE = (
    r"Could not connect to server|Couldn't connect|Failed to connect|Could not resolve "
    r"host|Couldn't resolve host|curl_code='(6|7|28)'",
    "cannot be reached",
    "check the endpoint (AWS_ENDPOINT_URL, TENSORSTORE_GCS_HTTP_URL) and the network",
)
# A reply without the store's own body (GCS emulators answer a missing bucket so).
_UNREADABLE = (
    r"Failed to parse response metadata",
    "no such bucket, or its reply could not be read",
    "check the bucket's name and the endpoint (TENSORSTORE_GCS_HTTP_URL: a GCS server?)",
)
_REFUSALS = (*_REFUSALS, _UNREACHABLE, _UNREADABLE)
_BUCKET_IN_BODY = re.compile(r"<BucketName>([^<]+)</BucketName>")


def refusal(error: BaseException, spec: dict[str, Any]) -> StoreAccessError | None:
    """The :class:`StoreAccessError` that ``error`` (raised by tensorstore on the s3 or
    gcs store of ``spec``) means, or None for any other error and any other store.
    Access denied with no AWS credentials anywhere in the environment is reported as
    missing credentials (the request went out anonymous)."""
    driver = spec.get("driver")
    if driver not in ("s3", "gcs") or not isinstance(error, ValueError):
        return None
    if isinstance(error, CheckpointError):  # ours already says what happened
        return None
    text = str(error)
    url = f"{'s3' if driver == 's3' else 'gs'}://{spec.get('bucket', '')}"
    for pattern, what, todo in _REFUSALS:
        if re.search(pattern, text):
            if what == "access denied" and driver == "s3" and not _aws_credentials_present():
                what = "no credentials could be loaded (the request went anonymous)"
                todo = _NO_CREDENTIALS
            detail = text.splitlines()[0][:300] if text else ""
            return StoreAccessError(f"{url}: {what}; {todo}", url=url, reason=what, detail=detail)
    return None


def store_error_line(error: BaseException, spec: dict[str, Any]) -> str | None:
    """The one line the command line prints for ``error`` (see :func:`refusal`)."""
    found = refusal(error, spec)
    return None if found is None else str(found)


def _specs(places: Iterable[Any]) -> list[dict[str, Any]]:
    out = []
    for place in places:
        if place is None:
            continue
        try:
            out.append(spec_from_path(place.spec if hasattr(place, "spec") else place))
        except (ValueError, TypeError):  # not a place: its own check reports it
            continue
    return out


def _first_refusal(error: BaseException, places: Iterable[Any]) -> StoreAccessError | None:
    specs = [s for s in _specs(places) if s.get("driver") in ("s3", "gcs")]
    named = _BUCKET_IN_BODY.search(str(error))  # S3's body names the bucket
    if named and not any(s.get("bucket") == named.group(1) for s in specs):
        specs = [{"driver": "s3", "bucket": named.group(1)}]  # a place of no argument
    elif named:
        specs.sort(key=lambda s: s.get("bucket") != named.group(1))
    return next((r for s in specs if (r := refusal(error, s)) is not None), None)


def arguments(*names: str) -> Callable[[dict[str, Any]], list[Any]]:
    """The ``places`` of :func:`raises_store_errors` for an entry point whose places are
    the arguments ``names`` (a path, a URL, a spec dict or a Location each)."""
    return lambda bound: [bound.get(n) for n in names]


def refusals(
    places: Callable[[dict[str, Any]], Iterable[Any]],
) -> Callable[[BaseException, dict[str, Any]], StoreAccessError | None]:
    """The ``errors=`` of a public entry (``_base.regions.public``): a tensorstore
    refusal (a ``ValueError``) of one of the object stores that ``places(arguments)``
    names, as :class:`StoreAccessError`; None for every other error."""

    def translate(error: BaseException, bound: dict[str, Any]) -> StoreAccessError | None:
        if not isinstance(error, ValueError):
            return None
        return _first_refusal(error, places(bound))

    return translate


def raises_store_errors(places: Callable[[dict[str, Any]], Iterable[Any]]) -> Callable:
    """A public entry point's decorator: a tensorstore refusal of one of the object
    stores that ``places(arguments)`` names (``arguments``: the call's bound
    arguments by name, ``self`` included for a method) is raised as
    :class:`StoreAccessError`; every other error passes unchanged. The signature (and
    ``__signature__``) is the wrapped function's."""

    translate = refusals(places)

    def decorate(fn: Callable) -> Callable:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except ValueError as e:
                try:
                    found = translate(e, sig.bind_partial(*args, **kwargs).arguments)
                except Exception:  # noqa: BLE001  (the original error stands)
                    found = None
                if found is None:
                    raise
                raise found from None

        return wrapper

    return decorate


def raises_store_errors_in_methods(places: Callable[[dict[str, Any]], Iterable[Any]]) -> Callable:
    """A public class's decorator: :func:`raises_store_errors` on ``__init__``,
    ``__enter__``, ``__exit__`` and every public method the class defines or takes from
    its bases (mixins; properties, class and static methods are left as they are)."""

    def decorate(cls: type) -> type:
        found: dict[str, Any] = {}
        for klass in reversed(cls.__mro__[:-1]):  # the class's own definitions last
            found.update(vars(klass))
        for name, attr in found.items():
            public = not name.startswith("_") or name in ("__init__", "__enter__", "__exit__")
            if public and inspect.isfunction(attr):
                setattr(cls, name, raises_store_errors(places)(attr))
        return cls

    return decorate


def _aws_credentials_present() -> bool:
    """Whether the environment names any AWS credentials (keys, a profile, a
    credentials file): otherwise the default chain ends anonymous."""
    if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_PROFILE"):
        return True
    if os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE") or os.environ.get(
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"
    ):
        return True
    files = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser(
        "~/.aws/credentials"
    )
    return os.path.isfile(files)
