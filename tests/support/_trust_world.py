"""Worlds for ``test_trust_properties``: one checkpoint directory on one store, seeded
with entries the library did not create, and fingerprints of everything it must leave
alone.

A world is a fresh place per hypothesis example:

* ``LocalWorld``: ``<root>/run`` on local disk;
* ``ObjectWorld``: ``<bucket>/<prefix>/exN/run`` on the S3 server or the GCS emulator
  (``tests/support/_servers.py``), plus a local ``<root>`` for what lives on disk whatever the
  store (the export target, msgpack sources, the local tier of a two-tier manager).

What a world holds beside the directory under test (``dir``), all "outside" it:
``outside/sentinel.txt``, ``outside/target.txt`` (what ``link_out`` points at),
``export/`` with a user's ``config.json``, ``tokenizer.json`` and a sub-folder, and a
sibling ``run-sibling/1/...`` plus ``runx`` whose names start like the directory's (a
removal by string prefix would reach them).

Foreign entries seeded into ``dir`` (every store): ``notes.txt``, ``data/``,
``2024/`` (digits, no manifest), ``007/`` (zero-padded), ``orbax_run/`` (a real
Orbax run, written once per session and copied), ``4/`` (a real Orbax step where our
step 4 would go), ``core/`` (``fop.save``). Local disk only: ``link_in -> data``,
``link_out -> <root>/outside/target.txt``, ``9 -> data`` (a digits-named symlink)
and the FIFO ``pipe`` (never opened: fingerprints use ``lstat``).

``OsFault`` is the environmental fault injector: from its N-th call made by package
code (a frame of ``flax_orbax_plugin``), one ``os`` function raises ``OSError`` with a
given errno (EMFILE, EIO, ENOSPC) until the ``with`` block ends; calls from anywhere
else (pytest, hypothesis, the servers, this module) are untouched.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np

import flax_orbax_plugin as fop

EXPORT_FOREIGN = {"config.json": b'{"model_type": "mine"}\n', "tokenizer.json": b"{}\n"}
CORE_TREE = {"k": np.arange(5, dtype=np.float32), "z": np.float32(-0.0)}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint_path(path: str) -> tuple:
    """What is at ``path``, never following a link nor opening a special file."""
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return ("link", os.readlink(path))
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            return ("file", mode, _sha(f.read()))
    if stat.S_ISDIR(st.st_mode):
        return (
            "dir",
            mode,
            tuple((n, fingerprint_path(os.path.join(path, n))) for n in sorted(os.listdir(path))),
        )
    if stat.S_ISFIFO(st.st_mode):
        return ("fifo", mode)
    return ("other", st.st_mode)


_ORBAX_TEMPLATE: str | None = None


def orbax_template() -> str:
    """A real Orbax manager directory holding step 1, written once per process."""
    global _ORBAX_TEMPLATE
    if _ORBAX_TEMPLATE is None:
        import orbax.checkpoint as ocp

        root = os.path.join(tempfile.mkdtemp(prefix="fop-orbax-template-"), "orbax_run")
        with ocp.CheckpointManager(root) as mngr:
            tree = {"w": np.arange(4, dtype=np.float32), "b": np.ones(2, np.float32)}
            mngr.save(1, args=ocp.args.StandardSave(tree))
            mngr.wait_until_finished()
        _ORBAX_TEMPLATE = root
    return _ORBAX_TEMPLATE


def files_under(root: str) -> dict[str, bytes]:
    """{relative path: bytes} of every file under ``root`` (to prove it is untouched)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = f.read()
    return out


