"""Run a function in N real JAX processes on 127.0.0.1 (jax.distributed, CPU, gloo).

Who calls what, in which order:

* The test (parent) calls :func:`run_processes` with a target ``"module:function"``
  importable from ``tests/`` (or the repository root). It picks a free coordinator
  port and starts N children with ``python tests/support/_multiprocess.py``; each child's
  environment carries ``XLA_FLAGS=--xla_force_host_platform_device_count=K``,
  ``JAX_PLATFORMS=cpu`` and a JSON job description.
* Each child sets ``jax_cpu_collectives_implementation=gloo``, calls
  ``jax.distributed.initialize(coordinator_address="127.0.0.1:<port>",
  num_processes=N, process_id=i, ...)``, builds a :class:`Context` (with a global
  mesh over all N*K devices) and calls ``function(ctx, **args)``. The return value
  (JSON-serialisable) is written to a per-process result file together with the
  process's own ``/proc/self/io`` counters, the error if it raised, and timings.
* The parent waits for every child (a global timeout; on expiry it SIGKILLs the
  stragglers), optionally SIGKILLs one process at a chosen point (:class:`Kill`), and
  returns a :class:`RunResult` with one :class:`ProcResult` per process.

Signals: ``Signal(process=i, when=callable)`` has the parent send process i a real
signal (SIGTERM by default) once ``callable()`` is true (polled every 5 ms; each fires
once); ``RunResult.signals_sent`` records when, in seconds since the start. A child
whose target raises SystemExit (a preempted run leaving with 143) reports the code
(``record["exit_code"]``), leaves through the same "done" barrier as on success and
exits with that code.

Kill points: ``Kill(process=i, at="name")`` makes process i SIGKILL itself when it
calls ``ctx.point("name")`` (deterministic); ``Kill(process=i, after_s=t)`` has the
parent kill it t seconds after start; ``Kill(process=i, when=callable)`` has the
parent kill it as soon as ``callable()`` is true (polled every 5 ms).

What jax 0.10.2's coordination service does when a process dies (measured with
this helper; 3 processes x 2 CPU devices):

* A survivor at ``wait_at_barrier(name, timeout)`` whose timeout expires first gets
  ``JaxRuntimeError: DEADLINE_EXCEEDED: Barrier timed out. Id: <name>::0 ... # of
  tasks that reached the barrier: 2/3 ... Some timed out task names:\n1``. A
  ``blocking_key_value_get`` gets ``DEADLINE_EXCEEDED: GetKeyValue() timed out with
  key: <key> and duration: 3s`` (no task named).
* Once ``heartbeat_timeout_seconds`` (initialize's argument, default 100) passes,
  pending barriers fail at once with ``INTERNAL: Barrier failed because: task is set
  to ERROR: UNAVAILABLE: Task 1 heartbeat timeout ...``, and every survivor is then
  terminated by jax itself (SIGABRT, ~0.3 s later, even one not using the service):
  ``F... client.h:80] Terminating process because the JAX distributed service
  detected fatal errors ... The following tasks are unhealthy (stopped sending
  heartbeats):\n1``. With a 3 s heartbeat timeout survivors are gone ~3.5 s after
  the kill; with the default they live up to 100 s.
* If process 0 (which hosts the service) dies, survivors' next call fails within
  ~10 ms with ``UNAVAILABLE: Failed to send RPC to coordination service. Either the
  leader task was preempted/died/restarted ...`` and they are terminated likewise.
* ``jax.distributed.shutdown()`` (also run at exit) is a barrier of all processes:
  after a peer died it waits ``shutdown_timeout_seconds`` (default 300), then aborts
  ("Shutdown barrier has failed"). Hence this helper's children leave through a
  short "done" barrier and skip shutdown when it fails.
* With ``jax.config.update("jax_enable_recoverability", True)`` before initialize
  (``recoverable=True`` here) survivors are not terminated: barriers run to their
  own timeout and report the missing task as above, and processes exit cleanly.
* A process that exits without ``shutdown`` (``os._exit``) is not noticed before
  the heartbeat timeout.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(TESTS_DIR))
_SPEC_ENV = "FOP_MP_JOB"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class Kill:
    process: int
    at: str | None = None  # a ctx.point() name: the child kills itself there
    after_s: float | None = None  # the parent kills it this long after start
    when: Callable[[], bool] | None = None  # the parent kills it once this is true


@dataclasses.dataclass(frozen=True)
class Signal:
    process: int
    when: Callable[[], bool]  # the parent sends it once this is true
    signum: int = signal.SIGTERM


@dataclasses.dataclass
class ProcResult:
    process_id: int
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    killed: bool  # SIGKILLed on purpose (Kill)
    timed_out: bool  # SIGKILLed by the parent's global timeout
    record: dict  # what the child wrote: ok, result, error, traceback, io, t_* ...

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.record.get("ok"))

    @property
    def result(self):
        return self.record.get("result")

    @property
    def error(self) -> str | None:
        return self.record.get("error")

    def describe(self) -> str:
        lines = (self.stderr or "").splitlines()
        # A hung child's stack dump (see dump_stacks_after_s) is worth reading whole.
        tail = "\n".join(lines[-400:] if self.timed_out else lines[-25:])
        return (
            f"process {self.process_id}: rc={self.returncode} killed={self.killed} "
            f"timed_out={self.timed_out} wall={self.wall_s:.1f}s error={self.error!r}\n"
            f"{self.record.get('traceback', '')}\n--- stderr tail ---\n{tail}"
        )


@dataclasses.dataclass
class RunResult:
    procs: list[ProcResult]
    workdir: str
    signals_sent: list[tuple[int, float]] = dataclasses.field(default_factory=list)

    def __getitem__(self, i) -> ProcResult:
        return self.procs[i]

    @property
    def results(self) -> list:
        return [p.result for p in self.procs]

    def check(self) -> RunResult:
        """Raises AssertionError with every process's story unless all succeeded."""
        bad = [p for p in self.procs if not p.ok]
        if bad:
            raise AssertionError("\n\n".join(p.describe() for p in self.procs))
        return self


