"""The flax-orbax command line on real checkpoints written by CheckpointManager."""

import json
import os
import re
import shutil
import subprocess
import sys

import _files
import _paths
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import linen as nn
from flax.training import train_state

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin._core import ownership as _ownership

REPO = _paths.REPO
STEPS = (10, 20, 30)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, name="hidden")(x))
        return nn.Dense(4, name="out")(x)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A directory with steps 10, 20, 30 of a TrainState, extras holding a loss."""
    directory = tmp_path_factory.mktemp("cli") / "ckpts"
    net = Net()
    params = net.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-3))
    with fop.CheckpointManager(directory) as mngr:
        for step in STEPS:
            state = state.replace(
                step=step, params=jax.tree.map(lambda p, s=step: p + s / 100.0, state.params)
            )
            mngr.save(step, state, extras={"loss": 1.0 / step, "note": "x"})
    return directory, jax.tree.map(np.asarray, state.params)


def run_cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def flip_byte(directory, item):
    """Flips one byte in the middle of the largest data file of `item` of the latest step."""
    root = os.path.join(directory, str(STEPS[-1]), item)
    files = [
        os.path.join(d, f)
        for d, _, fs in os.walk(root)
        for f in fs
        if not f.endswith(".json") and not f.startswith("_")
    ]
    target = max(files, key=os.path.getsize)
    _files.flip_byte(target)
    return target


def test_list(ckpt_dir, capsys):
    directory, _ = ckpt_dir
    rc, out, _ = run_cli(capsys, "list", directory)
    assert rc == 0
    assert "3 step(s)" in out
    for step in STEPS:
        row = next(line for line in out.splitlines() if line.startswith(f"| {step} "))
        assert f"loss={1.0 / step:.4g}" in row
        assert "opt_state" in row and "params" in row and "extras" in row
    assert "unfinished" not in out


def test_inspect(ckpt_dir, capsys):
    directory, params = ckpt_dir
    rc, out, _ = run_cli(capsys, "inspect", directory)
    assert rc == 0
    assert out.splitlines()[0].endswith(os.path.join("ckpts", "30"))
    row = next(line for line in out.splitlines() if line.startswith("| hidden/kernel "))
    assert "(6, 32)" in row and "float32" in row and f"{6 * 32 * 4:,}" in row
    n = sum(p.size for p in jax.tree.leaves(params))
    assert f"Total: {n:,} values -- {4 * n:,} bytes" in out
    # one step, one item
    rc, out, _ = run_cli(capsys, "inspect", os.path.join(directory, "10", "params"))
    assert rc == 0 and "out/bias" in out and "opt_state" not in out
    rc, out, _ = run_cli(capsys, "inspect", directory, "--step", 20)
    assert rc == 0 and out.splitlines()[0].endswith("20")


def test_verify_ok_and_damaged(ckpt_dir, capsys, tmp_path):
    directory, _ = ckpt_dir
    rc, out, _ = run_cli(capsys, "verify", directory, "--all")
    assert rc == 0, out
    assert out.count("\nok ") + out.startswith("ok ") == 3 * 4  # params, opt_state, step, extras
    damaged = tmp_path / "damaged"
    shutil.copytree(directory, damaged)
    flip_byte(damaged, "params")
    rc, out, err = run_cli(capsys, "verify", damaged)
    assert rc == cli.EXIT_DAMAGED
    bad = [line for line in out.splitlines() if line.startswith("DAMAGED")]
    assert len(bad) == 1 and "30/params" in bad[0] and "hidden/" in bad[0]
    assert "30/params" in err
    # the other steps are intact
    rc, _, _ = run_cli(capsys, "verify", damaged, "--step", 20)
    assert rc == 0


def test_export_safetensors_equals_params(ckpt_dir, capsys, tmp_path):
    directory, params = ckpt_dir
    out_file = tmp_path / "params.safetensors"
    rc, out, err = run_cli(capsys, "export", directory, out_file, "--format", "safetensors")
    assert rc == 0, err
    loaded = safetensors.numpy.load_file(str(out_file))
    flat = {
        "/".join(k.key for k in path).replace("/", "."): np.asarray(v)
        for path, v in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert (
        sorted(loaded) == sorted(flat) == ["hidden.bias", "hidden.kernel", "out.bias", "out.kernel"]
    )
    for name, value in flat.items():
        assert loaded[name].dtype == value.dtype
        np.testing.assert_array_equal(loaded[name], value)

    # with a dtype: floating leaves are cast
    bf16 = tmp_path / "params-bf16.safetensors"
    rc, _, err = run_cli(capsys, "export", directory, bf16, "--dtype", "bfloat16")
    assert rc == 0, err
    assert os.path.getsize(bf16) < os.path.getsize(out_file)
    with safetensors.safe_open(str(bf16), framework="flax") as f:
        for name, value in flat.items():
            got = np.asarray(f.get_tensor(name))
            assert got.dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(got, value.astype(ml_dtypes.bfloat16))


def test_export_refuses_damaged_and_leaves_no_file(ckpt_dir, capsys, tmp_path):
    directory, _ = ckpt_dir
    damaged = tmp_path / "damaged"
    shutil.copytree(directory, damaged)
    flip_byte(damaged, "params")
    out_file = tmp_path / "p.safetensors"
    rc, out, err = run_cli(capsys, "export", damaged, out_file)
    assert rc == cli.EXIT_ERROR
    assert "damaged" in err and len(err.strip().splitlines()) == 1
    assert not out_file.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("p.safetensors")]


def test_gc(ckpt_dir, capsys, tmp_path):
    directory, _ = ckpt_dir
    work = tmp_path / "gc"
    shutil.copytree(directory, work)
    os.makedirs(work / "40.partial-abc123" / "params")  # what a dead save leaves
    (work / "40.partial-abc123" / _ownership.PENDING_FILE).write_bytes(
        _ownership._pending_bytes("abc123")
    )
    os.makedirs(work / "50.partial-abc123" / "mine")  # our name pattern, not our marker
    rc, out, _ = run_cli(capsys, "list", work)
    assert "unfinished" in out and "40.partial-abc123" in out
    rc, out, _ = run_cli(capsys, "gc", work, "--keep", 2)
    assert rc == 0
    assert "removed steps: 10" in out and "removed unfinished: 40.partial-abc123" in out
    assert sorted(n for n in os.listdir(work) if not n.startswith(".")) == [
        "20",
        "30",
        "50.partial-abc123",
    ]
    shutil.rmtree(work / "50.partial-abc123")
    # refused while a live writer holds the directory
    with fop.CheckpointManager(work):
        rc, _, err = run_cli(capsys, "gc", work, "--keep", 1)
    assert rc == cli.EXIT_ERROR and "writer" in err
    assert sorted(n for n in os.listdir(work) if not n.startswith(".")) == ["20", "30"]


def test_list_and_gc_agree_on_a_step_written_in_place_by_a_killed_writer(
    ckpt_dir, capsys, tmp_path
):
    """On an object store a step is written in place, under its own name, with our
    pending marker: a killed writer leaves ``40/`` holding only that. ``list`` called it
    foreign (not ours: left alone) while ``gc`` removed it as unfinished."""
    directory, _ = ckpt_dir
    work = tmp_path / "run"
    shutil.copytree(directory, work)
    os.makedirs(work / "40")
    (work / "40" / _ownership.PENDING_FILE).write_bytes(_ownership._pending_bytes("abc123"))
    rc, out, _ = run_cli(capsys, "list", work, "--json")
    listing = json.loads(out)
    assert rc == 0 and listing["unfinished"] == ["40"] and "40" not in listing["foreign"]
    rc, out, _ = run_cli(capsys, "gc", work, "--dry-run")
    assert "unfinished: 40" in out


def test_gc_of_a_directory_that_is_no_run_writes_nothing_there(capsys, tmp_path):
    """Nothing of ours to remove or keep: no writer opens there, no lock file is left."""
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("mine")
    os.makedirs(foreign / "7.partial-abc123" / "x")  # our name pattern, not our marker
    rc, out, _ = run_cli(capsys, "gc", foreign, "--keep", 1)
    assert rc == 0 and "removed unfinished: none" in out
    assert sorted(os.listdir(foreign)) == ["7.partial-abc123", "todo.txt"]


def test_gc_one_level_above_or_below_a_run_says_where_the_run_is(capsys, tmp_path, ckpt_dir):
    """Pointed one level off a run, gc freed nothing with exit 0 (a cron job's would,
    every day, unnoticed): an error naming where the run is (a folder of other things
    is still fine: above)."""
    nest = tmp_path / "nest"
    shutil.copytree(ckpt_dir[0], nest / "r")
    (nest / "notes.txt").write_text("mine")
    rc, _, err = run_cli(capsys, "gc", nest, "--keep", 1)
    assert rc == 2 and "one level down" in err and str(nest / "r") in err, err
    item = next(p for p in (nest / "r").iterdir() if p.name.isdigit()) / "params"
    rc, _, err = run_cli(capsys, "gc", item / "data", "--keep", 1)
    assert rc == 2 and "folder inside the item" in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, _ = run_cli(capsys, "gc", empty, "--keep", 1)  # nothing there at all: fine
    assert rc == 0 and "removed steps: none" in out


def test_errors_are_one_line_with_nonzero_exit(tmp_path):
    """Through the real entry point: `python -m flax_orbax_plugin`, no traceback."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for argv in (
        ["inspect", str(tmp_path / "missing")],
        ["verify", str(tmp_path)],
        ["export", str(tmp_path), str(tmp_path / "x.safetensors")],
    ):
        p = subprocess.run(
            [sys.executable, "-m", "flax_orbax_plugin", *argv],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert p.returncode == cli.EXIT_ERROR, p
        assert "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert p.stderr.startswith(f"flax-orbax {argv[0]}: error: ")


def test_no_progress_bar_when_stderr_is_no_terminal(ckpt_dir, capsys):
    """pytest captures stderr (no terminal): plain lines, no carriage return or escape
    (the bar under a real pseudo-terminal: tests/cli/test_cli_progress.py)."""
    directory, _ = ckpt_dir
    rc, out, err = run_cli(capsys, "verify", directory)
    assert rc == 0 and "\r" not in out + err and "\x1b" not in out + err


def test_export_and_verify_read_a_group_of_leaves_at_a_time(
    ckpt_dir, capsys, tmp_path, monkeypatch
):
    """With a tiny group size every leaf is its own partial restore: same file, and
    verify names only the leaves whose chunks are damaged."""
    directory, params = ckpt_dir
    whole = tmp_path / "whole.safetensors"
    assert run_cli(capsys, "export", directory, whole)[0] == 0
    from flax_orbax_plugin._interop.safetensors import outputs as _safetensors

    monkeypatch.setattr(_safetensors, "_GROUP_BYTES", 1)
    one_by_one = tmp_path / "one.safetensors"
    assert run_cli(capsys, "export", directory, one_by_one)[0] == 0
    assert whole.read_bytes() == one_by_one.read_bytes()

    # A lone core checkpoint with leaves large enough to live in chunks of their own.
    tree = {k: np.arange(200_000, dtype=np.float32) + i for i, k in enumerate("abcd")}
    lone = tmp_path / "lone"
    fop.save(lone, tree, format_version=1)  # version 2 batches them
    files = [os.path.join(d, f) for d, _, fs in os.walk(lone) for f in fs]
    target = max(files, key=os.path.getsize)  # the data, leaf after leaf
    _files.flip_byte(target, os.path.getsize(target) * 3 // 8)  # in the second leaf's bytes
    rc, out, _ = run_cli(capsys, "verify", lone)
    assert rc == cli.EXIT_DAMAGED
    line = next(line for line in out.splitlines() if line.startswith("DAMAGED"))
    assert len(set(re.findall(r"leaf '([a-d])'", line))) == 1, line


def test_export_of_a_prng_key_is_a_clear_error(tmp_path, capsys):
    import jax

    with fop.CheckpointManager(tmp_path / "run") as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32), "k": jax.random.key(0)}})
    rc, _, err = run_cli(capsys, "export", tmp_path / "run", tmp_path / "out.safetensors")
    assert rc == 2
    assert "leaf 'k': a PRNG key array has no safetensors equivalent" in err
    assert not (tmp_path / "out.safetensors").exists()


