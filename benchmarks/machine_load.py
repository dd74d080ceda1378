"""What the machine was doing beside a figure: load average and CPU steal (/proc)."""

from __future__ import annotations


def cpu_times() -> tuple[int, int]:
    """(steal, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[7] if len(fields) > 7 else 0, sum(fields[:8])


def load1() -> float:
    """The one-minute load average."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])
