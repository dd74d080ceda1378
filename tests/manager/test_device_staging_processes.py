"""The accelerator's device staging with several processes (on CPU, ``CPU_AS_DEVICE``):
each process copies its own shards on its devices and decides its fallback alone, so a
process whose devices are full (host staging) and one whose are not (a device copy)
save one step together, and it restores bit for bit on both."""

from __future__ import annotations

import pytest
from _multiprocess import run_processes


@pytest.mark.distributed
def test_one_process_falls_back_to_host_staging_and_the_step_restores(tmp_path):
    run = run_processes(
        "_mp_workers:device_staging_across_processes",
        2,
        devices_per_process=2,
        args={"directory": str(tmp_path / "ckpt")},
        env={"FOP_COORDINATION_TIMEOUT_S": "20"},
        heartbeat_timeout_s=30,
        timeout_s=120,
    ).check()
    r0, r1 = run[0].result, run[1].result
    assert r0["staging"] == ["device"], r0
    assert len(r1["staging"]) == 1 and r1["staging"][0].startswith("host (device memory short")
    assert r0["exact"] and r1["exact"]
