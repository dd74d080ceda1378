"""torch.distributed.checkpoint (DCP), single process, no process group.

The jax tree becomes a flat ``{"params/layer_00/...": torch.Tensor}`` state dict over
the same numpy data (``torch.from_numpy`` of the host copy; for sharded arrays that
gathers the global array, which is what a single-process DCP user has to do). That
conversion counts in the blocking phase. Save: ``dcp.async_save`` (stages a copy,
then writes in a thread) with ``FileSystemWriter(sync_files=True, thread_count=2)``
(fsyncs its files). Restore: preallocated tensors, ``dcp.load`` in place, then
``jax.device_put`` onto the target sharding (counted). Params only: a state dict
holding only the params keys.
"""

from __future__ import annotations

import warnings

import numpy as np
from common import flat_key, nest


def _flatten(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v


class _Wait:
    def __init__(self, fut):
        self._f = fut

    def wait(self) -> dict:
        f = self._f
        if hasattr(f, "upload_completion"):  # AsyncSaveResponse
            f.upload_completion.result()
        else:
            f.result()
        return {}


class Adapter:
    name = "dcp"
    harness_fsync = False  # FileSystemWriter(sync_files=True) fsyncs; the pass finds little

    def __init__(self):
        import torch
        import torch.distributed.checkpoint as dcp

        warnings.filterwarnings("ignore")
        self.torch = torch
        self.dcp = dcp
        torch.set_num_threads(2)

    def _to_state_dict(self, tree):
        sd = {}
        for path, x in _flatten(tree):
            a = np.asarray(x)  # host view (1 device) or gathered copy (sharded)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sd[flat_key(path)] = self.torch.from_numpy(a) if a.ndim else self.torch.tensor(a)
        return sd

    def save_async(self, path, tree):
        sd = self._to_state_dict(tree)
        writer = self.dcp.FileSystemWriter(path, sync_files=True, thread_count=2)
        fut = self.dcp.async_save(sd, storage_writer=writer, no_dist=True)
        return _Wait(fut)

    def _load(self, path, like, prefix=()):
        import jax

        torch = self.torch
        leaves = list(_flatten(like, prefix))
        sd = {
            flat_key(p): torch.empty(s.shape, dtype=getattr(torch, np.dtype(s.dtype).name))
            for p, s in leaves
        }
        self.dcp.load(sd, storage_reader=self.dcp.FileSystemReader(path), no_dist=True)
        out = [
            (p[len(prefix) :], jax.device_put(sd.pop(flat_key(p)).numpy(), s.sharding))
            for p, s in leaves
        ]
        return nest(out)

    def restore(self, path, like):
        return self._load(path, like)

    def restore_params(self, path, like_params):
        return self._load(path, like_params, prefix=("params",))
