"""Programs that end on one process while the other still waits for it (run as
``python _ending_programs.py PORT PROCESS DIRECTORY SCENARIO``, two processes on
127.0.0.1): their exit hooks run as a real program's do (``tests/support/_multiprocess``
children leave through ``os._exit``, which skips them).

Scenarios (process 1 ends, process 0 then waits for it):

* ``restored-then-raises``: both restore a checkpoint onto devices of both processes
  (a collective operation; neither ever saved); process 1 then raises an error nobody
  catches, process 0 saves.
* ``save-fails-at-exit``: a manager, no ``close()``; process 1's last save fails in the
  background after process 0 committed it (``FOP_FAIL_AT``) and its program ends with
  that save unreported; process 0 closes.

Process 0 prints ``ERROR <type>: <message>`` and ``WAITED <seconds>`` for its last call.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, me, directory, scenario = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if me != 0:  # the service listens first (see _multiprocess.await_coordinator)
    from _multiprocess import await_coordinator

    await_coordinator(f"127.0.0.1:{port}", 60)
jax.distributed.initialize(
    f"127.0.0.1:{port}", num_processes=2, process_id=me, shutdown_timeout_seconds=60
)
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flax_orbax_plugin as fop  # noqa: E402

sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), P("data"))
full = np.arange(32, dtype=np.float32).reshape(8, 4)
state = {"w": jax.make_array_from_callback(full.shape, sharding, lambda i: full[i])}


def last_call(call):
    t = time.monotonic()
    try:
        call()
    except fop.CheckpointError as e:
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
    print(f"WAITED {time.monotonic() - t:.1f}", flush=True)


if scenario == "restored-then-raises":
    fop.restore(os.path.join(directory, "saved"), like=state)
    if me == 1:
        raise RuntimeError("the loss is NaN on host 1")  # nobody catches it
    last_call(lambda: fop.save(os.path.join(directory, "next"), state))
elif scenario == "save-fails-at-exit":
    mngr = fop.CheckpointManager(os.path.join(directory, "run"), every_steps=1)
    for step in (1, 2, 3):
        if me == 1 and step == 3:  # its read of step 3's outcome (committed by process 0)
            mngr.wait_for_save()  # step 2's, before: its hits are not counted
            os.environ["FOP_FAIL_AT"] = "collective-manager-save:2"
        mngr.save(step, state)
    if me == 0:
        last_call(mngr.close)
