r"""Serves a trained model: restores the params alone and scores held-out data.

    python examples/serve.py --config=configs/default.py [--step=N]

Only the params are read; the optimizer state, data iterator position and extras
stay on disk untouched. The template comes from jax.eval_shape, so nothing is
allocated twice.
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data
import model as model_lib

import flax_orbax_plugin as fop

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training configuration file.")
_STEP = flags.DEFINE_integer("step", None, "Step to serve (default: the latest).")


def serve(config, step=None):
    """Returns (held-out accuracy, params) for the checkpoint at `step` (latest if None)."""
    _, test = data.train_and_test(config.seed)
    model = model_lib.make_model(config, data.NUM_CLASSES)
    like = model_lib.abstract_params(config, model, data.NUM_FEATURES)
    params = fop.restore_params(config.checkpoint.directory, like, step=step)

    predict = jax.jit(lambda p, x: jnp.argmax(model.apply({"params": p}, x), axis=-1))
    predictions = np.asarray(predict(params, test["x"]))
    return float(np.mean(predictions == test["y"])), params


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    config = _CONFIG.value
    accuracy, params = serve(config, _STEP.value)
    n = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(params))
    print(f"served params ({n} values) from {config.checkpoint.directory}", flush=True)
    print(f"held-out accuracy {accuracy:.4f}", flush=True)
    print(f"served params sha256 {model_lib.params_digest(params)}", flush=True)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
