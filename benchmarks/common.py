"""Shared pieces of the benchmarks: workload trees, the raw limit, and measurement.

Who calls what: the drivers (``bench_core.py``, ``bench_peers.py``) never touch a
checkpoint themselves. They start ``worker.py`` once per measured operation, in a
fresh process, so peak RSS and bytes read belong to one library and one operation.
The worker uses the tree generators and measurement helpers below.

Trees are described as a list of :class:`LeafSpec` (path, shape, dtype, seed), so a
worker can build the real arrays (save), an abstract ``like`` tree (restore) or
check a restored tree leaf by leaf without holding two copies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
TMP = os.path.join(RESULTS, "tmp")

# --------------------------------------------------------------------------- trees

WORKLOADS = {
    "a": "~1.2 GB training state: transformer-shaped float32 params + Adam mu/nu",
    "b": "~6,000 small float32 arrays, ~200 MB",
    "c": "(a) sharded over 8 CPU devices on a 2x4 mesh; restored onto 4x2 and 1 device",
}


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    seed: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def make(self) -> np.ndarray:
        rng = np.random.default_rng(list(self.seed))
        if np.dtype(self.dtype).kind == "f":
            return rng.random(self.shape, dtype=np.float32).astype(self.dtype, copy=False)
        return rng.integers(0, 1000, self.shape).astype(self.dtype)


def _transformer_params(d=1024, layers=6, vocab=25600, ff=4096):
    shapes = [(("embed", "table"), (vocab, d))]
    for i in range(layers):
        blk = f"layer_{i:02d}"
        for n in ("q", "k", "v", "o"):
            shapes.append(((blk, "attn", n, "kernel"), (d, d)))
        for ln in ("ln1", "ln2"):
            shapes.append(((blk, ln, "scale"), (d,)))
            shapes.append(((blk, ln, "bias"), (d,)))
        shapes.append(((blk, "mlp", "fc1", "kernel"), (d, ff)))
        shapes.append(((blk, "mlp", "fc1", "bias"), (ff,)))
        shapes.append(((blk, "mlp", "fc2", "kernel"), (ff, d)))
        shapes.append(((blk, "mlp", "fc2", "bias"), (d,)))
    shapes.append((("final_ln", "scale"), (d,)))
    shapes.append((("final_ln", "bias"), (d,)))
    return shapes


def _small_params(n=2000, groups=20):
    rng = np.random.default_rng(1234)
    shapes = []
    per = n // groups
    for g in range(groups):
        for j in range(per):
            if j % 4 == 3:
                shape = (int(rng.integers(512, 12288)),)
            else:
                shape = (int(rng.integers(32, 192)), int(rng.integers(32, 128)))
            shapes.append(((f"group_{g:02d}", f"leaf_{j:03d}"), shape))
    return shapes


# FOP_BENCH_SIZE=tiny (the drivers' --tiny) shrinks every workload to a few MiB, to
# check that the scripts run end to end; its figures mean nothing.
SIZE_ENV = "FOP_BENCH_SIZE"


def tiny() -> bool:
    return os.environ.get(SIZE_ENV) == "tiny"


def tree_specs(workload: str) -> list[LeafSpec]:
    """Leaves of a workload: params, then opt_state mu/nu, then the Adam count."""
    wid = {"a": 1, "b": 2, "c": 1}[workload]  # (c) holds the same values as (a)
    if tiny():
        shapes = (
            _transformer_params(d=128, layers=2, vocab=512, ff=256)
            if workload in ("a", "c")
            else _small_params(n=200, groups=4)
        )
    else:
        shapes = _transformer_params() if workload in ("a", "c") else _small_params()
    out = []
    for role_id, prefix in enumerate((("params",), ("opt_state", "mu"), ("opt_state", "nu"))):
        for idx, (p, shape) in enumerate(shapes):
            out.append(LeafSpec(prefix + p, shape, "float32", (wid, role_id, idx)))
    out.append(LeafSpec(("opt_state", "count"), (), "int32", (wid, 9, 0)))
    return out


def params_specs(specs: list[LeafSpec]) -> list[LeafSpec]:
    return [s for s in specs if s.path[0] == "params"]


def total_bytes(specs: Iterable[LeafSpec]) -> int:
    return sum(s.nbytes for s in specs)


def nest(pairs: Iterable[tuple[tuple[str, ...], Any]]) -> dict:
    """[(path, value)] -> nested dict."""
    root: dict = {}
    for path, value in pairs:
        d = root
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = value
    return root


def get_path(tree: dict, path: tuple[str, ...]):
    for k in path:
        tree = tree[k]
    return tree


def flat_key(path: tuple[str, ...]) -> str:
    return "/".join(path)


# ------------------------------------------------------------------ placement (jax)


def mesh_sharding(spec: LeafSpec, layout: str):
    """The jax sharding of a leaf for a layout: 'single', '2x4', '4x2' (needs 8 devices)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    if layout == "single":
        return SingleDeviceSharding(jax.devices()[0])
    rows, cols = (int(x) for x in layout.split("x"))
    devs = np.array(jax.devices()[: rows * cols]).reshape(rows, cols)
    mesh = Mesh(devs, ("data", "model"))
    shape = spec.shape
    if len(shape) == 2 and shape[0] % rows == 0 and shape[1] % cols == 0:
        ps = PartitionSpec("data", "model")
    elif len(shape) == 1 and shape[0] % cols == 0:
        ps = PartitionSpec("model")
    else:
        ps = PartitionSpec()
    return NamedSharding(mesh, ps)


