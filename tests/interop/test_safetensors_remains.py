"""What an export that died leaves is recognised as ours and removed: by the next export
to its folder and by ``flax-orbax gc`` of it, once its writer is gone (never a live
writer's, never a file the library did not write); and a second Ctrl-C during an
export's clean-up waits for it. Real child processes, real signals and kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import _proc
import numpy as np

import flax_orbax_plugin as fop
from flax_orbax_plugin.cli import main

# An export of a 4 MB tree to argv[1], in shards of 1 MB.
_EXPORT = """
import sys
import numpy as np
import flax_orbax_plugin as fop
tree = {f"w{i}": np.full((512, 512), i, np.float32) for i in range(4)}
fop.to_safetensors(tree, sys.argv[1], max_shard_size="1MB")
print("exported")
"""


def _start(out, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _EXPORT, str(out)],
        env=_proc.child_env(JAX_PLATFORMS="cpu", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _paused(proc, phase: str) -> str:
    seen = ""
    deadline = time.monotonic() + 60
    while f"FOP_PAUSED {phase}" not in seen:
        assert proc.poll() is None and time.monotonic() < deadline, seen
        seen += proc.stderr.readline()
    return seen


def _killed_mid_write(out) -> list[str]:
    """Starts an export to ``out``, SIGKILLs it while it writes; what it left."""
    proc = _start(out, FOP_PAUSE_AT="export_write:2", FOP_PAUSE_S="30")
    try:
        _paused(proc, "export_write")
    finally:
        proc.kill()
        proc.wait(timeout=60)
    return sorted(os.listdir(out))


def test_the_next_export_to_the_folder_removes_a_killed_exports_files(tmp_path):
    """A SIGKILL (or a default SIGTERM) left '.model-0000N-of-0000M.safetensors.tmp-<hex>'
    files (hundreds of MB for a real model) that nothing ever removed: a later export
    left them beside its own files and gc listed them as not ours."""
    out = tmp_path / "hf"
    left = _killed_mid_write(out)
    assert any(".tmp-" in n for n in left), left
    mine = out / ".notes.tmp-0123456789abcdef"  # a user's file, named alike: never removed
    mine.write_text("mine")
    tree = {"b": np.ones(8, np.float32)}
    result = fop.to_safetensors(tree, out / "other.safetensors")
    assert sorted(os.listdir(out)) == [".notes.tmp-0123456789abcdef", "other.safetensors"]
    assert [os.path.basename(f) for f in result.files] == ["other.safetensors"]


def test_gc_of_the_folder_removes_a_killed_exports_files(tmp_path, capsys):
    out = tmp_path / "hf"
    left = _killed_mid_write(out)
    assert main(["gc", str(out), "--dry-run"]) == 0
    assert sorted(os.listdir(out)) == left  # a dry run removes nothing
    assert main(["gc", str(out)]) == 0
    assert os.listdir(out) == []
    printed = capsys.readouterr().out
    assert "removed unfinished: " in printed and ".tmp-" in printed, printed
    assert "left alone" not in printed, printed


def test_a_live_exports_files_are_never_removed(tmp_path):
    out = tmp_path / "hf"
    proc = _start(out, FOP_PAUSE_AT="export_write:2", FOP_PAUSE_S="30")
    try:
        _paused(proc, "export_write")
        theirs = sorted(os.listdir(out))
        fop.to_safetensors({"b": np.ones(8, np.float32)}, out / "other.safetensors")
        assert main(["gc", str(out)]) == 0
        assert sorted(os.listdir(out)) == sorted(theirs + ["other.safetensors"])
    finally:
        proc.kill()
        proc.wait(timeout=60)


def test_a_second_ctrl_c_waits_for_the_export_to_clean_up(tmp_path):
    """Ctrl-C, then Ctrl-C again while the export removed its files: the second one cut
    the clean-up short and 67-200 MB of temporary files stayed. Now it is held until
    the clean-up is done, then raised: the folder is as it was (gone: it made it)."""
    out = tmp_path / "hf"
    proc = _start(
        out, FOP_SLOW_AT="export_write", FOP_SLOW_S="0.3", FOP_PAUSE_AT="export_discard",
        FOP_PAUSE_S="1",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (out.is_dir() and any(".tmp-" in n for n in os.listdir(out))):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        seen = _paused(proc, "export_discard")
        proc.send_signal(signal.SIGINT)
        stdout, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "exported" not in stdout, (proc.returncode, stdout)
    assert "KeyboardInterrupt" in seen + err, seen + err
    assert not out.exists(), os.listdir(out)