def run_processes(
    target: str,
    n: int = 2,
    *,
    devices_per_process: int = 2,
    args: dict | None = None,
    timeout_s: float = 90.0,
    kill: Kill | None = None,
    env: dict | None = None,
    heartbeat_timeout_s: int = 100,
    shutdown_timeout_s: int = 30,
    init_timeout_s: int = 60,
    workdir: str | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_axes: tuple[str, ...] = ("data",),
    recoverable: bool = False,
    done_timeout_s: float = 30.0,
    signals: tuple[Signal, ...] | list[Signal] = (),
) -> RunResult:
    """Runs ``target(ctx, **args)`` in ``n`` processes; see the module docstring."""
    workdir = workdir or tempfile.mkdtemp(prefix="fop-mp-")
    os.makedirs(workdir, exist_ok=True)
    for i in range(n):  # a workdir used before: its end marks are not this run's
        try:
            os.remove(os.path.join(workdir, f"ended_{i}"))
        except FileNotFoundError:
            pass
    port = free_port()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    child_env.update(env or {})
    child_env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices_per_process}"
    child_env["JAX_PLATFORMS"] = "cpu"
    extra_path = (env or {}).get("PYTHONPATH") or os.environ.get("PYTHONPATH")
    # A target "module:function" may live in the helpers or in any test wing's module.
    wings = sorted(
        d.path for d in os.scandir(os.path.dirname(TESTS_DIR)) if d.is_dir() and d.path != TESTS_DIR
    )
    paths = [TESTS_DIR, *wings, REPO_ROOT, *filter(None, [extra_path])]
    child_env["PYTHONPATH"] = os.pathsep.join(paths)
    child_env["PYTHONUNBUFFERED"] = "1"
    procs, outs = [], []
    t0 = time.monotonic()
    for i in range(n):
        job = {
            "target": target,
            "args": args or {},
            "coordinator": f"127.0.0.1:{port}",
            "num_processes": n,
            "process_id": i,
            "result_path": os.path.join(workdir, f"result_{i}.json"),
            "kill_at": kill.at if (kill and kill.process == i) else None,
            "heartbeat_timeout_s": heartbeat_timeout_s,
            "shutdown_timeout_s": shutdown_timeout_s,
            "init_timeout_s": init_timeout_s,
            "mesh_shape": list(mesh_shape) if mesh_shape else None,
            "mesh_axes": list(mesh_axes),
            "workdir": workdir,
            "t0_wall": time.time(),
            "recoverable": recoverable,
            "done_timeout_s": done_timeout_s,
            # A child still running then prints every thread's stack to its stderr,
            # so that a hang the parent kills at timeout_s says where it hung.
            "dump_stacks_after_s": max(1.0, timeout_s - 3.0),
        }
        out = open(os.path.join(workdir, f"stdout_{i}.txt"), "w+")
        err = open(os.path.join(workdir, f"stderr_{i}.txt"), "w+")
        outs.append((out, err))
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)],
                env={**child_env, _SPEC_ENV: json.dumps(job)},
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=workdir,
            )
        )
    ends = [None] * n
    killed = [False] * n
    timed_out = [False] * n
    deadline = t0 + timeout_s
    pending_signals = list(signals)
    sent: list[tuple[int, float]] = []
    while any(e is None for e in ends):
        now = time.monotonic()
        for i, p in enumerate(procs):
            if ends[i] is None and p.poll() is not None:
                ends[i] = now
                _mark_ended(workdir, i)
        for sig in list(pending_signals):
            if ends[sig.process] is None and sig.when():
                procs[sig.process].send_signal(sig.signum)
                sent.append((sig.process, time.monotonic() - t0))
                pending_signals.remove(sig)
        if kill is not None and ends[kill.process] is None and not killed[kill.process]:
            fire = (kill.after_s is not None and now - t0 >= kill.after_s) or (
                kill.when is not None and kill.when()
            )
            if fire:
                procs[kill.process].send_signal(signal.SIGKILL)
                killed[kill.process] = True
        if now > deadline:
            for i, p in enumerate(procs):
                if ends[i] is None:
                    p.send_signal(signal.SIGKILL)
                    p.wait()
                    timed_out[i] = True
                    ends[i] = time.monotonic()
            break
        time.sleep(0.005)
    results = []
    for i, p in enumerate(procs):
        p.wait()
        out, err = outs[i]
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close()
        err.close()
        record = {}
        path = os.path.join(workdir, f"result_{i}.json")
        if os.path.exists(path):
            with open(path) as f:
                record = json.load(f)
        if p.returncode == -signal.SIGKILL and kill is not None and kill.process == i:
            killed[i] = True
        results.append(
            ProcResult(
                i, p.returncode, stdout, stderr, ends[i] - t0, killed[i], timed_out[i], record
            )
        )
    return RunResult(results, workdir, sent)


