r"""Trains a small Linen MLP on generated spirals, checkpointing with flax_orbax_plugin.

    python examples/train.py --config=configs/default.py
    # ...killed or preempted? Continue from the latest checkpoint:
    python examples/train.py --config=configs/default.py --config.checkpoint.resume=True

The run is deterministic: the same config gives bit-identical params, whether the
run was interrupted and resumed or not. The last line of output is the sha256 of
the final params (see model.params_digest).
"""

import functools
import os
import sys
import time

import jax
import optax
from absl import app, flags
from clu import metrics
from flax import struct
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data
import model as model_lib

import flax_orbax_plugin as fop

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training configuration file.")


@struct.dataclass
class TrainMetrics(metrics.Collection):
    loss: metrics.Average.from_output("loss")
    accuracy: metrics.Accuracy


@functools.partial(jax.jit, donate_argnums=0)
def train_step(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads)
    return state, TrainMetrics.single_from_model_output(logits=logits, labels=batch["y"], loss=loss)


class PrintWriter:
    """A minimal metric writer with CLU's `write_scalars(step, scalars)` shape: the
    training loop's metrics, and the checkpoint events that `fop.MetricWriterEvents`
    writes (a `clu.metric_writers.SummaryWriter` would put both in TensorBoard).

    Events of the background phase (a commit, a removal) arrive on the library's own
    threads: each line is written in one call, so lines never interleave."""

    def write_scalars(self, step: int, scalars) -> None:
        if any(tag.startswith("checkpoint/") for tag in scalars):
            line = f"checkpoint {step:5d} | {_checkpoint_figures(scalars)}"
        else:
            line = f"step {step:5d} | " + " | ".join(
                f"{k} {float(v):.4g}" for k, v in scalars.items()
            )
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _checkpoint_figures(s) -> str:
    """One checkpoint event's scalars (fop.Event.scalars) as words."""
    if "checkpoint/save_blocking_seconds" in s:
        return f"blocking {s['checkpoint/save_blocking_seconds']:.4f} s"
    if "checkpoint/save_background_seconds" in s:
        stored = ""
        if "checkpoint/save_bytes" in s:
            files, mib = s["checkpoint/save_files"], s["checkpoint/save_bytes"] / 2**20
            stored = f" | {files:.0f} files, {mib:.2f} MiB"
        return (
            f"committed: background {s['checkpoint/save_background_seconds']:.4f} s"
            f" | total {s['checkpoint/save_total_seconds']:.4f} s{stored}"
            f" | {s['checkpoint/save_gbytes_per_sec']:.3f} GB/s"
        )
    if "checkpoint/restore_seconds" in s:
        return f"restored in {s['checkpoint/restore_seconds']:.4f} s"
    if "checkpoint/steps_removed" in s:
        return f"retention removed {s['checkpoint/steps_removed']:.0f} step(s)"
    return " | ".join(f"{k} {v:.4g}" for k, v in s.items())  # e.g. save_failed


def train_and_evaluate(config):
    """Runs training to `config.num_train_steps`; returns the final TrainState."""
    train_data, _ = data.train_and_test(config.seed)
    it = data.train_iterator(train_data, batch_size=config.batch_size, seed=config.seed)
    model = model_lib.make_model(config, data.NUM_CLASSES)
    state = model_lib.create_train_state(config, model, data.NUM_FEATURES)
    writer = PrintWriter()
    last_scalars: dict[str, float] = {}

    ckpt = config.checkpoint
    tiers = {}
    if ckpt.get("persistent_directory"):
        tier = fop.Tier(
            ckpt.persistent_directory,
            keep=ckpt.persistent_keep,
            keep_every=ckpt.persistent_keep_every,
            grace_seconds=ckpt.persistent_grace_seconds,
        )
        tiers = {"persistent": tier}
    resume = {"true": True, "false": False, "required": "required"}.get(str(ckpt.resume).lower())
    if resume is None:
        raise ValueError(
            f"checkpoint.resume: expected True, False or required, found {ckpt.resume}"
        )
    callback = fop.CheckpointCallback(
        ckpt.directory,
        every_steps=ckpt.every_steps,
        every_seconds=ckpt.every_seconds,
        keep=ckpt.keep or None,  # 0: keep every step (a flag cannot say None for an int)
        resume=resume,
        overwrite=ckpt.overwrite,
        async_save=ckpt.async_save,
        on_event=fop.MetricWriterEvents(writer),  # each save's and restore's figures
        extras_fn=lambda step, state: dict(last_scalars),  # metrics shown by `flax-orbax list`
        manager_options={**tiers, "handle_sigterm": ckpt.handle_sigterm},
    )
    try:
        state = callback.on_train_start(state, data_iterator=it)
    except fop.CheckpointError as e:
        if resume is not False or ckpt.overwrite or not _holds_steps(ckpt.directory):
            raise
        # Another run's steps are there (`make demo` fills the default directory): one
        # line in this script's flags rather than the library's traceback.
        raise SystemExit(
            f"train.py: {ckpt.directory} already holds the steps of a run; continue it with "
            f"--config.checkpoint.resume=True, start it over with "
            f"--config.checkpoint.overwrite=True, or give another "
            f"--config.checkpoint.directory=DIR"
        ) from e
    first_step = int(state.step) + 1
    if first_step > 1:
        print(f"resumed from step {first_step - 1}", flush=True)
    else:
        print("starting from scratch", flush=True)

    window, t0 = None, time.perf_counter()
    for step in range(first_step, config.num_train_steps + 1):
        state, step_metrics = train_step(state, next(it))
        window = step_metrics if window is None else window.merge(step_metrics)
        if step % config.log_every_steps == 0 or step == config.num_train_steps:
            scalars = {k: float(v) for k, v in window.compute().items()}
            last_scalars.update(scalars)
            scalars["steps_per_sec"] = config.log_every_steps / (time.perf_counter() - t0)
            writer.write_scalars(step, scalars)
            window, t0 = None, time.perf_counter()
        callback.on_step_end(step, state)
    callback.on_train_end(state)
    return state


def _holds_steps(directory: str) -> bool:
    try:
        with fop.CheckpointManager(directory, read_only=True) as reader:
            return bool(reader.steps())
    except fop.CheckpointError:
        return False


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    config = _CONFIG.value
    state = train_and_evaluate(config)
    print(f"final params sha256 {model_lib.params_digest(state.params)}", flush=True)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main)
