"""The face of several processes: the entry of every public operation (:func:`public`,
:func:`collective`), which draws the operation's collective object (:class:`Region`,
``_base/coordination.py``) and hands it down as ``region``, and who this process is.

One process: the region's rounds return at once. Several: every process calls the same
functions in the same order (SPMD); process 0 is the primary.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.distributed``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .._errors import CoordinationError
from . import failures as _failures
from . import host as _host
from . import keywords as _keywords
from . import liveness as _liveness
from .coordination import DEFAULT_TIMEOUT_S, Region
from .failures import publish_failure
from .host import is_primary, process_count, process_index
from .regions import CALLS, client

__all__ = [
    "CALLS",
    "DEFAULT_TIMEOUT_S",
    "Region",
    "collective",
    "is_primary",
    "process_count",
    "process_index",
    "public",
    "publish_failure",
]

_REGIONS = itertools.count()  # the n-th collective operation of this process


@contextlib.contextmanager
def collective(
    kind: str, *, spans: bool = True, stall_s: float | None = None, scope: str | None = None
) -> Iterator[Region]:
    """A collective operation of every process: draws a region for the body (``with
    collective(...) as region``), in which waits raise :class:`ProcessFailedError` once
    another process published a failure, and whose error is published for the others.

    ``spans=False`` (a call one process may make alone) or one process: the body gets a
    region that spans nothing (:attr:`Region.spans`). Each call draws a new region
    (internals are handed theirs). ``stall_s``: the region's stall timeout; ``scope``:
    its scope (:class:`Region`). Call it on the thread that makes the SPMD calls."""
    _host.refuse_if_detected(kind)  # every public save and restore enters here
    if not spans or jax.process_count() == 1:
        yield Region(kind)
        return
    with contextlib.suppress(CoordinationError):  # no client: the first wait says so
        _liveness.ensure_beating(client(), jax.process_index())  # before any wait on us
    _host.at_exit(_host.ANNOUNCE, _failures.announce_program_end)
    region = Region(kind, str(next(_REGIONS)), stall_s=stall_s, scope=scope)
    with region.resumed():
        yield region


# ``errors(error, arguments)``: the error to raise in place of ``error`` (None: as it
# is), from the call's bound arguments (``_storage.store_errors.refusals``).
Errors = Callable[[BaseException, dict[str, Any]], BaseException | None]


def public(
    kind: str | None = None,
    *,
    spans: Callable[..., bool] | None = None,
    errors: Errors | None = None,
    stall: str | None = None,
    scope: str | None = None,
) -> Callable:
    """The one decorator of a public operation (a function, a method or a class): each call

    * refuses a keyword the function does not take ("did you mean"), in its region;
    * with ``kind``, is a collective operation (:func:`collective`, when ``spans(*args,
      **kwargs)`` says so; None: always) whose body is handed ``region=`` (its :class:`Region`);
      without ``kind``, a call of one process;
    * raises what ``errors`` (:data:`Errors`) makes of the body's error, in the region.

    On a method, ``stall`` and ``scope`` name the object's attributes holding its
    region's stall timeout and scope. On a class (no ``kind``): the entry of
    ``__init__``, ``__enter__``, ``__exit__`` and each public method, its bases' too,
    with ``errors`` (methods that are entries already, properties, class and static
    methods left as they are). The signature shown is the body's (without ``region``).
    Threading: the caller's."""

    def region(*args: Any, **kwargs: Any) -> contextlib.AbstractContextManager:
        if kind is None:
            return contextlib.nullcontext()
        _host.refuse_if_detected(kind)  # before ``spans`` looks at any device
        try:
            spanning = spans is None or spans(*args, **kwargs)
        except TypeError:  # arguments the function refuses (one missing): it says so itself
            spanning = False
        own = args[0] if args and (stall or scope) else None  # a method's object
        stall_s = None if stall is None else getattr(own, stall, None)
        return collective(
            kind,
            spans=spanning,
            stall_s=stall_s,
            scope=None if scope is None else getattr(own, scope, None),
        )

    def decorate(body: Any) -> Any:
        if isinstance(body, type):
            if kind is not None:
                raise TypeError(f"public({kind!r}) on {body.__name__}: a kind is a method's")
            return _public_methods(body, errors)
        return _entry(body, region, errors, kind is not None, body.__qualname__)

    return decorate


def _entry(
    body: Callable,
    region: Callable[..., contextlib.AbstractContextManager],
    errors: Errors | None,
    hands_region: bool,
    owner: str,
) -> Callable:
    """:func:`public`'s wrapper of ``body``: keywords checked, the body called (handed
    ``region=`` where ``hands_region``) and its error translated, in ``region(...)``."""
    shown = inspect.signature(body)
    takes = _keywords.keywords_taken(body)
    if takes is not None and not hands_region and "region" in shown.parameters:
        takes |= {"region"}  # a body's own ``region`` (a SaveHandle's), given by its caller

    @functools.wraps(body)
    def call(*args: Any, **kwargs: Any) -> Any:
        with region(*args, **kwargs) as drawn:
            if takes is not None and not takes.issuperset(kwargs):
                raise _keywords.unknown_keywords(owner, kwargs, takes)
            try:
                if not hands_region:
                    return body(*args, **kwargs)
                return body(*args, region=drawn, **kwargs)
            except Exception as e:
                found = None if errors is None else _translated(errors, e, shown, args, kwargs)
                if found is None:
                    raise
                raise found from None

    params = [p for p in shown.parameters.values() if p.name != "region" or not hands_region]
    call.__signature__ = shown.replace(parameters=params)  # type: ignore[attr-defined]
    call._fop_named = True  # type: ignore[attr-defined]
    return call


_ENTERED = ("__init__", "__enter__", "__exit__")  # a class's dunders that are entries


def _public_methods(cls: type, errors: Errors | None) -> type:
    """``public(errors=errors)`` on a class (see :func:`public`), set on the class."""
    found: dict[str, Any] = {}
    no_region = lambda *args, **kwargs: contextlib.nullcontext()
    for klass in reversed(cls.__mro__[:-1]):  # the class's own definitions last
        found.update(vars(klass))
    for name, attr in found.items():
        if name.startswith("_") and name not in _ENTERED:
            continue
        if not inspect.isfunction(attr) or getattr(attr, "_fop_named", False):
            continue
        owner = cls.__name__ if name == "__init__" else f"{cls.__name__}.{name}"
        setattr(cls, name, _entry(attr, no_region, errors, False, owner))
    return cls


def _translated(
    errors: Errors, error: Exception, shown: inspect.Signature, args: tuple, kwargs: dict
) -> BaseException | None:
    """What ``errors`` makes of ``error`` (None: it stands, also where that fails)."""
    try:
        return errors(error, shown.bind_partial(*args, **kwargs).arguments)
    except Exception:  # noqa: BLE001  (the original error stands)
        return None