def _mark_ended(workdir: str, i: int) -> None:
    """Tells the service host (process 0) that process ``i`` is gone, whatever its record."""
    with open(os.path.join(workdir, f"ended_{i}"), "w"):
        pass


# ----------------------------------------------------------------------------- child side


def read_proc_io(pid: int | str = "self") -> dict:
    """The kernel's I/O counters of a process (rchar, wchar, read_bytes, write_bytes ...)."""
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


class Context:
    """What a target function gets: its place in the job and a few helpers."""

    def __init__(self, job: dict):
        import jax
        import numpy as np

        self.job = job
        self.process_id: int = job["process_id"]
        self.num_processes: int = job["num_processes"]
        self.workdir: str = job["workdir"]
        self.devices = jax.devices()
        shape = job["mesh_shape"] or [len(self.devices)]
        self.mesh = jax.sharding.Mesh(
            np.array(self.devices).reshape(shape), tuple(job["mesh_axes"])
        )
        self._record: dict = {}

    @property
    def client(self):
        """jax's coordination service client (wait_at_barrier, key_value_set, ...)."""
        from jax._src.distributed import global_state

        return global_state.client

    def point(self, name: str) -> None:
        """A kill point: SIGKILLs this process if the job asked for it here."""
        self.note(f"t_point_{name}", time.time())
        if self.job.get("kill_at") == name:
            self.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def note(self, key: str, value) -> None:
        """Adds ``key: value`` to this process's record (kept even if it dies later)."""
        self._record[key] = value

    def flush(self) -> None:
        _write_record(self.job["result_path"], {"ok": False, "partial": True, **self._record})

    def io(self) -> dict:
        return read_proc_io()


def _write_record(path: str, record: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, default=repr)
    os.replace(tmp, path)


def _resolve(target: str):
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def await_coordinator(address: str, timeout_s: float) -> None:
    """Returns once the coordination service at ``address`` ("host:port") accepts a
    connection, or after ``timeout_s`` (``jax.distributed.initialize`` then reports what
    it finds). A process other than the service's host calls it before initialize: a
    client that reaches the port before the service listens waits out gRPC's reconnect
    backoff (~1 s) before it tries again, and every process's initialize waits for it."""
    import socket

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.01)


