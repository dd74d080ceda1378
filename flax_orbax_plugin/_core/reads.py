"""How one pytree is read (:class:`ReadRequest`), its targets and claims checked, the
agreement of the processes of a collective read, and the pieces every read uses.

Threading: the restoring (calling) thread only.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.reads``.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from .._base import distributed as _distributed
from .._base import env as _env
from .._base import host as _host
from .._base import tree as _tree
from .._errors import (
    CheckpointError,
    CoordinationError,
    CorruptCheckpointError,
    StepDeletedError,
    StructureError,
)
from .._format import layout as _layout
from .._format import steps as _steps
from .._format.layout import (
    COMMIT_FILE,
    METADATA_FILE,
    ArrayStorage,
    BatchRecord,
    BatchStorage,
    CheckpointDocument,
    LeafRecord,
    array_dir,
    batch_dir,
)
from .._format.records import show
from .._like import onto_like as _onto_like
from .._like.onto_like import Changes, check_policy
from .._like.onto_like import describe as _describe
from .._storage.location import Location
from .._zarr import arrays as _arrays
from .._zarr import chunk_files as _chunk_files
from .._zarr import packed_reader as _packed_reader
from .._zarr import subbyte as _subbyte
from .._zarr.chunks import CHUNK_DIR

DEFAULT_READ_LIMIT_BYTES = 64 << 20  # reads in flight beyond the result: small, low peak memory


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """How one pytree is read (the options of ``fop.restore``, checked, plus what a
    manager adds).

    ``memory_limit_bytes``: reads in flight; ``cast``: ``"safe"`` (no cast that changes
    a value) or ``"unsafe"``; ``share_reads``: processes read a replicated leaf
    together (each its rows, then an all-gather; collective); ``own_copy``: a host's own
    directory (each process reads alone; an array read onto a sharded ``like`` holds
    only this host's chunks, so its claims are not checked against the whole array);
    ``changes``: a restore into a changed model (``partial``, ``missing``,
    ``transform``, ``surgery``); ``dry_run``: return the plan of the read
    (``RestorePlan``), reading no array data; ``region``: the collective operation the
    read is part of (``_base.distributed``; its processes agree on what they read),
    or one that spans nothing (one process, or a read one process may make alone).
    """

    memory_limit_bytes: int = DEFAULT_READ_LIMIT_BYTES
    cast: str = "safe"
    share_reads: bool = False
    own_copy: bool = False
    changes: Changes = Changes()
    dry_run: bool = False
    region: _distributed.Region = dataclasses.field(
        default_factory=lambda: _distributed.Region("read"), compare=False
    )

    def __post_init__(self):
        check_policy(self.cast)
        if self.own_copy and self.share_reads:
            raise ValueError("ReadRequest: a host's own copy is read alone (share_reads=False)")

    @classmethod
    def of_step(
        cls,
        *,
        own_copy: bool,
        changes: Changes | None,
        region: _distributed.Region,
        ceiling: int | None = None,
    ) -> ReadRequest:
        """The request of a manager step's items, in the manager restore's ``region``:
        each host's own directory is read by each process alone (no collective); else
        replicated leaves are read shared. ``ceiling``: the manager's host-memory ceiling
        in bytes (its reads in flight stay under it: ``read_limit``), or None."""
        share = not own_copy and _distributed.process_count() > 1
        changes = changes or Changes()
        limit = (
            DEFAULT_READ_LIMIT_BYTES if ceiling is None else min(DEFAULT_READ_LIMIT_BYTES, ceiling)
        )
        return cls(limit, share_reads=share, own_copy=own_copy, changes=changes, region=region)

    def replace(self, **fields: Any) -> ReadRequest:
        return dataclasses.replace(self, **fields)


def read_slice(store, direct: _packed_reader.PackedReader, batch: BatchRecord, off, size: int):
    """Elements ``[off, off + size)`` of a batch, through ``store``, else ``direct``."""
    dtype = _layout.dtype_from_name(batch.dtype)
    if store is not None:
        return ReadInto(store[off : off + size], dtype)
    chunk = int(batch.chunk)
    files = range(off // chunk, -(-(off + size) // chunk)) if size else range(0)
    sub, inner = batch_dir(batch.name), batch.inner
    read = direct.read_batch(sub, batch.size, chunk, inner, dtype, files)
    first = files.start * chunk if files else 0
    read.out = read.out[off - first : off - first + size]
    return read


def check_claims(
    location: Location,
    doc: CheckpointDocument,
    targets: list,
    *,
    own_copy: bool = False,
    packed: Any = None,
) -> None:
    """CorruptCheckpointError unless the data every target reads holds what the metadata
    claims (version 1: its chunk files, local disks only; 2: ``packed``'s indexes)."""
    if packed is None and not location.is_local:
        return
    where = f"{location}/{METADATA_FILE}"
    batches: dict[str, list[str]] = collections.defaultdict(list)
    for target in targets:
        storage = target.record.storage
        if isinstance(storage, BatchStorage):
            batches[storage.batch].append(target.record.path)
        if not isinstance(storage, ArrayStorage):
            continue
        if own_copy and getattr(target.like, "sharding", None) is not None:
            continue
        record = _subbyte.stored(target.record)  # as stored: a sub-byte leaf's packed bytes
        storage = record.storage
        itemsize = _layout.dtype_from_name(record.dtype, path=record.path).itemsize
        needed = _chunk_files.array_claim(
            record.shape, storage.chunk_shape, itemsize, compressed=storage.codec is not None
        )
        field = f"leaves[{target.index}] ({record.path!r})"
        sub = array_dir(target.index)
        claim = (".shape", record.shape, record.dtype)
        _check_claim(location, packed, sub, needed, where, field, claim)
    for name, paths in sorted(batches.items()):
        batch = doc.batches[name]
        itemsize = _layout.dtype_from_name(batch.dtype).itemsize
        needed = _chunk_files.batch_claim(
            batch.size, int(batch.chunk), batch.inner, itemsize, compressed=batch.codec is not None
        )
        shown = ", ".join(repr(p) for p in paths[:5]) + (" ..." if len(paths) > 5 else "")
        claim = (f".size (holding leaves {shown})", batch.size, batch.dtype)
        _check_claim(location, packed, batch_dir(name), needed, where, f"batches[{name!r}]", claim)


def _check_claim(location, packed, sub: str, needed, where: str, field: str, claim) -> None:
    """``claim``: (the size field's suffix, the size claimed, the dtype claimed)."""
    (size_field, size, dtype), (files, nbytes) = claim, needed
    stored = packed.dtypes.get(sub) if packed is not None else None  # an older index: none
    if stored is not None and stored != dtype:
        raise CorruptCheckpointError(
            f"{where}: field {field}.dtype: the metadata claims {dtype!r}, the data index "
            f"records the bytes under {sub} as {stored!r} (one of them is damaged)"
        )
    if files == 0:
        return
    if packed is None:
        found, found_bytes = _chunk_files.stored_files(location.path, sub)
        unit, under, listed = "chunk files", f"{location}/{sub}/{CHUNK_DIR}", "found"
    else:
        found, found_bytes = packed.claimed(sub)
        unit, under, listed = "chunks", sub, "the data indexes list"
    if found < files or found_bytes < nbytes:
        raise CorruptCheckpointError(
            f"{where}: field {field}{size_field}: {show(size)} "
            f"needs {files} {unit} of {nbytes} bytes in all under {under}, {listed} {found}"
            f"{' files' if packed is None else ''} of {found_bytes} bytes (stored data is "
            f"damaged or missing, or the metadata claims more than was stored)"
        )


try:  # private: the transfer jax.device_put makes per array (see _put_on_one_device)
    from jax._src import core as _jax_core
    from jax._src.lib import xla_client as _xla_client

    _direct_put = _xla_client.batched_device_put
except (ImportError, AttributeError):  # another jax: jax.device_put, as before
    _jax_core, _direct_put = None, None


@dataclasses.dataclass
class Target:
    index: int  # leaf number in the checkpoint
    record: LeafRecord
    like: Any
    dtype: np.dtype | None = None  # saved dtype
    out_dtype: Any = None
    result: Any = None
    cast: str = "safe"  # the read's cast policy (ReadRequest.cast)
    virtual: Any = None  # a leaf surgery made (``_like.surgery.Made``); ``record``: its stand-in


def make_target(index: int, record: LeafRecord, like: Any, *, cast: str) -> Target:
    path = record.path
    target = Target(index, record, like, cast=cast)
    if record.kind in _layout.EMPTY_KINDS:
        return _empty_target(target)
    if record.kind in _layout.TEXT_KINDS:
        return _text_target(target)
    if record.kind == "none":
        if like is not None and not _tree.is_empty_node(like):
            raise StructureError(
                f"leaf {path!r}: expected {_describe(like)} (from like), "
                f"found None in the checkpoint"
            )
        target.result = like  # None, or an empty node (EmptyState() saved as None: Orbax)
        return target
    target.dtype = _layout.dtype_from_name(record.dtype, path=path)
    saved_shape = record.shape
    if record.kind == "prng_key":
        _check_key_like(record, like)  # its shape is checked after wrapping
        return target
    if like is None:
        target.out_dtype = target.dtype
        return target
    like_shape, like_dtype = _onto_like.template_of(path, like)
    if _onto_like.is_key_dtype(like_dtype):
        raise StructureError(
            f"leaf {path!r}: expected a PRNG key array (from like), "
            f"found {record.dtype}{list(saved_shape)} in the checkpoint"
        )
    if like_shape != saved_shape:
        raise StructureError(
            f"leaf {path!r}: shape mismatch: expected {like_shape} (from like), "
            f"found {saved_shape} in the checkpoint"
        )
    target.out_dtype = np.dtype(like_dtype)
    sharding = getattr(like, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):  # one that cannot hold it: named here
        try:
            sharding.shard_shape(tuple(saved_shape))
        except ValueError as e:  # jax's IndivisibleError is one
            raise StructureError(
                f"leaf {path!r}: the sharding of like cannot hold its shape "
                f"{tuple(saved_shape)}: {e}"
            ) from None
    return target


def _text_target(target: Target) -> Target:
    """A str or bytes leaf: its value is in the record; ``like`` None or of its type."""
    value = _layout.text_value(target.record)
    like = target.like
    if like is not None and type(like) is not type(value):
        raise StructureError(
            f"leaf {target.record.path!r}: expected {_describe(like)} (from like), found a "
            f"{type(value).__name__} in the checkpoint"
        )
    target.result = value
    return target


def _empty_target(target: Target) -> Target:
    """An empty node ({}, [], EmptyState()): no data; the result is ``like`` itself."""
    like, kind = target.like, target.record.kind
    if like is not None and not _tree.is_empty_node(like):
        raise StructureError(
            f"leaf {target.record.path!r}: expected {_describe(like)} (from like), found an "
            f"empty {'list' if kind == 'empty_list' else 'node'} in the checkpoint"
        )
    target.result = _tree.empty_value(kind) if like is None else like
    return target


def add_missing_empties(flat: list, records: dict[str, tuple[int, LeafRecord]]) -> None:
    """Empty nodes of ``like`` an older checkpoint does not record: restored as in ``like``."""
    for path, keys, leaf in flat:
        if path not in records and _tree.is_empty_node(leaf):
            kind = _tree.empty_kind(leaf)
            records[path] = (-1, LeafRecord(path, tuple(tuple(k) for k in keys), kind))


def _check_key_like(record: Any, like: Any) -> None:
    """A saved PRNG key array restores only into a key of its own impl (no cast)."""
    if like is None:
        return
    shape, dtype = _onto_like.template_of(record.path, like)
    found = f"a PRNG key array of impl {record.impl!r} in the checkpoint"
    if not _onto_like.is_key_dtype(dtype):
        raise StructureError(
            f"leaf {record.path!r}: expected {dtype}{list(shape)} (from like), found {found}; "
            f"restore it into jax.random.key(0, impl={record.impl!r}), then take key_data(...)"
        )
    impl = getattr(getattr(dtype, "_impl", None), "name", None)
    if impl is not None and impl != record.impl:
        raise StructureError(
            f"leaf {record.path!r}: expected a PRNG key of impl {impl!r} (from like), "
            f"found {found}; a key of one impl cannot be read as another"
        )


def finish(target: Target, host: np.ndarray, placer: Placer) -> None:
    """Host data into ``target.result`` in its final form; device placement via ``placer``."""
    value = _final_value(target, host)
    if isinstance(value, tuple):  # (host, sharding): batched device_put
        placer.add(target, *value)
    else:
        target.result = value


def _final_value(target: Target, host: np.ndarray) -> Any:
    record, like = target.record, target.like
    kind = record.kind
    if isinstance(record.storage, BatchStorage) and record.storage.packed:
        host = _subbyte.unpack_flat(host, record)  # a sub-byte leaf's packed bytes
    host = host.reshape(record.shape)
    if kind == "prng_key":
        keys = jax.random.wrap_key_data(host, impl=record.impl)
        if like is not None:
            if tuple(like.shape) != keys.shape:
                raise StructureError(
                    f"leaf {record.path!r}: shape mismatch: expected {tuple(like.shape)} "
                    f"(from like), found {keys.shape} in the checkpoint"
                )
            sharding = getattr(like, "sharding", None)
            if sharding is not None:
                keys = jax.device_put(keys, sharding)
        return keys
    if host.dtype != target.out_dtype:
        _onto_like.check(record.path, host, target.out_dtype, cast=target.cast)
        host = host.astype(target.out_dtype)
    if like is None:  # a Python scalar saved: its type back
        convert = _PYTHON_KINDS.get(kind)
        return host if convert is None else convert(host[()])
    if isinstance(like, (bool, int, float, complex)):
        return type(like)(host[()])
    if isinstance(like, np.generic):
        return host[()]
    if isinstance(like, np.ndarray):
        return host
    sharding = like.sharding if isinstance(like, jax.Array) else getattr(like, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return (host, sharding)


class Placer:
    """Batches host-to-device transfers: one ``jax.device_put`` per ``flush_bytes``."""

    def __init__(self, flush_bytes: int):
        self.flush_bytes = flush_bytes
        self.pending: list[tuple[Target, np.ndarray, Any]] = []
        self.nbytes = 0

    def add(self, target: Target, host: np.ndarray, sharding: Any) -> None:
        self.pending.append((target, host, sharding))
        self.nbytes += host.nbytes
        if self.nbytes >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        # one call per sharding: no broadcast of shardings over the list (a third of the time)
        groups: dict[Any, list[tuple[Target, np.ndarray]]] = {}
        for target, host, sharding in self.pending:
            groups.setdefault(sharding, []).append((target, host))
        self.pending, self.nbytes = [], 0
        for sharding, items in groups.items():
            try:
                placed = _put(items, sharding)
            except (RuntimeError, TypeError, ValueError) as e:  # jax's: named by its leaf
                raise _unplaceable(items, sharding, e) from e
            for (target, _), array in zip(items, placed, strict=True):
                target.result = array


def _put(items: list[tuple[Target, np.ndarray]], sharding: Any) -> list[jax.Array]:
    one_device = isinstance(sharding, jax.sharding.SingleDeviceSharding)
    if _direct_put and one_device and sharding.memory_kind in (None, "device"):
        return _put_on_one_device([host for _, host in items], sharding)
    if sharding.is_fully_addressable:
        return jax.device_put([host for _, host in items], sharding)
    return [place(host, sharding) for _, host in items]


def _unplaceable(items: list, sharding: Any, error: Exception) -> Exception:
    """The leaf jax cannot place (float6 on CPU), named; else ``error``."""
    for target, host in items:
        try:
            _put([(target, host)], sharding)
        except (RuntimeError, TypeError, ValueError) as e:
            platform = next(iter(sharding.device_set)).platform
            return cannot_place(target.record.path, host.dtype, platform, e)
    return error


def cannot_place(path: str, dtype: Any, platform: str, error: Exception) -> StructureError:
    """Leaf ``path``'s ``dtype`` jax refused to place on ``platform``, for every reader."""
    return StructureError(
        f"leaf {path!r}: jax cannot place a {dtype} array on {platform} "
        f"({' '.join(str(error).split())[:200]}); read it to the host (numpy in like, or like=None)"
    )


def _put_on_one_device(hosts: list[np.ndarray], sharding: Any) -> list[jax.Array]:
    """``jax.device_put``'s own call without its per-array dispatch (~70 us, here ~25)."""
    device = next(iter(sharding.device_set))
    avals: dict[tuple, Any] = {}
    out = []
    for host in hosts:
        key = (host.shape, host.dtype)
        aval = avals.get(key)
        if aval is None:
            # a dtype jax would change (float64 with x64 off): jax.device_put's own way
            same = jax.dtypes.canonicalize_dtype(host.dtype) == host.dtype
            aval = avals[key] = _jax_core.ShapedArray(host.shape, host.dtype) if same else False
        if aval is False:
            out.append(jax.device_put(host, sharding))
        else:
            out.append(_direct_put(aval, sharding, [host], [device], True))
    return out


def place(host: np.ndarray, sharding: Any) -> jax.Array:
    """``host`` placed from this process's shards alone: no collective."""
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


_SCALAR = {"py_int": int, "py_float": float, "py_bool": bool, "py_complex": complex}
_PYTHON_KINDS = _SCALAR | {"np_scalar": lambda value: value}  # the rest: the array itself


def sharding_of(target: Target) -> Any:
    like = target.like
    if target.record.kind == "prng_key" or not isinstance(like, (jax.Array, jax.ShapeDtypeStruct)):
        return None
    return getattr(like, "sharding", None)


def deleted_or(location: Location, error: Exception) -> Exception:
    """``error``, or a StepDeletedError when the commit marker is gone (retention)."""
    try:
        if location.exists(COMMIT_FILE) or location.parent.exists(_layout.MANIFEST_FILE):
            return error
    except (CheckpointError, OSError):  # a foreign marker, or unknown: not a deletion
        return error
    deleted = StepDeletedError(
        f"{location} was deleted while it was being read (a writer's retention policy "
        f"removes old steps; restore a newer step, or keep more): {error}"
    )
    deleted.__cause__ = error
    return deleted


def step_deleted_or(directory: Location, step: int, error: Exception) -> Exception:
    """``error``, or a StepDeletedError when ``step`` of ``directory`` is no longer committed."""
    try:  # listed afresh: another process may have deleted it
        if isinstance(error, StepDeletedError) or step in _steps.committed_steps(directory):
            return error
    except CheckpointError:
        return error
    return StepDeletedError(
        f"step {step} of {directory} was deleted while it was being read (a writer's "
        f"retention policy removes old steps; restore a newer step, or keep more): {error}"
    )


class ReadInto:
    """A read straight into a new numpy array (no second whole-array buffer)."""

    def __init__(self, view, dtype: np.dtype | None = None):  # dtype: the leaf's
        stored = view.dtype.numpy_dtype
        self.out = _host.empty(view.shape, dtype or stored)  # adopted by jax on CPU
        into = _arrays.as_stored(self.out, stored)
        self.future = ts.array(into, copy=False).write(view)

    def result(self) -> np.ndarray:
        self.future.result()
        return self.out


class Reader:
    """Issues tensorstore reads in order, keeping at most ``limit`` bytes in flight."""

    def __init__(self, limit: int, progress: _host.Progress | None = None):
        self.limit = limit
        self.progress = progress or _host.Progress()  # the bytes read, and asked for
        self.placer = Placer(flush_bytes=min(limit, 16 << 20))  # placed while more is read
        self.pending: collections.deque = collections.deque()
        self.in_flight = 0

    def submit(self, future, nbytes: int, on_done, on_error) -> None:
        if getattr(future, "deferred", False):  # starts when waited for: holds nothing yet
            nbytes = 0
        self.pending.append((future, nbytes, on_done, on_error))
        self.in_flight += nbytes
        self.progress.total += nbytes
        self.drain(self.limit)

    def drain(self, to: int = 0) -> None:
        while self.pending and (self.in_flight > to or to == 0):  # zero-byte reads too
            future, nbytes, on_done, on_error = self.pending.popleft()
            self.in_flight -= nbytes
            try:
                data = future.result()
                self.progress.done += nbytes
                if self.progress.done == nbytes > 0:  # the first bytes read
                    _env.pause_point("mid_read")  # tests: a slow restore (FOP_PAUSE_AT)
                _env.slow_point("read")  # tests: a slow but progressing read
            except Exception as e:  # noqa: BLE001  (tensorstore: ValueError with a status text)
                raise_environmental(e)
                on_error(e)
                continue
            on_done(data)


def raise_environmental(error: Exception) -> None:
    """Raises the OSError ``error`` stands for when it is no proof of damage (EMFILE, EIO)."""
    env = _arrays.environmental(error)
    if env is error:
        raise error
    if env is not None:
        raise env from error


def corrupt(paths: list[str], location: Location, error: Exception) -> CorruptCheckpointError:
    shown = ", ".join(repr(p) for p in paths[:20]) + (" ..." if len(paths) > 20 else "")
    noun = "leaf" if len(paths) == 1 else "leaves"
    error = str(error).split(" [tensorstore_spec=", 1)[0]
    return CorruptCheckpointError(
        f"{noun} {shown} in {location}: stored data is damaged or missing ({error})"
    )


def opened(future, location: Location, paths: list[str]):
    """A stored array opened; a ``zarr.json`` at odds with the metadata names the leaves."""
    try:
        return future.result()
    except ValueError as e:
        raise_environmental(e)
        raise corrupt(paths, location, e) from None


def plain_read(index: int, record: Any, direct: Any, region: Any):
    """Whole chunks of an uncompressed array straight from the reader, else None."""
    if direct is None or record.storage.codec is not None:
        return None
    dtype = _layout.dtype_from_name(record.dtype, path=record.path)
    sub = array_dir(index)
    return direct.read(sub, record.shape, record.storage.chunk_shape, dtype, region)


# -- the processes of a collective read agree on what they read, before any byte --------

_SHOWN_LEAVES = 4000  # leaves named in the second round (a digest beyond them)


def agree_on_read(location: Location, like: Any, request: ReadRequest) -> None:
    """CoordinationError on every process unless all read the same path, options and like.
    Threading: the caller's, the same call on every process (inside the collective)."""
    flat = [] if like is None else _tree.flatten(like)[0]
    leaves = [f"{path} {_placed(leaf)}" for path, _, leaf in flat]
    mine = {
        "checkpoint": str(location),
        "options": f"cast={request.cast!r}, {request.changes.describe()}",
        "like": _layout.sha256("\n".join(leaves).encode()),
    }
    views = request.region.gather_json("read-agreement", mine)
    for field in ("checkpoint", "options", "like"):
        values = [v[field] for v in views]
        if len(set(values)) == 1:
            continue
        if field == "like":
            raise CoordinationError(_like_difference(leaves, request.region))
        each = "; ".join(f"{v!r} on process {p}" for p, v in enumerate(values))
        raise CoordinationError(
            f"the processes of one collective restore read different {field}s ({each}): "
            f"every process must pass the same path, step and options"
        )


def _placed(leaf: Any) -> str:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        return type(leaf).__name__  # a Python scalar, a string, None: no array to place
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        placed = f"{dict(sharding.mesh.shape)} {sharding.spec}"
    else:  # a host array, or one device's (a process's own): not compared across
        placed = "host" if isinstance(leaf, np.ndarray) else "local"
    return f"{list(shape)} {dtype} {placed}"


def _like_difference(leaves: list[str], region: _distributed.Region) -> str:
    """The message for likes that differ (a second round: every process names its leaves)."""
    views = region.gather_json("read-agreement-leaves", leaves[:_SHOWN_LEAVES])
    first = views[0]
    for p, other in enumerate(views[1:], start=1):
        for a, b in zip(first, other, strict=False):
            if a != b:
                return (
                    f"the processes of one collective restore passed different likes: the "
                    f"first leaf that differs is {a!r} on process 0 and {b!r} on process "
                    f"{p}; every process must pass the same tree, shapes, dtypes and "
                    f"shardings (jax.eval_shape of one state, one mesh)"
                )
        if len(first) != len(other):
            return (
                f"the processes of one collective restore passed different likes: "
                f"{len(first)} leaves on process 0, {len(other)} on process {p}"
            )
    return (
        f"the processes of one collective restore passed different likes (past their "
        f"first {_SHOWN_LEAVES} leaves)"
    )