def build_jax_tree(specs: list[LeafSpec], layout: str) -> dict:
    import jax

    pairs = []
    for s in specs:
        arr = s.make()
        pairs.append((s.path, jax.device_put(arr, mesh_sharding(s, layout))))
        del arr
    tree = nest(pairs)
    jax.block_until_ready(tree)
    return tree


def build_like(specs: list[LeafSpec], layout: str) -> dict:
    import jax

    return nest(
        (
            s.path,
            jax.ShapeDtypeStruct(s.shape, np.dtype(s.dtype), sharding=mesh_sharding(s, layout)),
        )
        for s in specs
    )


def check_result(tree: Any, specs: list[LeafSpec], target: str) -> list[str]:
    """Problems with a restored tree's structure, leaf types, shapes, dtypes and
    placement (values are not compared; see :func:`verify`). Cheap: run on every
    repeat. ``target``: 'numpy' (host numpy arrays), 'single' or a mesh layout."""
    import jax

    problems = []
    for s in specs:
        try:
            x = get_path(tree, s.path)
        except (KeyError, TypeError):
            problems.append(f"{flat_key(s.path)}: missing")
            continue
        where = flat_key(s.path)
        if target == "numpy":
            if not isinstance(x, np.ndarray | np.generic):
                problems.append(f"{where}: expected a numpy array, found {type(x).__name__}")
                continue
        elif not isinstance(x, jax.Array):
            problems.append(f"{where}: expected a jax.Array, found {type(x).__name__}")
            continue
        if tuple(x.shape) != tuple(s.shape) or np.dtype(x.dtype) != np.dtype(s.dtype):
            problems.append(f"{where}: {x.shape} {x.dtype}, expected {s.shape} {s.dtype}")
        if target != "numpy":
            want = mesh_sharding(s, target)
            if not x.sharding.is_equivalent_to(want, len(s.shape)):
                problems.append(f"{where}: sharding {x.sharding}, expected {want}")
    return problems


def verify(tree: dict, specs: list[LeafSpec]) -> None:
    """Raise if any leaf of a restored tree differs from its spec's values."""
    for s in specs:
        got = np.asarray(get_path(tree, s.path))
        want = s.make()
        if got.shape != want.shape or not np.array_equal(got, want):
            raise AssertionError(f"restored leaf {flat_key(s.path)} differs from what was saved")


# ------------------------------------------------------------------- measurement