def _child_main() -> int:
    job = json.loads(os.environ[_SPEC_ENV])
    t_start = time.time()
    faulthandler.dump_traceback_later(job["dump_stacks_after_s"], exit=False)
    ctx = None
    try:
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if job["recoverable"]:
            jax.config.update("jax_enable_recoverability", True)
        if job["process_id"] != 0:
            await_coordinator(job["coordinator"], job["init_timeout_s"])
        jax.distributed.initialize(
            coordinator_address=job["coordinator"],
            num_processes=job["num_processes"],
            process_id=job["process_id"],
            initialization_timeout=job["init_timeout_s"],
            heartbeat_timeout_seconds=job["heartbeat_timeout_s"],
            shutdown_timeout_seconds=job["shutdown_timeout_s"],
        )
        t_init = time.time()
        ctx = Context(job)
        ctx.note("t_start", t_start)
        ctx.note("t_initialized", t_init)
        io_before = read_proc_io()
        result = _resolve(job["target"])(ctx, **job["args"])
        io_after = read_proc_io()
        record = {
            **ctx._record,
            "ok": True,
            "result": result,
            "io_before": io_before,
            "io_after": io_after,
            "t_end": time.time(),
            "pid": os.getpid(),
        }
        _write_record(job["result_path"], record)
        rc = 0
    except SystemExit as e:  # e.g. a preempted run: 143 after its last save
        rc = e.code if isinstance(e.code, int) else 1
        record = {
            **(ctx._record if ctx else {}),
            "ok": False,
            "exit_code": rc,
            "error": f"SystemExit: {e.code}",
            "error_type": "SystemExit",
            "t_end": time.time(),
            "pid": os.getpid(),
        }
        _write_record(job["result_path"], record)
        if ctx is None:
            return rc
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        record = {
            **(ctx._record if ctx else {}),
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "error_type": type(e).__name__,
            "traceback": traceback.format_exc(),
            "t_end": time.time(),
            "pid": os.getpid(),
        }
        _write_record(job["result_path"], record)
        return 1
    # Success: leave together, so that no process looks dead to the coordination
    # service while its peers still work; then jax's own shutdown (itself a barrier).
    # If a peer is gone, the done barrier fails and we leave without that shutdown,
    # which would otherwise wait shutdown_timeout_s and then abort the process. A peer
    # the parent already saw end (killed, or failed before this point) can never reach
    # the barrier: then it is not waited for at all (done_timeout_s of nothing).
    try:
        if _a_peer_ended(job):
            raise RuntimeError("a peer has ended: the done barrier cannot be met")
        ctx.client.wait_at_barrier("fop_mp/done", int(job["done_timeout_s"] * 1000))
    except Exception:  # noqa: BLE001
        _host_leaves_last(job)
        return rc
    jax.distributed.shutdown()
    return rc


def _a_peer_ended(job: dict) -> bool:
    """Whether the parent has marked another process of this run ended (``ended_<i>``):
    a process still running its target never is, so a marked one died or failed."""
    others = set(range(job["num_processes"])) - {job["process_id"]}
    return any(os.path.exists(os.path.join(job["workdir"], f"ended_{i}")) for i in others)


def _host_leaves_last(job: dict) -> None:
    """Process 0 hosts the coordination service: when it exits, jax aborts every peer
    still connected (SIGABRT). So it leaves only once each peer has written its final
    record or ended (the parent marks it), or the run's time is up, never by the done
    barrier's timeout alone: a peer that started late would be killed mid-target."""
    if job["process_id"] != 0:
        return
    workdir, deadline = job["workdir"], job["t0_wall"] + job["dump_stacks_after_s"]
    waiting = set(range(1, job["num_processes"]))
    while waiting and time.time() < deadline:
        for i in list(waiting):
            if os.path.exists(os.path.join(workdir, f"ended_{i}")):
                waiting.discard(i)
                continue
            try:
                with open(os.path.join(workdir, f"result_{i}.json")) as f:
                    if not json.load(f).get("partial"):
                        waiting.discard(i)
            except (OSError, ValueError):
                pass
        time.sleep(0.02)


if __name__ == "__main__":
    rc = _child_main()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: after a failure, skip jax's atexit shutdown barrier, which after a peer
    # died would block for shutdown_timeout_s. Every result is already on disk.
    os._exit(rc)
