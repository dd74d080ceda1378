"""``flax-orbax import`` of safetensors: a file was read as msgpack ('malformed complex
payload') and a folder of shards got 'no flax.training.checkpoints files'; only Python
could bring an export back. Each comes back as item ``params`` of the step given, its
leaf paths as the export named them; a file of no known kind is named as such."""

from __future__ import annotations

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli

PARAMS = {
    "Dense_0": {"kernel": np.arange(12, dtype=np.float32).reshape(4, 3), "bias": np.ones(3)},
    "emb": np.arange(40, dtype=np.int32),
}


@pytest.fixture
def exports(tmp_path):
    fop.save(tmp_path / "ckpt", PARAMS)
    fop.to_safetensors(tmp_path / "ckpt", tmp_path / "model.safetensors")
    fop.to_safetensors(tmp_path / "ckpt", tmp_path / "shards", max_shard_size=100)
    assert len(list((tmp_path / "shards").glob("*.safetensors"))) > 1
    return tmp_path


@pytest.mark.parametrize(
    "source", ["model.safetensors", "shards", "shards/model.safetensors.index.json"]
)
def test_an_export_comes_back_as_the_params_of_the_step_given(exports, source, capsys):
    out = exports / "run"
    assert cli.main(["import", str(exports / source), str(out), "--step", "5"]) == 0
    assert "imported step(s) 5" in capsys.readouterr().out
    with fop.CheckpointManager(out, read_only=True) as reader:
        assert reader.steps() == [5]
        got = reader.restore(items="params")
    flat_got = dict(fop.metadata(out / "5" / "params").leaves)
    assert sorted(flat_got) == ["Dense_0/bias", "Dense_0/kernel", "emb"]
    np.testing.assert_array_equal(got["Dense_0"]["kernel"], PARAMS["Dense_0"]["kernel"])
    np.testing.assert_array_equal(got["emb"], PARAMS["emb"])


def test_without_a_step_or_of_an_unknown_file_the_error_says_what_it_found(exports, capsys):
    assert cli.main(["import", str(exports / "model.safetensors"), str(exports / "a")]) == 2
    assert "--step" in capsys.readouterr().err
    (exports / "notes.txt").write_text("not a checkpoint")
    assert cli.main(["import", str(exports / "notes.txt"), str(exports / "b")]) == 2
    err = capsys.readouterr().err
    assert "neither a Flax msgpack checkpoint" in err and "safetensors" in err, err
    assert not (exports / "a").exists() and not (exports / "b").exists()