def drop_caches() -> None:
    """Flush dirty pages, then drop the page cache (root only)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def is_root() -> bool:
    return os.geteuid() == 0


def make_cold(path: str) -> None:
    """Before a cold read of ``path``: as root, drop the whole page cache; otherwise
    evict ``path``'s own files (:func:`evict`, ``POSIX_FADV_DONTNEED``; the library's
    code and Python's stay cached either way). Said beside each figure (``cold_by``)."""
    if is_root():
        drop_caches()
    else:
        os.sync()
        evict(path)


COLD_NOTE = "without root: each checkpoint's files evicted with posix_fadvise (no drop_caches)"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The process's peak RSS: ``VmHWM``, or ``ru_maxrss`` where /proc has no VmHWM
    (gVisor, the TPU machine's sandbox; ru_maxrss is never reset)."""
    try:
        return _status_kib("VmHWM") * 1024
    except KeyError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5\n")


def io_counters() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def fsync_tree(path: str) -> None:
    """fsync every file and directory under path, and path's parent."""
    if os.path.isfile(path):
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    else:
        for root, _dirs, files in os.walk(path, topdown=False):
            for name in files:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            fd = os.open(root, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    parent = os.path.dirname(os.path.abspath(path))
    fd = os.open(parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def disk_usage(path: str) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of all files under path."""
    if os.path.isfile(path):
        st = os.stat(path)
        return st.st_size, st.st_blocks * 512
    app = alloc = 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(root, name))
            app += st.st_size
            alloc += st.st_blocks * 512
    return app, alloc


def add_raw_and_tiny_options(p) -> None:
    """The options every suite against the raw limit takes: ``--raw-streams`` and
    ``--tiny`` (the caller sets SIZE_ENV when it is given)."""
    p.add_argument(
        "--raw-streams", type=int, default=32, help="threads of the parallel raw limit row"
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="workloads of a few MiB, to check the scripts run (figures meaningless)",
    )


def warm_memory(nbytes: int, directory: str) -> None:
    """Writes ``nbytes`` to a file in ``directory`` and deletes it: the page cache takes
    that much memory and frees it again. On a VM, memory the guest never touched costs
    about 10x the system time to write into (measured: 1.2 GB of file writes, 3.0 s
    against 0.3 s), so without this the first writer of a run pays for everyone."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, ".warm")
    block = bytes(64 << 20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, len(block))])
    finally:
        os.close(fd)
        os.unlink(path)


def rmtree(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ------------------------------------------------------------------- raw limit


def raw_write(path: str, arrays: Iterable[np.ndarray]) -> int:
    """The same bytes, one file, one sequential stream, one fsync. Returns bytes written."""
    n = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for a in arrays:
            mv = memoryview(np.ascontiguousarray(a)).cast("B")
            while mv:
                k = os.write(fd, mv)
                n += k
                mv = mv[k:]
        os.fsync(fd)
    finally:
        os.close(fd)
    return n


RAW_BLOCK = 8 << 20  # bytes per parallel raw read or write call


def _blocks(nbytes: int, block: int = RAW_BLOCK) -> list[tuple[int, int]]:
    return [(off, min(block, nbytes - off)) for off in range(0, nbytes, block)]


def raw_write_parallel(path: str, arrays: Iterable[np.ndarray], streams: int) -> int:
    """The same bytes to one file by ``streams`` threads of ``os.pwrite`` (each block
    at its offset), then one fsync: the disk's write limit when many requests are in
    flight, as a checkpoint library keeps them. Returns bytes written."""
    from concurrent.futures import ThreadPoolExecutor

    views, offset = [], 0
    for a in arrays:
        mv = memoryview(np.ascontiguousarray(a)).cast("B")
        for off, size in _blocks(len(mv)):
            views.append((offset + off, mv[off : off + size]))
        offset += len(mv)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, offset)

        def put(job):
            at, mv = job
            while mv:
                k = os.pwrite(fd, mv, at)
                at, mv = at + k, mv[k:]

        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(put, views))
        os.fsync(fd)
    finally:
        os.close(fd)
    return offset


