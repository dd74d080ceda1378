"""``inspect`` of a step holding items that are neither a pytree nor one JSON value:
Hugging Face shards (``fop.HFShards``) and a user's checkpointable. It read every such
item as JSON and exited 2 ('the step manifest records no checksum for it'); now the
shards' tensors are listed from their headers and a custom item is named by its kind."""

from __future__ import annotations

import json

import jsonschema
import numpy as np

import flax_orbax_plugin as fop
from flax_orbax_plugin import cli
from flax_orbax_plugin.cli.output import SCHEMAS


class _Notes:
    """A user's checkpointable: one file of its own (not the library's JSON item)."""

    kind = "notes"

    def save(self, directory, value, request):
        data = json.dumps(value).encode()

        class _Done:
            def wait(self):
                directory.makedirs()
                directory.write_bytes("notes.json", data, durable=False)
                return fop.Written(len(data), {})

        return _Done()

    def restore(self, directory, like, request):
        return json.loads(directory.read_bytes("notes.json"))


def _run(tmp_path):
    params = {"w": np.ones((3, 4), np.float32), "b": {"x": np.zeros(2, np.float16)}}
    hf = fop.HFShards(every_steps=1)
    with fop.CheckpointManager(
        tmp_path / "run", hf_shards=hf, checkpointables={"notes": _Notes()}
    ) as mngr:
        mngr.save(1, {"params": params, "notes": {"seen": 1}}, extras={"loss": 0.5})
    return tmp_path / "run"


def test_inspect_lists_the_shards_tensors_and_names_a_custom_items_kind(tmp_path, capsys):
    run = _run(tmp_path)
    assert cli.main(["inspect", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, SCHEMAS["inspect"])
    items = {d["name"]: d for d in doc["items"]}
    hf = items["hf"]
    assert hf["kind"] == "hf_safetensors"
    tensors = {leaf["path"]: (leaf["shape"], leaf["dtype"], leaf["bytes"]) for leaf in hf["leaves"]}
    assert tensors == {
        "w": ([3, 4], "float32", 48),
        "b.x": ([2], "float16", 4),
    }
    assert hf["total_bytes"] == 52 and hf["values"] == 14
    assert items["notes"]["kind"] == "notes" and "not described" in items["notes"]["note"]
    assert items["extras"]["value"] == {"loss": 0.5}

    assert cli.main(["inspect", str(run)]) == 0
    text = capsys.readouterr().out
    assert "| b.x " in text and "notes: notes (" in text
    assert cli.main(["inspect", str(run), "--summary"]) == 0
    assert "hf: 2 leaves, 14 values" in capsys.readouterr().out


def test_export_of_a_shards_item_names_its_kind_not_json(tmp_path, capsys):
    run = _run(tmp_path)
    assert cli.main(["export", str(run), str(tmp_path / "x.safetensors"), "--item", "hf"]) == 2
    err = capsys.readouterr().err
    assert "item 'hf' holds hf_safetensors, not a pytree" in err and "JSON" not in err
