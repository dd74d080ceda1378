"""flax.serialization msgpack: the whole tree as one msgpack file.

It has no async API; the fair equivalent is used: the blocking phase is
``to_bytes`` (device-to-host copy plus serialization, in the caller's thread), the
background phase writes the bytes to one file and fsyncs it in a thread. Restore
reads the file, ``msgpack_restore`` and ``jax.device_put`` onto the target shardings.
Params only has to read the whole file: msgpack has no random access.
"""

from __future__ import annotations

import os
import threading

from common import get_path, nest


def _flatten(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v


class _Wait:
    def __init__(self, thread, err):
        self._t, self._err = thread, err

    def wait(self) -> dict:
        self._t.join()
        if self._err:
            raise self._err[0]
        return {}


class Adapter:
    name = "msgpack"
    harness_fsync = False  # writes one file and fsyncs it itself

    def __init__(self):
        from flax import serialization

        self.ser = serialization

    def save_async(self, path, tree):
        data = self.ser.to_bytes(tree)
        err: list = []

        def write():
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    mv = memoryview(data)
                    while mv:
                        mv = mv[os.write(fd, mv) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException as e:  # noqa: BLE001  (re-raised on wait())
                err.append(e)

        t = threading.Thread(target=write, daemon=True)
        t.start()
        return _Wait(t, err)

    def _load(self, path, like, prefix=()):
        import jax

        with open(path, "rb") as f:
            data = f.read()
        state = self.ser.msgpack_restore(data)
        del data
        if prefix:
            state = get_path(state, prefix)
        out = []
        for p, s in _flatten(like):
            out.append((p, jax.device_put(get_path(state, p), s.sharding)))
        return nest(out)

    def restore(self, path, like):
        return self._load(path, like)

    def restore_params(self, path, like_params):
        return self._load(path, like_params, prefix=("params",))