class _LocalSide:
    """What every world keeps on local disk, outside the directory under test."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True)
        self.outside = self.root / "outside"
        self.outside.mkdir()
        (self.outside / "sentinel.txt").write_bytes(b"do not touch\n")
        (self.outside / "target.txt").write_bytes(b"the target of link_out\n")
        self.export_dir = self.root / "export"
        self.export_dir.mkdir()
        for name, data in EXPORT_FOREIGN.items():
            (self.export_dir / name).write_bytes(data)
        (self.export_dir / "user_sub").mkdir()
        (self.export_dir / "user_sub" / "keep.txt").write_bytes(b"mine\n")
        self.tier_dir = self.root / "localtier"

    def local_outside(self) -> dict:
        """Fingerprints of the local side: ``outside/`` whole, the export folder's
        foreign entries, and the root's names (the library creates nothing else there)."""
        fp = {"outside": fingerprint_path(str(self.outside))}
        for name in [*EXPORT_FOREIGN, "user_sub"]:
            p = self.export_dir / name
            fp[f"export/{name}"] = fingerprint_path(str(p)) if os.path.lexists(p) else None
        return fp

    def root_names(self) -> set[str]:
        return set(os.listdir(self.root))


class LocalWorld(_LocalSide):
    store = "local"
    supports_links = True

    def __init__(self, root: Path):
        super().__init__(root)
        self.dir = self.root / "run"
        self.dir.mkdir()
        sib = self.root / "run-sibling" / "1"
        sib.mkdir(parents=True)
        (sib / "file.bin").write_bytes(b"sibling\n")
        (self.root / "runx").write_bytes(b"prefix twin\n")

    @property
    def arg(self) -> str:
        return str(self.dir)

    def child(self, name: str) -> str:
        return str(self.dir / name)

    def seed(self) -> None:
        d = self.dir
        (d / "notes.txt").write_bytes(b"my notes\n")
        (d / "data").mkdir()
        (d / "data" / "file.bin").write_bytes(b"\x00user data\xff")
        (d / "2024").mkdir()
        (d / "2024" / "results.csv").write_bytes(b"a,b\n1,2\n")
        (d / "007").mkdir()
        (d / "007" / "bond.txt").write_bytes(b"shaken\n")
        os.symlink("data", d / "link_in")
        os.symlink(str(self.outside / "target.txt"), d / "link_out")
        os.symlink("data", d / "9")
        os.mkfifo(d / "pipe")
        shutil.copytree(orbax_template(), d / "orbax_run", symlinks=True)
        shutil.copytree(os.path.join(orbax_template(), "1"), d / "4", symlinks=True)
        fop.save(self.child("core"), CORE_TREE)

    def names(self) -> list[str]:
        return sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []

    def fingerprint(self, name: str):
        p = self.dir / name
        return fingerprint_path(str(p)) if os.path.lexists(p) else None

    def snapshot(self, foreign) -> tuple[list[str], dict, dict]:
        """(names in dir, fingerprints of the ``foreign`` names, outside fingerprint)."""
        return self.names(), {n: self.fingerprint(n) for n in foreign}, self.outside_fingerprint()

    def outside_fingerprint(self) -> dict:
        fp = self.local_outside()
        fp["run-sibling"] = fingerprint_path(str(self.root / "run-sibling"))
        fp["runx"] = fingerprint_path(str(self.root / "runx"))
        return fp


class MemoryLocation:
    """A prefix of the in-process ``memory://`` store, shaped like the servers'
    ``ObjectStoreLocation`` (``scheme``, ``url``, ``join``, ``kvstore``). Its kvstore
    shares the library's tensorstore context, which is where ``memory://`` data lives."""

    def __init__(self, bucket: str | None = None, prefix: str = ""):
        self.scheme = "memory"
        self.bucket = bucket or f"trust-{uuid.uuid4().hex[:10]}"
        self.prefix = prefix.strip("/")

    @property
    def url(self) -> str:
        return f"memory://{self.bucket}/{self.prefix}"

    def join(self, *parts: str) -> MemoryLocation:
        prefix = "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))
        return MemoryLocation(self.bucket, prefix)

    def kvstore(self):
        import tensorstore as ts

        from flax_orbax_plugin._storage.contexts import context

        path = f"{self.bucket}/{self.prefix}/" if self.prefix else f"{self.bucket}/"
        spec = {"driver": "memory", "path": path}
        return ts.KvStore.open(spec, context=context(local=False)).result()


