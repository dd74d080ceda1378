"""Training-state adapters: TrainState/NNX split and merge, resume, iterators."""
