"""The other public fronts of a core save: :func:`save_async` and :func:`is_committed`;
the save runs as ``_core.save`` describes.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._core.save``.
"""

from __future__ import annotations

from typing import Any

from .._base import distributed as _distributed
from .._base.distributed import public
from .._format.layout import COMMIT_FILE
from .._storage.location import Location
from .._storage.store_errors import arguments, refusals
from .formats import DEFAULT_FORMAT_VERSION
from .handle import SaveHandle
from .save import start_save


@public("save", errors=refusals(arguments("path")))
def save_async(
    path: Any,
    tree: Any,
    *,
    region: _distributed.Region,
    force: bool = False,
    memory_limit_bytes: int | None = None,
    compression: str | None = None,
    format_version: int | None = DEFAULT_FORMAT_VERSION,
    data_file_bytes: int | None = None,
    host_memory_budget: int | None = None,
) -> SaveHandle:
    """Starts saving ``tree`` to ``path``; returns once the tree is snapshotted to host.

    Args:
      path: a local directory, an ``s3://``/``gs://`` URL or a tensorstore kvstore spec.
        It must not hold a committed checkpoint unless ``force``.
      tree: dicts, lists, tuples, NamedTuples, registered dataclasses; leaves are
        jax.Arrays (any sharding), numpy arrays, numpy or Python scalars, typed PRNG
        key arrays, or None.
      force: replace a committed checkpoint at ``path``.
      memory_limit_bytes: bound on bytes handed to tensorstore and not yet written.
      compression: None, or ``"zstd"`` / ``"zstd:<level 1-22>"``: every chunk is
        compressed before its checksum (zarr3 ``zstd`` codec; recorded per array, so
        restore needs no option).
      format_version: 2 (default, also None: each process packs its chunks into a few
        data files, see FORMAT.md) or 1 (one file per chunk; readable forever).
      data_file_bytes: version 2: the size a data file does not pass unless one chunk
        is larger (default 1 GiB on a filesystem, 256 MiB on an object store);
        refused with version 1.
      host_memory_budget: bytes of host memory the save may hold beyond the state
        itself (None: no bound). Accelerator arrays are copied on their devices (one
        more state of device memory until written) and to host in pieces as the
        writes complete (the blocking phase enqueues the device copies only). CPU
        arrays are written from their own memory before this returns (no copy at
        all; the blocking phase is then the data write). Small leaves (batched) are
        copied as usual. Both format versions stream; version 2 on an object store
        gathers each data file in memory before its upload, made smaller under a
        budget (docs/saving.md, section 3).

    Returns:
      A :class:`SaveHandle`; ``handle.wait()`` returns a :class:`SaveResult`.
    """
    given = {k: v for k, v in locals().items() if k not in ("path", "tree", "region")}
    return start_save(path, tree, region, given)


@public(errors=refusals(arguments("path")))
def is_committed(path: Any) -> bool:
    """True when ``path`` holds a committed standalone checkpoint. A store that
    answers "not there" for a bucket it lacks (S3 reads a missing bucket's key as
    missing) is listed before False is said: StoreAccessError for no such bucket."""
    location = Location.from_path(path)
    if location.exists(COMMIT_FILE):
        return True
    if not location.is_local:
        location.is_dir()  # a listing: a missing bucket or a refusal raises here
    return False
