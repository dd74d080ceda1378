"""Whether the writer a marker or record names (host, pid) still runs on this host: the
one test behind every removal of a dead writer's remains and every takeover of a dead
holder's lease; another host's process is never judged dead from here. Any thread.
"""

from __future__ import annotations

import os
import socket
from typing import Any


def alive_here(host: Any, pid: Any) -> bool | None:
    """True when ``pid`` runs on this host (another user's counts), False when it died,
    None where that cannot be told: another host, this very process, no process id."""
    if host != socket.gethostname() or pid == os.getpid():
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 1 << 31:
        return None
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        return True
    return True
