"""A generated, learnable classification dataset and its grain pipeline.

Nothing is downloaded: the data are interleaved spirals (one arm per class) drawn
from a seeded numpy generator, so every machine builds the same bytes. A small MLP
learns them well, but not instantly, so the loss falls visibly over a few thousand
steps.
"""

from __future__ import annotations

import grain
import numpy as np

NUM_CLASSES = 4
NUM_FEATURES = 2


def spirals(num_examples: int, *, seed: int, noise: float = 0.2) -> dict[str, np.ndarray]:
    """Returns {"x": float32[n, 2], "y": int32[n]}: `NUM_CLASSES` interleaved spiral arms."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, NUM_CLASSES, size=num_examples).astype(np.int32)
    r = rng.uniform(0.05, 1.0, size=num_examples)
    theta = 5.0 * np.pi * r + 2.0 * np.pi * y / NUM_CLASSES
    x = np.stack([r * np.cos(theta), r * np.sin(theta)], axis=1)
    x = x + noise * r[:, None] * rng.normal(size=x.shape) / 4.0
    return {"x": (2.0 * x).astype(np.float32), "y": y}


def train_and_test(seed: int = 0, num_train: int = 8192, num_test: int = 2048):
    """The training set and a held-out test set drawn independently."""
    return spirals(num_train, seed=seed), spirals(num_test, seed=seed + 10_000)


class _Records:
    """A random-access source over columnar arrays; record i is {"x": x[i], "y": y[i]}."""

    def __init__(self, columns: dict[str, np.ndarray]):
        self._columns = columns
        self._len = len(next(iter(columns.values())))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        return {k: v[i] for k, v in self._columns.items()}


def train_iterator(columns: dict[str, np.ndarray], *, batch_size: int, seed: int):
    """An endless, shuffled, batched grain iterator with `get_state()` / `set_state()`.

    Its state is a small dict (the position), so a checkpoint of it lets a resumed
    run see exactly the batches an uninterrupted run would have seen.
    """
    ds = (
        grain.MapDataset.source(_Records(columns))
        .shuffle(seed=seed)
        .repeat(None)
        .batch(batch_size, drop_remainder=True)
    )
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))
