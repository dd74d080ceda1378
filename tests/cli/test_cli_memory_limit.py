"""`--memory-limit` on every command that moves data (issue 53): `verify` takes it and
reads under it, and a refusal the library raises under the ceiling is said in the
flag's words (`--memory-limit N`), never the library's keyword
(`memory_limit_bytes=`), for export, import (msgpack, safetensors) and verify."""

from __future__ import annotations

import flax.serialization
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._core import verify as _verify
from flax_orbax_plugin.cli.main import main
from flax_orbax_plugin.cli.output import in_flag_words

STATE = {"w": np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)}  # 256 KiB


def refusal(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "memory_limit_bytes" not in err, err
    return err


def test_import_refusal_names_the_flag(tmp_path, capsys):
    src = tmp_path / "state.msgpack"
    src.write_bytes(flax.serialization.msgpack_serialize({"params": STATE}))
    err = refusal(capsys, ["import", str(src), str(tmp_path / "out"), "--memory-limit", "64K"])
    assert "error: --memory-limit 65536: " in err
    assert f"give --memory-limit {2 * src.stat().st_size} or more (or leave it out)" in err
    assert not (tmp_path / "out").exists()


def test_safetensors_import_takes_the_limit(tmp_path, capsys):
    # The safetensors import dropped --memory-limit: the step was read whole regardless.
    with fop.CheckpointManager(tmp_path / "run") as m:
        m.save(1, {"params": STATE})
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "m.safetensors")]) == 0
    argv = ["import", str(tmp_path / "m.safetensors"), str(tmp_path / "out"), "--step", "3"]
    err = refusal(capsys, [*argv, "--memory-limit", "256K"])
    assert f"--memory-limit 262144: {tmp_path / 'm.safetensors'}: its tensors hold" in err
    assert main([*argv, "--memory-limit", "1M"]) == 0
    assert fop.restore_params(tmp_path / "out")["w"].tolist() == STATE["w"].tolist()


def test_export_refusal_names_the_flag(tmp_path, capsys):
    with fop.CheckpointManager(tmp_path / "run") as m:
        m.save(1, {"params": STATE})
    out = str(tmp_path / "m.safetensors")
    err = refusal(capsys, ["export", str(tmp_path / "run"), out, "--memory-limit", "100K"])
    assert "--memory-limit 102400: leaf 'w' holds 262144 bytes" in err
    assert "give --memory-limit 262144 or more (or leave it out)" in err


def test_verify_reads_under_the_limit(tmp_path, capsys, monkeypatch):
    with fop.CheckpointManager(tmp_path / "run") as m:
        m.save(1, {"params": STATE})
    windows = []
    real = _verify.check_pytree

    def spy(*args, **kwargs):
        windows.append(kwargs.get("budget"))
        return real(*args, **kwargs)

    monkeypatch.setattr(_verify, "check_pytree", spy)
    assert main(["verify", str(tmp_path / "run"), "--memory-limit", "256K"]) == 0
    assert "ok" in capsys.readouterr().out
    assert windows and set(windows) == {128 << 10}  # half the ceiling: the reads and one more
    windows.clear()
    assert fop.verify(tmp_path / "run", memory_limit_bytes=1 << 40)[0].ok
    assert set(windows) == {_verify.VERIFY_BUDGET_BYTES}  # never above the fixed window
    with pytest.raises(fop.OptionError, match="memory_limit_bytes"):
        fop.verify(tmp_path / "run", memory_limit_bytes=0)


def test_flag_words_leave_other_text_alone():
    text = "memory_limit_bytes=5: x holds 9 bytes; give memory_limit_bytes >= 9 (or None)"
    assert in_flag_words(text) == (
        "--memory-limit 5: x holds 9 bytes; give --memory-limit 9 or more (or leave it out)"
    )
    assert in_flag_words("host_memory=5: nothing here") == "host_memory=5: nothing here"
