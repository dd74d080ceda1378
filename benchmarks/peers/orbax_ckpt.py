"""orbax-checkpoint with its recommended API: StandardCheckpointer (async by default).

Save: ``StandardCheckpointer.save`` returns after the blocking phase, then
``wait_until_finished``. Restore: ``restore(path, abstract_tree)`` straight onto the
target shardings. Params only: ``PyTreeCheckpointHandler`` with
``PyTreeRestore(partial_restore=True)``. Durability: orbax writes array data through
tensorstore (which fsyncs files by default) but not every metadata file is fsynced,
so the harness fsyncs the whole directory after the save and counts it.
"""

from __future__ import annotations


class _Wait:
    def __init__(self, ckptr):
        self._c = ckptr

    def wait(self) -> dict:
        self._c.wait_until_finished()
        return {}


class Adapter:
    name = "orbax"
    harness_fsync = True

    def __init__(self):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.ckptr = ocp.StandardCheckpointer()

    def save_async(self, path, tree):
        self.ckptr.save(path, tree)
        return _Wait(self.ckptr)

    def restore(self, path, like):
        return self.ckptr.restore(path, like)

    def restore_params(self, path, like_params):
        ocp = self.ocp
        item = {"params": like_params}
        ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
        args = ocp.args.PyTreeRestore(
            item=item,
            restore_args=ocp.checkpoint_utils.construct_restore_args(item),
            partial_restore=True,
        )
        return ckptr.restore(path, args=args)["params"]
