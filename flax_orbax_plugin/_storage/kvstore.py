"""Tensorstore kvstores: shared contexts, the spec of a path, and an object store's refusal
said once.

Contexts are created once per kind of store, lazily, under a lock: safe from any thread.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._storage.kvstore``.
"""

from __future__ import annotations

import configparser
import functools
import inspect
import os
import re
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from .._base import env as _env
from .._errors import CheckpointError, StoreAccessError, UnsupportedLocationError

__all__ = [
    "arguments",
    "raises_store_errors",
    "raises_store_errors_in_methods",
    "refusal",
    "refusals",
    "store_error_line",
]

if TYPE_CHECKING:
    import tensorstore as ts


def tensorstore() -> Any:
    """The tensorstore module, imported at its first use rather than with this module:
    a command that reads a few JSON files of a local disk (``flax-orbax list``) never
    needs it, and its import takes about a second. Any thread."""
    import tensorstore as ts  # inside on purpose: see the docstring

    return ts


_CONTEXTS: dict[bool, ts.Context] = {}
_CONTEXT_LOCK = threading.Lock()


def context(*, local: bool = True) -> ts.Context:
    """The tensorstore context shared by every open: caches off, no fsync by tensorstore
    (see :meth:`Location.sync`). Local disks get few concurrent file operations (more
    only raised peak memory on restore, measured here), object stores many (latency).
    """
    with _CONTEXT_LOCK:
        if local not in _CONTEXTS:
            spec: dict[str, Any] = {
                "cache_pool": {"total_bytes_limit": 0},
                "data_copy_concurrency": {"limit": max(2, os.cpu_count() or 2)},
            }
            if local:
                spec["file_io_sync"] = False
                spec["file_io_concurrency"] = {"limit": 8}
            else:
                spec["s3_request_concurrency"] = {"limit": 32}
                spec["gcs_request_concurrency"] = {"limit": 32}
                spec["s3_request_retries"] = spec["gcs_request_retries"] = store_retries()
            _CONTEXTS[local] = tensorstore().Context(spec)
        return _CONTEXTS[local]


def store_retries() -> dict[str, Any]:
    """The retries of an object store request: ``FOP_STORE_RETRIES`` (default 8), the
    delay doubling from 0.5 s to at most 10 s, so that a store that cannot be reached (a
    wrong endpoint, the server gone mid-save) fails in about a minute. tensorstore's own
    default retried for about 15 minutes, silently, while a save's blocking phase held
    back Ctrl-C."""
    return {
        "max_retries": _env.read("FOP_STORE_RETRIES"),
        "initial_delay": "0.5s",
        "max_delay": "10s",
    }


def check_name(name: str) -> str:
    """``name`` if it is a relative storage name inside a location (no empty, ``.`` or
    ``..`` component, no backslash or NUL); ValueError otherwise."""
    parts = name.split("/")
    if not name or any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name:
        raise ValueError(f"invalid storage name {name!r}")
    return name


# What a path argument may name, in the words of the errors below.
SUPPORTED = "a local path, file://, s3://<bucket>/, gs://<bucket>/ or memory://"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")  # two letters at least: 'C:' is a drive
_STORES = {"s3": "s3", "gs": "gcs", "memory": "memory", "file": "file"}


def spec_from_path(path: Any, *, what: str = "checkpoint location") -> dict[str, Any]:
    """The kvstore spec, its path ending in '/', of an os.PathLike/str path, an
    s3/gs/memory/file URL or a kvstore dict. The one checker of "where is this path":
    any other ``scheme:`` (and a store URL without ``//`` or without a bucket) is a
    UnsupportedLocationError naming ``what`` and what is supported, never read as a
    local name. So is a path naming no place of its own (empty: it would be the current
    directory), text a store cannot hold (NUL, not UTF-8), a leading ``~`` (never
    expanded: it would be a folder named ``~``), a URL's ``?``/``#`` part (dropped
    otherwise), a ``.``/``..``/empty component in a store key, and anything tensorstore
    itself refuses (a bucket name, a driver): all before anything is opened."""
    if isinstance(path, dict):
        spec = _dict_spec(path, what)
    elif isinstance(path, (str, bytes, os.PathLike)):
        spec = _url_spec(_path_text(path, what), what)
    else:
        raise UnsupportedLocationError(
            f"{what}: expected a path (str or os.PathLike), a URL or a kvstore spec dict, "
            f"found {type(path).__name__} {_cut(path)}"
        )
    spec["path"] = spec.get("path", "").rstrip("/") + "/"
    if spec["driver"] != "file" and spec["path"] == "/":
        spec["path"] = ""
    _check_store_spec(spec, path, what)
    return spec


