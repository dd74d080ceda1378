"""A Ctrl-C while the library loads on its first use (``fop.save`` imports JAX and the
library's modules, seconds) reaches the caller, before anything is written. A real
SIGINT in a child process, sent at an exact moment: from a garbage-collection callback
while the modules load, where Python reports and drops any exception a callback
raises (JAX's own GC callback was where a Ctrl-C landed)."""

from __future__ import annotations

import os
import subprocess
import sys

import _proc

_CHILD = """
import gc, os, signal, sys
import numpy as np
import flax_orbax_plugin as fop

def ctrl_c_in_a_gc_callback(phase, info):
    gc.callbacks.remove(ctrl_c_in_a_gc_callback)
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10_000):  # bytecodes: the handler runs here, inside the callback
        pass

class Hook:  # once the library's modules load: a collection, and the signal in it
    def find_spec(self, name, path=None, target=None):
        if name == "flax_orbax_plugin._api":
            sys.meta_path.remove(self)
            gc.callbacks.insert(0, ctrl_c_in_a_gc_callback)
            gc.collect()
        return None

sys.meta_path.insert(0, Hook())
try:
    fop.save(sys.argv[1], {"w": np.ones(10, np.float32)})
except KeyboardInterrupt:
    print("interrupted")
    sys.exit(130)
print("ran on")
"""


def _run(child: str, tmp_path) -> subprocess.CompletedProcess:
    """The program ``child``, saving to ``tmp_path/ckpt``, to its end."""
    return subprocess.run(
        [sys.executable, "-c", child, str(tmp_path / "ckpt")],
        env=_proc.child_env(JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_ctrl_c_while_the_library_loads_reaches_the_caller(tmp_path):
    """It was dropped (raised in a GC callback: 'Exception ignored in ...'), the save
    committed and the program ran on, exit 0."""
    p = _run(_CHILD, tmp_path)
    assert p.returncode == 130 and p.stdout.strip() == "interrupted", (p.stdout, p.stderr)
    assert "Exception ignored" not in p.stderr, p.stderr
    assert not os.path.exists(tmp_path / "ckpt")  # nothing written


def test_a_users_own_sigint_handler_is_kept_and_called(tmp_path):
    """The deferral while the library loads puts back the user's handler, and hands it
    the Ctrl-C that arrived meanwhile, once."""
    child = _CHILD.replace(
        "sys.meta_path.insert(0, Hook())",
        "calls = []\n"
        "signal.signal(signal.SIGINT, lambda s, f: calls.append(s))\n"
        "sys.meta_path.insert(0, Hook())",
    ).replace('print("ran on")', 'print("ran on", calls, signal.getsignal(signal.SIGINT))')
    p = _run(child, tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ran on [2] <function <lambda>"), p.stdout
