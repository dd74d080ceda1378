"""A directory of steps: policy, retention, checkpointables, tiers, the
CheckpointManager facade, the callback, preemption."""
