"""The face of several processes: the entry of every public operation (:func:`public`,
:func:`collective`), which draws the operation's collective object (:class:`Region`) and
hands it down as ``region``, and who this process is. A region names what every process
derives alike and publishes a failure leaving it (:meth:`Region.resumed`); its key-value
rounds and agreements, through their one wait, are its base's
(``_base.coordination.Rounds``: what only several processes run).

The code below an entry calls its region's methods and never asks how many processes
there are. With one process every round returns at once. A region that ``spans``
nothing (one process, or a call one process may make alone) still makes its rounds when
there are several processes, under this process's counters' names, and publishes no
failure. Several: every process calls the same methods in the same order (SPMD); process
0 is the primary.

Threading: regions are drawn and their methods called on the thread that makes the SPMD
calls, or in a background phase after that thread's last draw in it (``SaveHandle``).

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._base.distributed``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .._errors import CoordinationError
from . import failures as _failures
from . import host as _host
from . import keywords as _keywords
from . import liveness as _liveness
from .coordination import DEFAULT_TIMEOUT_S, Rounds
from .failures import publish_failure
from .host import is_primary, process_count, process_index
from .regions import CALLS
from .regions import client as _client

__all__ = ["CALLS", "DEFAULT_TIMEOUT_S", "Region", "collective", "is_primary", "process_count"]
__all__ += ["process_index", "public", "publish_failure"]

_COUNTER = itertools.count()  # operation names outside a collective operation
_NAMES = itertools.count()  # unique names outside a collective operation
_SESSION: list[str] = []
_SESSION_LOCK = threading.Lock()
_REGIONS = itertools.count()  # the n-th collective operation of this process


@dataclasses.dataclass
class Region(Rounds):
    """One operation's collective object: its kind (``manager-save`` ...) and ``tag``,
    the same on every process (None: it spans no collective operation, see the module
    docstring); the names drawn in it so far, the agreement it is in and those it
    completed, its waits' stall timeout (``stall_s``; None: ``FOP_COORDINATION_TIMEOUT_S``)
    and ``scope``: the tag of the manager's open it belongs to, or None."""

    kind: str
    tag: str | None = None
    drawn: int = 0
    stall_s: float | None = None
    scope: str | None = None
    agreeing: str | None = None
    agreed: set[str] = dataclasses.field(default_factory=set)

    @property
    def spans(self) -> bool:
        """Whether this is a collective operation's region (its failures published)."""
        return self.tag is not None

    def draw(self) -> str:
        """``<tag>.<n>``: the n-th name drawn in this region."""
        self.drawn += 1
        return f"{self.tag}.{self.drawn - 1}"

    def next_operation_id(self, kind: str) -> str:
        """A name every process derives identically for its n-th operation of this kind
        (in a region that spans: its n-th of the region's)."""
        return f"fop/{kind}/{self.draw() if self.spans else next(_COUNTER)}"

    def session_nonce(self) -> str:
        """A random name shared by every process (the primary's, under one fixed key),
        agreed once per process lifetime at its first call, in the region that asks
        first; staging names derive from it and a counter with no coordination."""
        with _SESSION_LOCK:
            if not _SESSION:
                _SESSION.append(self.broadcast_str("fop/session", secrets.token_hex(4)))
            return _SESSION[0]

    def unique_name(self) -> str:
        """``<session>x<n>``: identical on every process for its n-th call (SPMD order;
        in a region that spans ``<session>x<region>y<n>``, its n-th of the region's)."""
        drawn = self.draw().replace(".", "y") if self.spans else next(_NAMES)
        return f"{self.session_nonce()}x{drawn}"

    @contextlib.contextmanager
    def resumed(self) -> Iterator[None]:
        """Runs the body as a part of this region's operation (named in the heartbeat;
        e.g. a save's background phase); an error leaving it is published. A region that
        spans nothing: nothing."""
        if not self.spans:
            yield
            return
        try:
            with _host.ACTIVITIES.doing(f"{self.kind} (operation {self.tag})"):
                yield
        except (SystemExit, GeneratorExit):  # a preempted run leaves together, on purpose
            raise
        except BaseException as e:
            _failures.publish_failure(self, e)
            raise


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
        _liveness.ensure_beating(_client(), jax.process_index())  # before any wait on us
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