class ObjectWorld(_LocalSide):
    """A prefix on an object store (an ``ObjectStoreLocation`` of tests/support/_s3_server.py)."""

    supports_links = False

    def __init__(self, root: Path, location):
        super().__init__(root)
        self.store = location.scheme
        self.base = location.join(f"ex-{uuid.uuid4().hex[:10]}")
        self.loc = self.base.join("run")
        self._kv = self.base.kvstore()
        self._put("run-sibling/1/file.bin", b"sibling\n")
        self._put("runx", b"prefix twin\n")
        self._put("sentinel.txt", b"do not touch\n")

    def _put(self, key: str, data: bytes) -> None:
        self._kv.write(key, data).result()

    @property
    def arg(self) -> str:
        return self.loc.url

    def child(self, name: str) -> str:
        return self.loc.join(name).url

    def seed(self) -> None:
        self._put("run/notes.txt", b"my notes\n")
        self._put("run/data/file.bin", b"\x00user data\xff")
        self._put("run/2024/results.csv", b"a,b\n1,2\n")
        self._put("run/007/bond.txt", b"shaken\n")
        for rel, data in files_under(orbax_template()).items():
            self._put(f"run/orbax_run/{rel}", data)
            if rel.startswith("1/"):
                self._put(f"run/4/{rel[2:]}", data)
        fop.save(self.child("core"), CORE_TREE)

    def _keys(self) -> list[str]:
        return sorted(k.decode() for k in self._kv.list().result())

    def _read(self, key: str) -> bytes:
        r = self._kv.read(key).result()
        return r.value if r.state == "value" else b"<missing>"

    @staticmethod
    def _top(key: str) -> str | None:
        return key[4:].split("/", 1)[0] if key.startswith("run/") else None

    def names(self) -> list[str]:
        return sorted({t for k in self._keys() if (t := self._top(k)) is not None})

    def fingerprint(self, name: str):
        return self.snapshot([name])[1][name]

    def outside_fingerprint(self) -> dict:
        return self.snapshot([])[2]

    def snapshot(self, foreign) -> tuple[list[str], dict, dict]:
        """One listing, then every key of the ``foreign`` names and every key outside
        ``run/`` read concurrently: (names in dir, {name: ((key, sha256), ...) or None},
        outside fingerprint)."""
        keys = self._keys()
        wanted = set(foreign)
        chosen = [k for k in keys if self._top(k) is None or self._top(k) in wanted]
        reads = [(k, self._kv.read(k)) for k in chosen]
        shas = {}
        for k, fut in reads:
            r = fut.result()
            shas[k] = _sha(r.value) if r.state == "value" else "<missing>"
        per_name = {n: [] for n in wanted}
        for k in chosen:
            if (t := self._top(k)) is not None:
                per_name[t].append((k, shas[k]))
        fps = {n: tuple(v) or None for n, v in per_name.items()}
        outside = self.local_outside()
        outside["keys"] = tuple((k, shas[k]) for k in chosen if self._top(k) is None)
        names = sorted({t for k in keys if (t := self._top(k)) is not None})
        return names, fps, outside


class OsFault:
    """From the ``nth`` call on that package code makes to ``os.<func>``, raise
    ``OSError(err)``; see the module docstring. Use as a context manager, from one
    thread (the patch is process-wide while it lasts, but fires only for package frames)."""

    def __init__(self, func: str, err: int, nth: int):
        self.func, self.err, self.nth = func, err, nth
        self.calls = 0
        self.fired = 0
        self._real = None

    def __repr__(self) -> str:
        return f"OsFault(os.{self.func}, {errno.errorcode[self.err]}, from call {self.nth})"

    def __enter__(self) -> OsFault:
        real = getattr(os, self.func)
        self._real = real

        def faulty(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("flax_orbax_plugin"):
                self.calls += 1
                if self.calls >= self.nth:
                    self.fired += 1
                    raise OSError(self.err, f"{os.strerror(self.err)} (injected at os.{self.func})")
            return real(*args, **kwargs)

        setattr(os, self.func, faulty)
        return self

    def __exit__(self, *exc) -> None:
        setattr(os, self.func, self._real)