def test_a_file_and_non_ascii_digit_folders_are_named_for_what_they_are(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    rc, _, err = run_cli(capsys, "list", tmp_path / "notes.txt")
    assert rc == 2 and "is a file, not a checkpoint directory" in err
    with pytest.raises(fop.CheckpointNotFoundError, match="is a file"):
        fop.restore(tmp_path / "notes.txt")
    run_dir = tmp_path / "run"
    with fop.CheckpointManager(run_dir) as mngr:
        mngr.save(1, {"params": {"w": np.ones(2, np.float32)}})
    (run_dir / "\u0663").mkdir()  # ARABIC-INDIC DIGIT THREE: str.isdigit() is True
    rc, out, _ = run_cli(capsys, "list", run_dir)
    assert rc == 0 and "1 step(s)" in out and "(left alone): \u0663" in out
    rc, out, _ = run_cli(capsys, "gc", run_dir, "--keep", "1")
    assert rc == 0 and "removed steps: none" in out and (run_dir / "\u0663").is_dir()


def test_flags_are_checked_in_the_command_lines_words(capsys, ckpt_dir, tmp_path):
    """The library's keyword (keep must be ..., step=... and all_steps=True conflict)
    and Python's class name (ValueError: ...) leaked into the messages."""
    directory = ckpt_dir[0]
    big = tmp_path / "big"  # a value float16 cannot hold: the cast refused
    with fop.CheckpointManager(big) as mngr:
        mngr.save(1, {"params": {"w": np.array([1e5, 1.0], np.float32)}})
    for argv, words in (
        (("gc", directory, "--keep", 0), "--keep: expected a positive int, found 0"),
        (("gc", directory, "--keep", 1, "--keep-every", -3), "--keep-every: expected a positive"),
        (("verify", directory, "--step", 10, "--all"), "--step 10 and --all: choose one"),
        (("export", directory, tmp_path / "x.safetensors", "--cast", "unsafe"), "without --dtype"),
        (("export", directory, tmp_path / "y.safetensors", "--max-shard-size", "0"), "max shard"),
        (("export", big, tmp_path / "z.safetensors", "--dtype", "float16"), "--cast unsafe casts"),
        (("export", directory, tmp_path / "x.safetensors", "--dtype", "int8"), "--dtype: expected"),
        (("export", directory, tmp_path / "y.safetensors", "--max-shard-size", "x"), "--max-shard"),
    ):
        try:
            rc, _, err = run_cli(capsys, *argv)
        except SystemExit as e:  # argparse's own refusal
            rc, err = e.code, capsys.readouterr().err
        assert rc == 2 and words in err, (argv, err)
        assert "ValueError" not in err and "keep_every" not in err and "all_steps" not in err
        assert "cast='unsafe'" not in err and "max_shard_size" not in err, err
        assert not err.split("error: ", 1)[-1].startswith("dtype"), err
    assert not any((tmp_path / f"{n}.safetensors").exists() for n in "xyz")


def test_an_interruption_says_what_was_done_before_it(capsys, monkeypatch, tmp_path):
    """An import interrupted after its first step said only 'interrupted': the steps
    it had committed (the import's note) are said too, so a re-run knows why step 1
    exists already."""
    from flax_orbax_plugin.cli import dispatch

    def interrupted(args, *_, **__):
        e = KeyboardInterrupt()
        e.add_note(f"the import committed step(s) [1] to {args.out} before it failed")
        raise e

    monkeypatch.setattr(dispatch, "run", interrupted)
    rc, _, err = run_cli(capsys, "import", tmp_path / "src", tmp_path / "out")
    assert rc == 130
    assert err.strip() == (
        f"flax-orbax import: interrupted (the import committed step(s) [1] to "
        f"{tmp_path / 'out'} before it failed)"
    )


def test_an_unreadable_folder_is_named_by_its_whole_path(tmp_path):
    """'[Errno 13] Permission denied: 'data'' named only the last part of the path."""
    import shutil as _shutil

    if os.geteuid() == 0 and _shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: nothing can be made unreadable")
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        mngr.save(200, {"params": {"w": np.ones(3)}, "opt_state": {"m": np.ones(2)}})
    command = [sys.executable, "-m", "flax_orbax_plugin", "verify", str(run), "--step", "200"]
    if os.geteuid() == 0:
        drop = "-dac_override,-dac_read_search,-fowner"
        command = ["setpriv", "--inh-caps", drop, "--bounding-set", drop, *command]
    os.chmod(run / "200" / "opt_state" / "data", 0)
    try:
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    finally:
        os.chmod(run / "200" / "opt_state" / "data", 0o755)
    assert proc.returncode == 2, proc.stderr
    assert f"Permission denied: '{run / '200' / 'opt_state' / 'data'}'" in proc.stderr, proc.stderr


def test_gc_dry_run_names_what_it_would_leave_inside_a_step(capsys, tmp_path):
    run = tmp_path / "run"
    with fop.CheckpointManager(run) as mngr:
        for step in (1, 2, 3):
            mngr.save(step, {"params": {"w": np.ones(3, np.float32)}})
    (run / "1" / "NOTES.txt").write_text("mine")
    rc, out, _ = run_cli(capsys, "gc", run, "--keep", 1, "--dry-run")
    assert rc == 0 and "would leave what this library did not write: 1/NOTES.txt" in out, out
    rc, out, _ = run_cli(capsys, "gc", run, "--keep", 1)
    assert rc == 0 and (run / "1" / "NOTES.txt").read_text() == "mine"


def test_import_while_a_job_writes_the_directory_says_so(capsys, tmp_path):
    """It said 'open it with read_only=True', a keyword of the library's."""
    from flax.training import checkpoints

    checkpoints.save_checkpoint(tmp_path / "ck", {"params": {"w": np.ones(3)}}, step=5)
    with fop.CheckpointManager(tmp_path / "run"):  # a training job's writer, holding the lock
        rc, _, err = run_cli(capsys, "import", tmp_path / "ck", tmp_path / "run")
    assert rc == 2 and "import writes nothing while a training job writes there" in err, err
    assert "read_only" not in err, err


def test_an_argument_a_command_does_not_take_is_that_commands_error(capsys, tmp_path):
    """'flax-orbax list DIR --step 3' printed the top-level usage ('flax-orbax [-h]
    [--version] COMMAND ...') and 'flax-orbax: error: ...', hiding what list takes."""
    for argv, usage, line in (
        (("list", tmp_path, "--step", "3"), "usage: flax-orbax list [-h] [--json]", "list: error"),
        (("gc", tmp_path, "--bogus"), "usage: flax-orbax gc [-h] [--keep KEEP]", "gc: error"),
        (("--json", "list", tmp_path), "usage: flax-orbax [-h]", "go after it: flax-orbax list"),
    ):
        with pytest.raises(SystemExit) as e:
            cli.main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(usage) and line in err, (argv, err)
        assert "unrecognized arguments: " in err, err


def test_the_commands_it_suggests_can_be_pasted_when_the_path_has_spaces(capsys, tmp_path):
    """'`flax-orbax inspect /tmp/my run/1/params` shows its leaves': pasted, that is
    three arguments."""
    import shlex

    run = tmp_path / "my run é"
    with fop.CheckpointManager(run) as mngr:
        mngr.save(1, {"params": {"w": np.ones(3, np.float32)}})
    item = run / "1" / "params"
    rc, out, _ = run_cli(capsys, "list", item)
    assert rc == 0 and f"`flax-orbax inspect {shlex.quote(str(item))}` shows" in out, out
    rc, _, err = run_cli(capsys, "list", item, "--json")
    assert rc == 2 and f"`flax-orbax inspect {shlex.quote(str(item))}`" in err, err
    pasted = re.search(r"`flax-orbax inspect ([^`]*)`", err).group(1)
    assert shlex.split(pasted) == [str(item)]
