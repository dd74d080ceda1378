"""Pathways (single-controller JAX): detected, and refused with a message naming it.

The library is built on JAX's multi-controller runtime: one process per host, each
writing and reading only the shards its own devices hold, agreeing through
``jax.distributed``'s coordination service. Under Pathways one Python process (the
controller) drives the devices of every host through a proxy backend
(``JAX_PLATFORMS=proxy``, set up by ``pathwaysutils``); ``jax.process_count()`` is 1
and every device looks addressable. A save would then move every shard of every host
through the controller's memory and write it from that one process: the per-host
parallel writes, the host-memory budget per host and the per-host tiers would not
hold as documented, and none of it has been run (no Pathways cluster here).

So a save or restore under Pathways raises :class:`UnsupportedRuntimeError` naming it,
at the front of each collective operation (``_base.regions.collective``: ``fop.save``,
``fop.save_async``, ``fop.restore``, ``fop.restore_params``, a manager's open, save,
restore, delete and wait). ``FOP_PATHWAYS=allow`` lets it run as one process
(untested; every byte through the controller host). Reads of JSON and metadata
(``fop.metadata``, ``fop.verify``, the command line) touch no device and are not refused.

Detection (:func:`detected`): ``jax.config.jax_platforms`` names the ``proxy``
platform (the way ``pathwaysutils`` itself tells), or the initialised default backend's
platform is ``proxy``. Pure reads; any thread.
"""

from __future__ import annotations

import sys

import jax

from .._errors import UnsupportedRuntimeError
from . import env as _env

__all__ = ["detected", "refuse_if_detected"]

PROXY = "proxy"  # the platform name of the IFRT proxy backend Pathways runs behind


def detected() -> str | None:
    """How Pathways was recognised (words for the message), or None."""
    platforms = jax.config.jax_platforms or ""
    if PROXY in [p.strip() for p in platforms.split(",")]:
        return f"jax_platforms is {platforms!r}"
    bridge = sys.modules.get("jax._src.xla_bridge")  # only a backend already made
    backends = getattr(bridge, "_backends", None) or {}
    if PROXY in backends:
        return "the proxy backend is initialised"
    return None


def refuse_if_detected(operation: str) -> None:
    """UnsupportedRuntimeError when Pathways is detected (unless ``FOP_PATHWAYS=allow``)."""
    how = detected()
    if how is None or _env.read("FOP_PATHWAYS") == "allow":
        return
    raise UnsupportedRuntimeError(
        f"{operation}: Pathways (single-controller JAX) detected ({how}), which "
        f"flax_orbax_plugin does not support: it writes and reads each host's shards from "
        f"that host's own process (multi-controller JAX, jax.distributed.initialize on "
        f"every host). Run one process per host, or use Orbax with pathwaysutils' "
        f"persistence under Pathways; FOP_PATHWAYS=allow runs it as one process anyway "
        f"(untested: every shard passes through the controller's host memory)"
    )
