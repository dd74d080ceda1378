"""``inspect --plot`` (one step's leaves by size) and ``list --plot`` (a run's saves over
time): rendered with matplotlib and read back (PNG header and size, SVG parsed)."""

import struct
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plot") / "run"
    with fop.CheckpointManager(directory) as mngr:
        for step in (1, 2, 3):
            params = {"kernel": np.ones((64, 32), np.float32) * step, "bias": np.zeros(32)}
            mngr.save(step, {"params": params, "opt_state": {"mu": np.zeros((64, 32))}})
    return directory


def _svg_texts(path):
    root = ET.parse(path).getroot()  # a well-formed SVG document
    assert root.tag.endswith("svg")
    # matplotlib draws text as glyph paths (svg.fonttype "path"), each string in an XML
    # comment beside its glyphs: the labels are searched in the file's text
    return open(path, encoding="utf-8").read()


def test_inspect_plot_png(run_dir, tmp_path, capsys):
    out = tmp_path / "leaves.png"
    assert cli.main(["inspect", str(run_dir), "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width >= 600 and height >= 150  # drawn, not an empty canvas
    assert "wrote" in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".plot-")]


def test_inspect_plot_svg_names_the_leaves(run_dir, tmp_path):
    out = tmp_path / "leaves.svg"
    assert cli.main(["inspect", str(run_dir), "--item", "params", "--plot", str(out)]) == 0
    text = _svg_texts(out)
    assert "params/kernel" in text and "params/bias" in text and "opt_state" not in text


def test_list_plot_svg_of_saves_over_time(run_dir, tmp_path):
    out = tmp_path / "saves.svg"
    assert cli.main(["list", str(run_dir), "--plot", str(out)]) == 0
    text = _svg_texts(out)
    assert "bytes written" in text and "3 step(s)" in text


def test_plot_refuses_other_suffixes_and_places_inside_a_run(run_dir, tmp_path, capsys):
    assert cli.main(["inspect", str(run_dir), "--plot", str(tmp_path / "x.jpg")]) == 2
    assert "expected a file name ending in .png or .svg" in capsys.readouterr().err
    assert cli.main(["inspect", str(run_dir), "--plot", str(run_dir / "x.png")]) == 2
    assert "lies inside the run directory" in capsys.readouterr().err
    assert not (run_dir / "x.png").exists()


def test_without_matplotlib_the_message_says_how_to_get_it(run_dir, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    rc = cli.main(["inspect", str(run_dir), "--plot", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert rc == 2 and "--plot needs matplotlib" in err and "pip install" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "x.png").exists()
