"""flax_orbax_plugin through its public API (the library under test)."""

from __future__ import annotations


class _Wait:
    def __init__(self, handle):
        self._h = handle

    def wait(self) -> dict:
        r = self._h.wait()
        out = {}
        for k in ("blocking_seconds", "total_seconds", "bytes_written"):
            if hasattr(r, k):
                out["lib_" + k] = getattr(r, k)
        return out


class _ManagerSaver:
    def __init__(self, manager):
        self.manager = manager
        self.step = 0

    def save_async(self, path, tree):  # one manager step per save; path unused
        self.step += 1
        self.manager.save(self.step, tree)
        return self

    def wait(self) -> dict:
        self.manager.wait()
        return {}

    def reserve(self, tree) -> None:  # before the loop, as the callback's on_train_start
        reserve = getattr(self.manager, "reserve", None)  # older versions (A/B) have none
        if reserve is not None:
            reserve(tree)

    def close(self):
        self.manager.close()


class Adapter:
    name = "fop"
    harness_fsync = False  # durable on return (contract); the counted fsync pass finds little

    def __init__(self):
        import flax_orbax_plugin as fop

        self.fop = fop

    def save_async(self, path, tree):
        return _Wait(self.fop.save_async(path, tree))

    def train_saver(self, directory, *, keep=None, **options):
        """The training loop saves through a CheckpointManager with its defaults (or the
        manager ``options`` given), as a real loop does (its retention deletes old steps)."""
        return _ManagerSaver(self.fop.CheckpointManager(directory, keep=keep or None, **options))

    def restore(self, path, like):
        return self.fop.restore(path, like)

    def restore_params(self, path, like_params):
        return self.fop.restore(path, {"params": like_params}, partial=True)["params"]