def raw_read_parallel(path: str, streams: int, nbytes: int | None = None) -> np.ndarray:
    """Read nbytes (default: the whole file) into one fresh buffer with ``streams``
    threads of ``os.preadv``, each filling its own blocks of the buffer."""
    from concurrent.futures import ThreadPoolExecutor

    if nbytes is None:
        nbytes = os.path.getsize(path)
    out = np.empty(nbytes, np.uint8)
    with ThreadPoolExecutor(streams) as pool:
        read_blocks(path, out, pool)
    return out


def read_blocks(path: str, out: np.ndarray, pool) -> None:
    """Fills ``out`` (uint8) from the start of ``path``, one ``os.preadv`` job per
    :data:`RAW_BLOCK` block, on the executor ``pool``."""
    mv = memoryview(out)
    fd = os.open(path, os.O_RDONLY)
    try:

        def get(job):
            at, size = job
            got = 0
            while got < size:
                k = os.preadv(fd, [mv[at + got : at + size]], at + got)
                if not k:
                    raise EOFError(path)
                got += k

        list(pool.map(get, _blocks(out.nbytes)))
    finally:
        os.close(fd)


def evict(path: str) -> None:
    """Drops ``path``'s files (a file or every file under a directory) from the page
    cache: POSIX_FADV_DONTNEED on each (clean pages; the files were fsynced)."""
    files = [path] if os.path.isfile(path) else []
    for root, _dirs, names in os.walk(path):
        files += [os.path.join(root, n) for n in names]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(path: str, nbytes: int | None = None, offset: int = 0) -> np.ndarray:
    """Read nbytes (default: the whole file) into one fresh buffer."""
    if nbytes is None:
        nbytes = os.path.getsize(path) - offset
    out = np.empty(nbytes, np.uint8)
    mv = memoryview(out)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        got = 0
        while got < nbytes:
            k = f.readinto(mv[got:])
            if not k:
                raise EOFError(path)
            got += k
    return out


# ------------------------------------------------------------------- subprocesses


def run_worker(args: list[str], env_extra: dict | None = None, timeout: float = 900) -> dict:
    """Run worker.py in a fresh interpreter; return its JSON result line."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if env_extra:
        env.update(env_extra)
    cmd = [sys.executable, os.path.join(HERE, "worker.py"), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (p.stdout[-1500:] + "\n" + p.stderr[-3000:]).strip()
    return {"error": f"worker exited {p.returncode}", "tail": tail, "cmd": " ".join(args)}


def env_for_layout(workload: str) -> dict:
    if workload == "c":
        return {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    return {"JAX_PLATFORMS": "cpu"}


# ------------------------------------------------------------------- machine


def machine_description() -> dict:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["ram_bytes"] = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    try:
        df = subprocess.run(
            ["df", "-hT", TMP if os.path.isdir(TMP) else HERE], capture_output=True, text=True
        ).stdout.splitlines()
        info["disk"] = df[-1] if df else None
    except OSError:
        pass
    vers = {}
    from importlib import metadata as md

    for pkg in (
        "flax_orbax_plugin",
        "jax",
        "jaxlib",
        "flax",
        "optax",
        "tensorstore",
        "orbax-checkpoint",
        "torch",
        "msgpack",
        "numpy",
    ):
        try:
            vers[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            vers[pkg] = None
    info["versions"] = vers
    for name in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{name}") as f:
                info[f"thp_{name}"] = f.read().strip()
        except OSError:
            pass
    # numpy madvises huge pages for big arrays unless this is 0; first-touch page faults
    # of fresh buffers then dominate copies on some VMs (see README)
    info["NUMPY_MADVISE_HUGEPAGE"] = os.environ.get("NUMPY_MADVISE_HUGEPAGE", "(unset: on)")
    try:
        root = os.path.dirname(HERE)
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "flax_orbax_plugin"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        info["plugin_commit"] = head + ("+uncommitted changes" if dirty else "")
    except OSError:
        pass
    info["ru_maxrss_note"] = "peak RSS per operation: VmHWM after reset via clear_refs"
    return info


def now() -> float:
    return time.perf_counter()
