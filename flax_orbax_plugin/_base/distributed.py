"""The face of several processes: the entry of every public operation (:func:`public`,
:func:`collective`), who this process is, the names every process derives alike, and
the agreements (:func:`agree`, :func:`gather_json`, the key-value rounds).

One process: every function is a no-op. Several: every process calls the same functions
in the same order (SPMD); process 0 is the primary. Every function that draws a name or
waits takes ``region=`` explicitly; a background phase runs in the region handed to it.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.distributed``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import json
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .. import _errors
from .._errors import CheckpointError, CoordinationError, ProcessFailedError
from . import coordination as _coordination
from . import failures as _failures
from . import host as _host
from . import keywords as _keywords
from . import liveness as _liveness
from . import regions as _regions
from .failures import publish_failure
from .host import ACTIVITIES, process_count
from .regions import Region, client

# The key-value rounds (``_base/coordination.py``), for the callers.
barrier, broadcast_str = _coordination.barrier, _coordination.broadcast_str
gather_str, get_from = _coordination.gather_str, _coordination.get_from
publish, forget, poll = _coordination.publish, _coordination.forget, _coordination.poll
stall_timeout, DEFAULT_TIMEOUT_S = _coordination.stall_timeout, _coordination.DEFAULT_TIMEOUT_S
# Who this process is, and the coordination calls it made (tests count them).
is_primary, process_index, CALLS = _host.is_primary, _host.process_index, _regions.CALLS
_COUNTER = itertools.count()
_NAMES = itertools.count()  # unique_name's
_REGIONS = itertools.count()  # the n-th collective operation of this process

_SESSION: list[str] = []
_SESSION_LOCK = threading.Lock()


def next_operation_id(kind: str, *, region: Region | None) -> str:
    """A name every process derives identically for its n-th operation of this kind (in
    a region: its n-th of the region's)."""
    return f"fop/{kind}/{next(_COUNTER) if region is None else region.draw()}"


def session_nonce(*, region: Region | None) -> str:
    """A random name shared by every process (the primary's, under one fixed key), agreed
    once per process lifetime at its first call; staging names derive from it and a
    counter with no coordination (``region``: the operation that asks first)."""
    with _SESSION_LOCK:
        if not _SESSION:
            _SESSION.append(broadcast_str("fop/session", secrets.token_hex(4), region=region))
        return _SESSION[0]


def unique_name(*, region: Region | None) -> str:
    """``<session>x<n>``: identical on every process for its n-th call (SPMD order; in a
    region ``<session>x<region>y<n>``, its n-th of the region's)."""
    drawn = next(_NAMES) if region is None else region.draw().replace(".", "y")
    return f"{session_nonce(region=region)}x{drawn}"


def gather_json(kind: str, value: Any, *, region: Region | None) -> list[Any]:
    """Collective: every process's JSON ``value``, by process index (one key-value
    round; with one process, ``[value]``)."""
    if process_count() == 1:
        return [value]
    op = next_operation_id(kind, region=region)
    publish(op, json.dumps(value), region=region)
    # the values are kept (not forgotten): a peer may not have read ours yet
    return [json.loads(v) for v in gather_str(op, region=region)]


def agree(kind: str, error: BaseException | None, *, region: Region | None, what: str) -> None:
    """Collective (one key-value round): every process learns whether any failed here.

    Re-raises ``error`` (this process's own) once every process learned of it; else
    raises on every other process an error of the failed one's class (a CheckpointError
    subclass, else CheckpointError) naming it; returns when every process succeeded. So
    a restore failing on one process fails on all, at once.
    """
    if process_count() == 1:
        if error is not None:
            raise error
        return
    mine = None if error is None else {"type": type(error).__name__, "message": str(error)}
    op = next_operation_id(kind, region=region)
    if error is not None:  # a process waiting elsewhere in the region must not wait for us
        _failures.announce_agreement(op, error, region)
    if region is not None:
        region.agreeing = op
    try:
        publish(op, json.dumps(mine), region=region)
        views = [json.loads(v) for v in gather_str(op, region=region)]
    except ProcessFailedError:  # another left this path: this process's own error first
        if error is not None:
            raise error from None
        raise
    finally:
        if region is not None:
            region.agreeing = None
            region.agreed.add(op)
    if error is not None:
        raise error
    for p, view in enumerate(views):
        if view is not None:
            cls = getattr(_errors, view["type"], None)
            if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
                cls = CheckpointError
            raise cls(f"{what}: process {p} failed: {view['type']}: {view['message']}")


@contextlib.contextmanager
def collective(
    kind: str, *, spans: bool = True, stall_s: float | None = None, scope: str | None = None
) -> Iterator[Region | None]:
    """A collective operation of every process: draws a region for the body (``with
    collective(...) as region``), in which waits raise :class:`ProcessFailedError` once
    another process published a failure, and whose error is published for the others.

    ``spans=False`` (a call one process may make alone) or one process: the body gets
    None. Each call draws a new region (internals are handed theirs). ``stall_s``: the
    region's stall timeout; ``scope``: its scope (:class:`Region`). Call it on the
    thread that makes the SPMD calls."""
    _host.refuse_if_detected(kind)  # every public save and restore enters here
    if not spans or jax.process_count() == 1:
        yield None
        return
    with contextlib.suppress(CoordinationError):  # no client: the first wait says so
        _liveness.ensure_beating(client(), jax.process_index())  # before any wait on us
    _host.at_exit(_host.ANNOUNCE, _failures.announce_program_end)
    region = Region(kind, str(next(_REGIONS)), stall_s=stall_s, scope=scope)
    with resumed(region):
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
      **kwargs)`` says so; None: always) whose body is handed ``region=`` (or None);
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


@contextlib.contextmanager
def resumed(region: Region | None) -> Iterator[None]:
    """Runs the body as a part of the operation of ``region`` (named in the heartbeat;
    e.g. a save's background phase); an error leaving it is published. None: nothing."""
    if region is None:
        yield
        return
    try:
        with ACTIVITIES.doing(f"{region.kind} (operation {region.tag})"):
            yield
    except (SystemExit, GeneratorExit):  # a preempted run leaves together, on purpose
        raise
    except BaseException as e:
        publish_failure(region, e)
        raise
