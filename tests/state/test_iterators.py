"""StepIndexedIterator: a training loop resumed from its checkpoint sees the same batches.

The in-memory and plain-Python forms always run; the tf.data form runs when
tensorflow is importable (it is not a test dependency).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import StepIndexedIterator

X = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
Y = (X @ np.array([1.0, -2.0, 0.5], np.float32))[:, None]
BATCH = 8
STEPS_PER_EPOCH = len(X) // BATCH  # 5
NUM_STEPS = 13  # crosses two epoch boundaries


def make_batch(index):
    """In-memory: a permutation per epoch, seeded by the epoch."""
    epoch, i = divmod(index, STEPS_PER_EPOCH)
    order = np.random.default_rng([7, epoch]).permutation(len(X))
    rows = order[i * BATCH : (i + 1) * BATCH]
    return {"x": X[rows], "y": Y[rows]}


def make_epoch_lists(epoch):
    """Plain Python: a list of batches per epoch (no skip(): the adapter drops batches)."""
    return [make_batch(epoch * STEPS_PER_EPOCH + i) for i in range(STEPS_PER_EPOCH)]


@jax.jit
def train_step(w, batch):
    grads = jax.grad(lambda w: jnp.mean((batch["x"] @ w - batch["y"]) ** 2))(w)
    return w - 0.05 * grads


def run(directory, make_iterator, *, stop_at=NUM_STEPS, resume=False):
    """The callback's loop; stopping early without a final save stands for a crash."""
    it = make_iterator()
    cb = fop.CheckpointCallback(directory, every_steps=4, resume=resume, async_save=False)
    state = cb.on_train_start({"w": jnp.zeros((3, 1)), "step": 0}, data_iterator=it)
    seen = []
    for step in range(state["step"] + 1, stop_at + 1):
        batch = next(it)
        seen.append(np.asarray(batch["x"]).copy())
        state = {"w": train_step(state["w"], batch), "step": step}
        cb.on_step_end(step, state)
    if stop_at == NUM_STEPS:
        cb.on_train_end(state)
    else:
        cb.close()
    return state, seen, cb.resumed_step


def assert_resumes_bit_exact(tmp_path, make_iterator):
    full, full_seen, _ = run(tmp_path / "full", make_iterator)
    _, first_seen, _ = run(tmp_path / "cut", make_iterator, stop_at=10)  # last save: step 8
    resumed, rest_seen, resumed_step = run(tmp_path / "cut", make_iterator, resume=True)
    assert resumed_step == 8  # mid-epoch: batch 3 of epoch 1
    seen = first_seen[:8] + rest_seen
    assert len(seen) == len(full_seen) == NUM_STEPS
    for a, b in zip(seen, full_seen, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(resumed["w"]), np.asarray(full["w"]))
    # the batches really are reshuffled per epoch (else the test could not fail)
    assert not np.array_equal(full_seen[0], full_seen[STEPS_PER_EPOCH])


def test_in_memory_shuffle_by_index_resumes_bit_exact(tmp_path):
    assert_resumes_bit_exact(tmp_path, lambda: StepIndexedIterator(make_batch))


def test_per_epoch_iterables_resume_bit_exact(tmp_path):
    assert_resumes_bit_exact(tmp_path, lambda: StepIndexedIterator(make_epoch=make_epoch_lists))


def test_tf_data_resumes_bit_exact(tmp_path):
    tf = pytest.importorskip("tensorflow", reason="tensorflow is not installed (optional)")

    def make_epoch(epoch):
        ds = tf.data.Dataset.from_tensor_slices({"x": X, "y": Y})
        return ds.shuffle(len(X), seed=epoch).batch(BATCH, drop_remainder=True).prefetch(2)

    assert_resumes_bit_exact(tmp_path, lambda: StepIndexedIterator(make_epoch=make_epoch))


def test_state_is_json_and_seek_matches_set_state():
    it = StepIndexedIterator(make_epoch=make_epoch_lists, steps_per_epoch=STEPS_PER_EPOCH)
    for _ in range(7):
        next(it)
    assert it.get_state() == {"index": 7, "epoch": 1, "offset": 2}
    expected = next(it)
    other = StepIndexedIterator(make_epoch=make_epoch_lists, steps_per_epoch=STEPS_PER_EPOCH)
    other.seek(7)
    np.testing.assert_array_equal(next(other)["x"], expected["x"])
    by_index = StepIndexedIterator(make_batch)
    by_index.seek(7)
    np.testing.assert_array_equal(next(by_index)["x"], expected["x"])
    assert by_index.get_state() == {"index": 8}


def test_num_epochs_ends_the_iteration():
    it = StepIndexedIterator(make_epoch=make_epoch_lists, num_epochs=2)
    assert len(list(it)) == 2 * STEPS_PER_EPOCH


def test_bad_states_and_arguments_are_clear_errors():
    by_index = StepIndexedIterator(make_batch)
    by_epoch = StepIndexedIterator(make_epoch=make_epoch_lists)
    with pytest.raises(ValueError, match="'index' must be a non-negative int, found -1"):
        by_index.set_state({"index": -1})
    with pytest.raises(ValueError, match="saved by the make_epoch form"):
        by_index.set_state({"index": 3, "epoch": 0, "offset": 3})
    with pytest.raises(ValueError, match="saved by the make_batch form"):
        by_epoch.set_state({"index": 3})
    with pytest.raises(ValueError, match="needs steps_per_epoch"):
        by_epoch.seek(3)
    with pytest.raises(TypeError, match="exactly one of make_batch or make_epoch"):
        StepIndexedIterator()
    by_epoch.set_state({"index": 9, "epoch": 0, "offset": 9})
    with pytest.raises(ValueError, match="batch 9 of epoch 0, but make_epoch\\(0\\) yields only 5"):
        next(by_epoch)
    empty = StepIndexedIterator(make_epoch=lambda epoch: [])
    with pytest.raises(ValueError, match=r"make_epoch\(0\) yielded no batch"):
        next(empty)


def test_unsupported_iterator_error_names_the_adapter(tmp_path):
    with fop.CheckpointManager(tmp_path) as mngr:
        with pytest.raises(TypeError, match=r"has neither get_state.*fop.StepIndexedIterator"):
            mngr.save(1, {"w": np.zeros(2)}, data_iterator=iter([1, 2, 3]))
    assert mngr.steps() == []


def test_a_dataset_given_for_its_iterator_is_named_as_such(tmp_path):
    """grain's dataset and DataLoader are iterables whose iterators hold the position:
    given themselves, the error said they lack get_state() and pointed at a wrapper,
    not at ``iter(dataset)``, the one-word fix."""
    grain = pytest.importorskip("grain.python")
    dataset = grain.MapDataset.range(10).to_iter_dataset()
    cb = fop.CheckpointCallback(tmp_path, every_steps=1)
    with pytest.raises(TypeError, match=r"IterDataset is an iterable.*iter\(dataset\)"):
        cb.on_train_start({"w": np.zeros(2)}, data_iterator=dataset)
    with fop.CheckpointManager(tmp_path) as mngr:
        with pytest.raises(TypeError, match=r"a list is an iterable.*iter\(dataset\)"):
            mngr.save(1, {"w": np.zeros(2)}, data_iterator=[1, 2, 3])
        mngr.save(1, {"w": np.zeros(2)}, data_iterator=iter(dataset))  # the iterator saves
    assert fop.CheckpointManager(tmp_path, read_only=True).steps() == [1]
