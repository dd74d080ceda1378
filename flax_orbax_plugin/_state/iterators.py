"""Data position: :class:`StepIndexedIterator` (pipelines without grain), an iterator's
position read and set back, and the global position, the same on any process count.

Call order: one thread (the training loop's) calls every method, and reads and sets the position.

Design notes: ``docs/internals.md``, section ``flax_orbax_plugin._state.iterators``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from .._base.env import Option
from .._errors import OptionTypeError

__all__ = [
    "GLOBAL_POSITION_KEY",
    "StepIndexedIterator",
    "can_set",
    "check_iterator",
    "describe",
    "global_position",
    "iterator_state",
    "set_global_position",
    "set_iterator_state",
]


def _count(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, found {value!r}")
    return value


class StepIndexedIterator:
    """An iterator over batches rebuilt from their position, with a JSON state.

    Args:
      make_batch: ``make_batch(index) -> batch``, a pure function of the global
        batch index. Give this or ``make_epoch``. With several processes it makes
        this process's share of global batch ``index`` (from ``jax.process_index()``
        and ``jax.process_count()``): the position is then global, and a step saved
        on N processes resumes on M in the same order (``global_position()``).
      make_epoch: ``make_epoch(epoch) -> iterable of batches`` of one epoch, the
        same for the same epoch (seed any shuffle with the epoch).
      steps_per_epoch: batches per epoch in the epoch form; needed only by
        :meth:`seek`. Epochs end when ``make_epoch``'s iterable does.
      num_epochs: stop after this many epochs (epoch form); None repeats forever.

    ``get_state()`` is the position of the next batch this adapter hands out. If
    a prefetcher draws from it ahead of training, that is ahead of the step being
    saved: then give the callback no data iterator and, after resuming, call
    ``seek(int(state.step))`` (batches consumed equal steps done).
    """

    def __init__(
        self,
        make_batch: Callable[[int], Any] | None = None,
        *,
        make_epoch: Callable[[int], Iterable[Any]] | None = None,
        steps_per_epoch: int | None = None,
        num_epochs: int | None = None,
    ):
        if (make_batch is None) == (make_epoch is None):
            raise OptionTypeError(
                "StepIndexedIterator needs exactly one of make_batch or make_epoch"
            )
        if make_batch is not None and (steps_per_epoch is not None or num_epochs is not None):
            raise OptionTypeError("steps_per_epoch and num_epochs belong to the make_epoch form")
        for name, fn in (("make_batch", make_batch), ("make_epoch", make_epoch)):
            Option(name, "callable", none_ok=True).check(fn)
        count = {"kind": "int", "none_ok": True, "low": 1}
        steps_per_epoch = Option("steps_per_epoch", **count).check(steps_per_epoch)
        num_epochs = Option("num_epochs", **count).check(num_epochs)
        self._make_batch = make_batch
        self._make_epoch = make_epoch
        self._steps_per_epoch = steps_per_epoch
        self._num_epochs = num_epochs
        self._index = 0  # batches handed out so far
        self._epoch = 0
        self._offset = 0  # batches handed out from the current epoch
        self._it: Iterator[Any] | None = None  # the current epoch's batches, opened lazily

    def __iter__(self) -> StepIndexedIterator:
        return self

    def __next__(self) -> Any:
        if self._make_batch is not None:
            batch = self._make_batch(self._index)
            self._index += 1
            return batch
        while True:
            if self._num_epochs is not None and self._epoch >= self._num_epochs:
                raise StopIteration
            if self._it is None:
                self._it = self._open(self._epoch, self._offset)
            try:
                batch = next(self._it)
            except StopIteration:
                if self._offset == 0:
                    raise ValueError(
                        f"StepIndexedIterator: make_epoch({self._epoch}) yielded no batch"
                    ) from None
                self._epoch, self._offset, self._it = self._epoch + 1, 0, None
                continue
            self._offset += 1
            self._index += 1
            return batch

    def _open(self, epoch: int, offset: int) -> Iterator[Any]:
        data = self._make_epoch(epoch)
        skipped = 0
        if offset and callable(getattr(data, "skip", None)):
            data, skipped = data.skip(offset), offset
        if callable(getattr(data, "as_numpy_iterator", None)):
            it = data.as_numpy_iterator()
        else:
            it = iter(data)
        for i in range(offset - skipped):
            try:
                next(it)
            except StopIteration:
                raise ValueError(
                    f"StepIndexedIterator: the saved position is batch {offset} of epoch "
                    f"{epoch}, but make_epoch({epoch}) yields only {i} batches"
                ) from None
        return it

    # -- position ------------------------------------------------------------------

    def get_state(self) -> dict[str, int]:
        """The position of the next batch, as JSON: ``{"index": n, ...}``."""
        if self._make_batch is not None:
            return {"index": self._index}
        return {"index": self._index, "epoch": self._epoch, "offset": self._offset}

    def set_state(self, state: Any) -> None:
        """Positions the iterator where ``get_state()`` returned ``state``.

        Raises ValueError for a state of the other form or with a bad field.
        """
        if not isinstance(state, dict):
            raise ValueError(
                f"StepIndexedIterator.set_state: expected a dict, found {type(state).__name__}"
            )
        where = "StepIndexedIterator.set_state: "
        index = _count(state.get("index"), f"{where}'index'")
        if self._make_batch is not None:
            if "epoch" in state:
                raise ValueError(
                    "StepIndexedIterator.set_state: the state has an 'epoch' (saved by the "
                    "make_epoch form) but this iterator has make_batch"
                )
            self._index = index
            return
        if "epoch" not in state:
            raise ValueError(
                "StepIndexedIterator.set_state: the state has no 'epoch' (saved by the "
                "make_batch form) but this iterator has make_epoch"
            )
        epoch = _count(state.get("epoch"), f"{where}'epoch'")
        offset = _count(state.get("offset"), f"{where}'offset'")
        self._index, self._epoch, self._offset = index, epoch, offset
        self._it = None

    def global_position(self) -> int:
        """The global index of the next batch: the same on every process, whatever their
        number (``make_batch(index)`` makes this process's share of batch ``index``).
        A step saved on N processes therefore resumes on M (``_state.iterators``)."""
        return self._index

    def set_global_position(self, position: int) -> None:
        """Continues from global batch ``position`` (:meth:`seek`), on any process count."""
        self.seek(position)

    def seek(self, index: int) -> None:
        """Positions the iterator so that the next batch is batch ``index`` overall."""
        _count(index, "seek: index")
        if self._make_batch is not None:
            self._index = index
            return
        if self._steps_per_epoch is None:
            raise ValueError(
                "seek needs steps_per_epoch=... in the make_epoch form (to find the epoch of "
                "a batch index); or restore a saved state with set_state"
            )
        epoch, offset = divmod(index, self._steps_per_epoch)
        self.set_state({"index": index, "epoch": epoch, "offset": offset})


_ITERATOR_ADVICE = (
    "To save the position of a pipeline that can rebuild a batch from its index (an "
    "in-memory shuffle seeded by the epoch, a tf.data pipeline made per epoch), wrap it "
    "in fop.StepIndexedIterator(make_batch) or fop.StepIndexedIterator(make_epoch=...); "
    "a grain DataLoader or IterDataset iterator works as it is"
)


_PAIRS = (("get_state", "set_state"), ("state_dict", "load_state_dict"))  # get, set back


def check_iterator(it: Any) -> Any:
    """``it`` when it can save and set back its position; else OptionTypeError."""
    _pair(it)
    return it


def _pair(it: Any) -> tuple[str, str]:
    for get, put in _PAIRS:
        if hasattr(it, get):
            if not hasattr(it, put):
                raise OptionTypeError(
                    f"data_iterator: a {type(it).__name__} has {get}() but no {put}(): "
                    f"its position could be saved but never restored. {_ITERATOR_ADVICE}"
                )
            return get, put
    if hasattr(it, "__iter__") and not hasattr(it, "__next__"):  # a dataset, a loader
        raise OptionTypeError(
            f"data_iterator: a {type(it).__name__} is an iterable, not the iterator that "
            f"holds the position: pass it = iter(dataset) (grain's iterators have get_state() "
            f"and set_state()), and draw the batches from that same it"
        )
    raise OptionTypeError(
        f"data_iterator: a {type(it).__name__} has neither get_state()/set_state() "
        f"nor state_dict()/load_state_dict(). {_ITERATOR_ADVICE}"
    )


def iterator_state(it: Any) -> Any:
    """The position of ``it``, from a pair that can also set it back."""
    return getattr(it, _pair(it)[0])()


def set_iterator_state(it: Any, state: Any) -> None:
    for _, put in _PAIRS:
        if hasattr(it, put):
            try:
                return getattr(it, put)(state)
            except Exception as e:  # the user's code: what it was given, and where from
                keys = sorted(state)[:8] if isinstance(state, Mapping) else type(state).__name__
                e.add_note(
                    f"raised by data_iterator.{put}() of a {type(it).__name__}, given the "
                    f"position saved in its item ({keys}): saved by another kind of iterator?"
                )
                raise
    raise TypeError(
        f"data_iterator: a {type(it).__name__} has neither set_state() nor "
        f"load_state_dict(). {_ITERATOR_ADVICE}"
    )


# -- the global position ------------------------------------------------------------------

GLOBAL_POSITION_KEY = "global_position"  # the field of a process's iterator file

_GRAIN_ELASTIC = ("ElasticIterator", "_ElasticMapDatasetIterator")  # grain's elastic classes
_GRAIN_ELASTIC_KEY = "global_next_index"  # their state's one field


def _grain_elastic(it: Any) -> bool:
    kind = type(it)
    return kind.__module__.startswith("grain.") and kind.__name__ in _GRAIN_ELASTIC


def global_position(it: Any, state: Any) -> int | None:
    """The global position of ``it`` (its ``state`` just read), or None where it has none."""
    if callable(getattr(it, "global_position", None)) and callable(
        getattr(it, "set_global_position", None)
    ):
        return _count(it.global_position(), f"{type(it).__name__}.global_position()")
    if _grain_elastic(it) and isinstance(state, dict) and _GRAIN_ELASTIC_KEY in state:
        return _count(state[_GRAIN_ELASTIC_KEY], f"grain {type(it).__name__} state")
    return None


def can_set(it: Any) -> bool:
    """Whether ``it`` can continue from a global position."""
    return callable(getattr(it, "set_global_position", None)) or _grain_elastic(it)


def set_global_position(it: Any, position: int) -> None:
    """Has ``it`` continue from global position ``position``."""
    if callable(getattr(it, "set_global_position", None)):
        it.set_global_position(position)
    elif _grain_elastic(it):
        it.set_state({_GRAIN_ELASTIC_KEY: position})
    else:
        raise TypeError(f"a {type(it).__name__} has no global position to set; {describe()}")


def describe() -> str:
    """What an iterator needs for its position to move across a change of process count."""
    return (
        "an iterator whose position is a global index (fop.StepIndexedIterator, grain's "
        "ElasticIterator, or one with global_position() and set_global_position()) "
        "resumes on any number of processes"
    )