def _path_text(path: Any, what: str) -> str:
    """``path`` as text, refused when it names nothing or could not be stored."""
    try:
        text = os.fsdecode(path)
    except (TypeError, UnicodeError) as e:  # a PathLike whose fspath is no text
        raise UnsupportedLocationError(f"{what} {_cut(path)}: not a path ({e})") from None
    if not text:
        raise UnsupportedLocationError(
            f"{what}: an empty path, which would name the current directory; expected "
            f"{SUPPORTED} (write '.' to mean the current directory)"
        )
    if "\0" in text:
        raise UnsupportedLocationError(f"{what} {text!r}: holds a NUL character")
    if text != text.strip() and not os.path.lexists(text):  # a config's stray space, a "\n"
        raise UnsupportedLocationError(
            f"{what} {text!r}: begins or ends with whitespace (a stray space or newline "
            f"from a config or a file?), so it would name another place than "
            f"{text.strip() or 'the one meant'!r}; strip it (a folder of that name that "
            f"exists is read as is)"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedLocationError(
            f"{what} {text!r}: not valid UTF-8 at position {e.start} (a file name in "
            f"another encoding); tensorstore paths are UTF-8 text: rename it"
        ) from None
    if text == "~" or text.startswith(("~/", "~\\")) or re.match(r"^~[\w.-]+(/|$)", text):
        raise UnsupportedLocationError(
            f"{what} {text!r}: '~' is not expanded here (this would be a folder named "
            f"{text.split('/')[0]!r} in the current directory); pass "
            f"os.path.expanduser(path), or './{text}' for a folder of that name"
        )
    return text


def _local_abspath(text: str, what: str) -> str:
    """The absolute form of a local path; a backslash is refused here, where it enters
    (no name below it could be made: it was a raw "invalid storage name" at save)."""
    if "\\" in text:
        raise UnsupportedLocationError(
            f"{what} {text!r}: holds a backslash (a Windows path?); expected a POSIX path, "
            f"'/' between folders"
        )
    return os.path.abspath(text)


def _dict_spec(path: dict[str, Any], what: str) -> dict[str, Any]:
    spec = dict(path)
    if not isinstance(spec.get("driver"), str):
        raise UnsupportedLocationError(f"{what}: a kvstore spec needs a 'driver', found {path!r}")
    if not isinstance(spec.get("path", ""), str):
        raise UnsupportedLocationError(
            f"{what}: the kvstore spec's 'path' must be a str, found "
            f"{type(spec['path']).__name__} {_cut(spec['path'])}"
        )
    if spec["driver"] == "file":
        if not spec.get("path"):
            raise UnsupportedLocationError(
                f"{what}: the file kvstore spec {path!r} names no 'path' (it would be the "
                f"current directory)"
            )
        spec["path"] = _local_abspath(_path_text(spec["path"], what), what)
    return spec


def _check_store_spec(spec: dict[str, Any], given: Any, what: str) -> None:
    """Store keys with an empty, '.' or '..' component (kept literally by a store, so
    never the place they read as), then tensorstore's own parse of ``spec``."""
    if spec["driver"] != "file":
        parts = spec["path"].rstrip("/").split("/") if spec["path"] else []
        bad = [p for p in parts if p in ("", ".", "..")]
        if bad or "\0" in spec["path"]:
            raise UnsupportedLocationError(
                f"{what} {_shown(given)}: the key {spec['path']!r} holds a "
                f"{bad[0] if bad else 'NUL'!r} component; a {spec['driver']} store keeps it "
                f"literally (no folder is left or entered): expected a/b/c"
            )
    if set(spec) == {"driver", "path"} and spec["driver"] == "file":  # an absolute local
        return  # path: nothing for tensorstore to refuse (a local command starts without it)
    try:
        tensorstore().KvStore.Spec(spec)
    except (ValueError, TypeError, RuntimeError) as e:
        raise UnsupportedLocationError(f"{what} {_shown(given)}: {e}") from None


def _cut(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def local_path(path: Any, *, what: str, note: str = "") -> str:
    """The local filesystem path ``path`` names (a plain path as given, a ``file://``
    URL's path), for inputs only local files can serve (safetensors files, msgpack
    files, a key map). An object-store URL (or a kvstore spec of one) is refused with
    an UnsupportedLocationError naming ``what`` and the store, plus ``note`` (what to do instead):
    never turned into a local name such as ``./s3:/bucket``."""
    text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else None
    scheme = _SCHEME.match(text) if text is not None else None
    if scheme is not None and scheme.group(1).lower() not in _STORES:
        raise UnsupportedLocationError(
            f"{what} {text!r}: a {scheme.group(1) + ':'!r} URL, but {what} must be a local "
            f"path (or file://){': ' + note if note else ''}"
        )
    spec = spec_from_path(path, what=what)
    if spec["driver"] == "file":
        if text is not None and not _SCHEME.match(text):
            return text
        return spec["path"].rstrip("/") or "/"
    raise UnsupportedLocationError(
        f"{what} {_shown(path)}: names an object store ({spec['driver']}), but {what} must "
        f"be a local path (or file://){': ' + note if note else ''}"
    )


def _shown(path: Any) -> str:
    return repr(os.fspath(path) if isinstance(path, (str, os.PathLike)) else path)


def _url_spec(text: str, what: str) -> dict[str, Any]:
    found = _SCHEME.match(text)
    if found is None:  # a plain (or Windows-like) path
        return {"driver": "file", "path": _local_abspath(text, what)}
    scheme = found.group(1).lower()
    if scheme not in _STORES:
        raise UnsupportedLocationError(
            f"{what} {text!r}: unsupported store {scheme + ':'!r}; supported: {SUPPORTED}"
        )
    url = urlparse(text)
    if not text[found.end() :].startswith("//"):
        raise UnsupportedLocationError(
            f"{what} {text!r}: expected {scheme}://..., found no '//' after {scheme}:"
        )
    if url.query or url.fragment or text.endswith(("?", "#")):
        raise UnsupportedLocationError(
            f"{what} {text!r}: a URL's '?' or '#' part names no place (it would be dropped); "
            f"expected {scheme}://... without them"
        )
    if scheme in ("s3", "gs") and not url.netloc:
        raise UnsupportedLocationError(
            f"{what} {text!r}: expected {scheme}://<bucket>/<path>, found no bucket"
        )
    if scheme == "memory":
        return {"driver": "memory", "path": (url.netloc + url.path).lstrip("/")}
    if scheme == "file":
        if url.netloc not in ("", "localhost"):  # file://rel/x would silently name /x
            raise UnsupportedLocationError(
                f"{what} {text!r}: expected file:///<absolute path>, found the host {url.netloc!r}"
            )
        if not url.path:  # file:// alone would name the current directory
            raise UnsupportedLocationError(
                f"{what} {text!r}: expected file:///<absolute path>, found no path"
            )
        return {"driver": "file", "path": _local_abspath(_path_text(url.path, what), what)}
    # the one '/' after the bucket goes; another ('s3://b//x': the key '/x') stays, and is
    # refused below as an empty component (it was quietly read as 'x', another key)
    spec = {"driver": _STORES[scheme], "bucket": url.netloc, "path": url.path[1:]}
    if scheme == "s3":
        spec.update(_s3_settings_from_env())
    return spec


def _s3_settings_from_env() -> dict[str, Any]:
    """S3-compatible servers: tensorstore's s3 driver ignores ``AWS_ENDPOINT_URL``
    (it always talks to amazonaws.com), so an ``s3://`` URL takes it from here.

    With both keys in the environment, the credentials are named as coming from it:
    the default chain would pick them first too (the same credentials), but builds its
    profile provider on the way, which logs about 5 ERROR lines per open when
    ``~/.aws/config`` or ``~/.aws/credentials`` is missing (aws-c-auth, through
    tensorstore's absl logging, on stderr). Else a profile with both keys in the shared
    credentials file (``AWS_PROFILE``, default ``default``) is named with its files
    (:func:`_profile_with_keys`). Anything else is left to the default chain."""
    settings: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        settings["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        settings["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        settings["aws_credentials"] = {"type": "environment"}
        return settings
    credentials = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser(
        "~/.aws/credentials"
    )
    config = os.environ.get("AWS_CONFIG_FILE") or os.path.expanduser("~/.aws/config")
    profile = os.environ.get("AWS_PROFILE") or "default"
    try:
        info = os.stat(credentials)
    except OSError:
        return settings
    stamp = (info.st_mtime_ns, info.st_size)
    named = _profile_with_keys(credentials, stamp, profile, config, os.path.isfile(config))
    if named is not None:
        settings["aws_credentials"] = named
    return settings


@functools.lru_cache(maxsize=8)
def _profile_with_keys(
    credentials: str, stamp: tuple[int, int], profile: str, config: str, config_exists: bool
) -> dict[str, str] | None:
    """The profile provider, named in full, when the credentials file holds both keys of
    ``profile``: the keys the default chain should read next, but tensorstore 0.1.86's
    chain finds no profile ("could not load a profile at .") and goes on anonymous
    (access denied); named with its files it reads them, and logs nothing. A missing
    config file is given as the empty ``os.devnull``. None for any other file (a role,
    SSO, a process: left to the default chain). ``stamp``: the file's mtime and size, a
    cache key (the file is read again when it changes)."""
    del stamp
    parser = configparser.RawConfigParser()
    try:
        parser.read(credentials, encoding="utf-8")
        keys = parser.has_option(profile, "aws_access_key_id") and parser.has_option(
            profile, "aws_secret_access_key"
        )
    except (configparser.Error, OSError, UnicodeError):
        return None
    if not keys:
        return None
    return {
        "type": "profile",
        "profile": profile,
        "credentials_file": credentials,
        "config_file": config if config_exists else os.devnull,
    }


def prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    key_range = tensorstore().KvStore.KeyRange
    if not prefix:
        return key_range()
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    return key_range(inclusive_min=prefix, exclusive_max=end)


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
