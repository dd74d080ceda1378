"""Default configuration for examples/train.py and examples/serve.py.

Override any field on the command line, for example:

    python examples/train.py --config=configs/default.py \
        --config.checkpoint.resume=True --config.num_train_steps=4000
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.num_train_steps = 2000
    config.batch_size = 128
    config.learning_rate = 2e-3
    config.hidden_sizes = (256, 256, 256)
    config.log_every_steps = 100

    # Where checkpoints go and how often; `resume` picks up the latest step.
    config.checkpoint = ml_collections.ConfigDict()
    config.checkpoint.directory = "runs/demo/checkpoints"
    config.checkpoint.every_steps = 200
    # Also save when this many seconds passed since the last save (None: off).
    config.checkpoint.every_seconds = ml_collections.config_dict.placeholder(float)
    config.checkpoint.keep = 3  # the newest steps kept; 0 keeps every step
    # True: continue from the latest good step when one exists (start fresh otherwise).
    # False on a directory that already holds steps is refused, unless `overwrite`
    # (which removes them first): two runs never mix in one directory.
    # A preemptible job (restarted by its scheduler with the same command) runs with
    # --config.checkpoint.resume=True from its very first start: the first start finds
    # no step and starts fresh, every restart resumes. "required" refuses to start
    # fresh (an evaluation or fine-tune that must find a checkpoint). A string, so
    # that all three reach it from the command line: True, False or required.
    config.checkpoint.resume = "False"
    config.checkpoint.overwrite = False
    # Save in the background while training continues (the blocking phase only
    # copies to host memory). ("async" itself is a Python keyword.)
    config.checkpoint.async_save = True
    # Two tiers: `directory` is then a fast local disk, and every committed step is
    # also copied in the background to this persistent location (s3://, gs:// or a
    # shared filesystem), which keeps its own steps: the last `persistent_keep`
    # (None: all) and every `persistent_keep_every`-th (examples/train.py makes them a
    # fop.Tier(persistent_directory, keep=..., keep_every=...)). Resume takes the newest good
    # step of either tier (a new machine with an empty disk resumes from the bucket).
    config.checkpoint.persistent_directory = ml_collections.config_dict.placeholder(str)
    config.checkpoint.persistent_keep = ml_collections.config_dict.placeholder(int)
    config.checkpoint.persistent_keep_every = ml_collections.config_dict.placeholder(int)
    # SIGTERM (a preemption's notice): the step reached is saved, the loop stops and the
    # job exits 143 once the save committed (False: the signal's default, no save).
    config.checkpoint.handle_sigterm = True
    # After SIGTERM: how long the exit waits for the last step to reach the bucket.
    config.checkpoint.persistent_grace_seconds = 30.0
    return config
