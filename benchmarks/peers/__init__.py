"""Library adapters: one small module per library, all with the same three calls.

The worker calls, in one process and in this order, either
``save_async(path, tree)`` then ``.wait()`` on what it returns, or
``restore(path, like)`` or ``restore_params(path, like_params)``. ``tree`` is a nested
dict of ``jax.Array``; ``like`` the same structure of ``jax.ShapeDtypeStruct`` with
shardings. Every restore returns ``jax.Array`` leaves placed as ``like`` says, so each
library does the same work end to end.

``harness_fsync``: True where the library does not itself guarantee that a finished
save is durable (recorded for the notes). The worker runs one fsync pass over what
every library (and the raw rows) wrote after each save and counts it in the durable
save time alike, so a library that is durable on return pays only a residual pass.
"""

from __future__ import annotations

import importlib

LIBRARIES = ("fop", "orbax", "dcp", "msgpack")
LABELS = {
    "raw": "raw limit (1 file, parallel pwrite/preadv, 1 fsync)",
    "raw1": "raw, one sequential stream",
    "fop": "flax_orbax_plugin",
    "orbax": "orbax-checkpoint",
    "dcp": "torch.distributed.checkpoint",
    "msgpack": "flax.serialization msgpack",
}
_MODULES = {"fop": "fop", "orbax": "orbax_ckpt", "dcp": "torch_dcp", "msgpack": "flax_msgpack"}


def get_adapter(name: str):
    mod = importlib.import_module(f"peers.{_MODULES[name]}")
    return mod.Adapter()
