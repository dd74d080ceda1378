"""Retention rules and the save policy, as pure functions of steps and time (and, for
the metric a step lacks, through a manager)."""

import warnings

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin import OptionError, Retention, SavePolicy
from flax_orbax_plugin._manager.retention import steps_to_delete
from flax_orbax_plugin._manager.save_rules import SaveSchedule


def test_nothing_is_deleted_without_keep_or_keep_best():
    assert steps_to_delete(range(10), Retention()) == []
    with pytest.raises(OptionError, match="^keep_every=3 does nothing without keep= or keep_b"):
        Retention(keep_every=3)  # a rule that keeps what nothing deletes


def test_rules_are_a_union_and_protected_steps_survive():
    policy = Retention(keep=2, keep_every=4, keep_best=1, best_metric="loss")
    metrics = {1: 0.1, 2: 0.5, 5: float("nan")}  # 6 and 7: saved between evaluations
    out = steps_to_delete(range(10), policy, metrics=metrics, protected=[3])
    assert out == [2, 5, 6, 7]
    assert sorted(set(range(10)) - set(out)) == [0, 1, 3, 4, 8, 9]


def test_a_best_rule_that_can_rank_no_step_keeps_them_all():
    """While no step holds the metric (misspelt, or no evaluation yet) keep_best ranks
    nothing and keeps every step; once one does, a step without it is left to the other
    rules (a step saved between evaluations), and a NaN is known and never best."""
    policy = Retention(keep_best=1, best_metric="loss")
    assert steps_to_delete([1, 2, 3, 4, 5], policy, metrics={}) == []
    metrics = {1: 0.5, 2: 0.1, 4: float("nan")}
    assert steps_to_delete([1, 2, 3, 4, 5], policy, metrics=metrics) == [1, 3, 4, 5]


def test_a_misspelt_best_metric_warns_once_and_deletes_nothing(tmp_path):
    with fop.CheckpointManager(
        tmp_path, keep_best=2, best_metric="val_loss", async_save=False
    ) as m:
        with pytest.warns(UserWarning, match=r"extras\['val_loss'\].*step 1.*eval_loss"):
            m.save(1, {"params": {"w": np.ones(2)}}, extras={"eval_loss": 1.0})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once
            for step in range(2, 6):
                m.save(step, {"params": {"w": np.ones(2)}}, extras={"eval_loss": 1.0})
        m.wait()
        assert m.steps() == [1, 2, 3, 4, 5]


def test_a_metric_that_is_text_is_no_number(tmp_path):
    """extras={"loss": "2"} was ranked as the number 2 ("10" then worse than "2" as
    numbers, better as text): text is now no metric, and the warning says what is there."""
    with fop.CheckpointManager(tmp_path, keep_best=1, best_metric="loss", async_save=False) as m:
        with pytest.warns(UserWarning, match=r"extras\['loss'\].*hold str '10' there, not a nu"):
            m.save(1, {"params": {"w": np.ones(2)}}, extras={"loss": "10"})
        m.save(2, {"params": {"w": np.ones(2)}}, extras={"loss": "2"})
        m.save(3, {"params": {"w": np.ones(2)}}, extras={"loss": np.float32(5.0)})
        m.save(4, {"params": {"w": np.ones(2)}}, extras={"loss": 7})
        m.wait()
        # ranked: 3 (5.0) and 4 (7) only; the steps holding text are left to the other
        # rules (none here); 4 is the newest. Read as numbers, "2" was kept as the best.
        assert m.steps() == [3, 4]


def test_a_step_whose_metric_cannot_be_read_is_left_as_damaged(tmp_path):
    with fop.CheckpointManager(tmp_path, async_save=False) as m:
        for step, loss in [(1, 0.5), (2, 0.1), (3, 0.4)]:
            m.save(step, {"params": {"w": np.ones(2)}}, extras={"loss": loss})
    value = next((tmp_path / "2" / "extras").rglob("value.json"))
    value.write_text('{"loss": 9.0}')  # its checksum no longer matches
    with fop.CheckpointManager(tmp_path, keep_best=1, best_metric="loss", async_save=False) as m:
        m.save(4, {"params": {"w": np.ones(2)}}, extras={"loss": 0.3})
        m.wait()
        assert 2 in m.steps() and 1 not in m.steps()


def test_best_mode_max_and_ties_prefer_newer():
    policy = Retention(keep_best=2, best_metric="acc", best_mode="max")
    assert steps_to_delete([1, 2, 3, 4], policy, metrics={1: 0.9, 2: 0.5, 3: 0.5, 4: 0.1}) == [
        2,
        4,
    ]


def test_invalid_retention_options_are_refused():
    with pytest.raises(ValueError, match="^keep must be a positive int or None, found int 0"):
        Retention(keep=0)
    with pytest.raises(ValueError, match="best_mode"):
        Retention(keep_best=1, best_metric="x", best_mode="lowest")
    with pytest.raises(ValueError, match="go together"):
        Retention(keep_best=1)
    with pytest.raises(TypeError, match="^keep must be"):
        Retention(keep="3")


def test_save_policy_with_time_passed_in():
    schedule = SaveSchedule(SavePolicy(every_seconds=10))
    # one process: no region; the first decision starts the clock
    assert schedule.decide(1, 100.0, region=None) == (None, 100.0)
    assert schedule.decide(2, 109.0, region=None) == (None, 109.0)
    assert schedule.decide(3, 110.0, region=None) == ("save", 110.0)
    schedule.record_save(110.0)
    assert schedule.decide(4, 115.0, region=None) == (None, 115.0)
    assert schedule.decide(5, 116.0, forced=True, region=None) == ("forced", 116.0)
    assert SavePolicy().wants(123, elapsed=0.0)  # no rule: every call saves
    steps = SavePolicy(every_steps=5, steps=[7])
    assert [s for s in range(1, 12) if steps.wants(s, elapsed=0.0)] == [5, 7, 10]
    assert steps.steps == frozenset({7})
    with pytest.raises(ValueError, match="^every_steps must be a positive int"):
        SavePolicy(every_steps=0)


@pytest.mark.parametrize("mode", ["min", "max"])
def test_keep_best_ranks_only_finite_metrics(mode):
    """A diverged step (NaN, +inf, -inf) is never best and never displaces the finite best."""
    inf, nan = float("inf"), float("nan")
    sign = 1.0 if mode == "min" else -1.0
    losses = {1: 0.5, 2: -inf, 3: 0.3, 4: nan, 5: inf}
    metrics = {s: sign * m for s, m in losses.items()}  # 0.3 is best in both modes
    policy = Retention(keep_best=1, best_metric="loss", best_mode=mode)
    assert steps_to_delete(range(1, 6), policy, metrics=metrics) == [1, 2, 4, 5]
    # keep_best=2: the second finite step, not a non-finite one
    policy2 = Retention(keep_best=2, best_metric="loss", best_mode=mode)
    assert steps_to_delete(range(1, 6), policy2, metrics=metrics) == [2, 4, 5]
    # the other rules still keep a non-finite step: keep
    policy3 = Retention(keep_best=1, keep=1, best_metric="loss", best_mode=mode)
    assert steps_to_delete(range(1, 6), policy3, metrics=metrics) == [1, 2, 4]
    # only non-finite metrics: nothing is best, keep decides alone
    only_bad = {1: inf, 2: -inf, 3: nan}
    assert steps_to_delete([1, 2, 3], policy3, metrics=only_bad) == [1, 2]


def test_manager_keep_best_ignores_non_finite_losses(tmp_path):
    """Through the manager, with metrics read back from disk by a second manager."""
    import numpy as np

    import flax_orbax_plugin as fop

    opts = dict(keep_best=1, best_metric="loss", best_mode="min", async_save=False)
    losses = [0.5, float("-inf"), 0.3, float("nan")]
    with fop.CheckpointManager(tmp_path, **opts) as mngr:
        for s, loss in enumerate(losses[:2]):
            mngr.save(s, {"w": np.full((2,), s, np.float32)}, extras={"loss": loss})
    with fop.CheckpointManager(tmp_path, **opts) as mngr:  # old metrics come from disk
        for s, loss in enumerate(losses[2:], start=2):
            mngr.save(s, {"w": np.full((2,), s, np.float32)}, extras={"loss": loss})
        mngr.wait()
        assert mngr.steps() == [2, 3]  # the finite best (0.3), and the one just written


def test_a_late_retention_pass_never_deletes_the_newest_step(tmp_path):
    """A pass for step 3 that runs after step 4 committed (async saves: each commit
    submits its pass to the deletion thread, which may run it late) keeps step 4 although
    its metric is not among the best: a resume reads the newest step. The manager's
    runner is driven directly to place the pass deterministically."""
    import numpy as np

    import flax_orbax_plugin as fop

    opts = dict(keep_best=2, best_metric="acc", best_mode="max", async_save=False)
    with fop.CheckpointManager(tmp_path, **opts) as mngr:
        for s, acc in enumerate([0.1, 0.9, 0.5, 0.8, 0.2]):
            mngr.save(s, {"w": np.full((2,), s, np.float32)}, extras={"acc": acc})
        mngr.wait()
        assert mngr.steps() == [1, 3, 4]
        mngr._retainer.apply(3)  # the late pass of step 3
        assert mngr.steps() == [1, 3, 4]


def test_retention_and_replay_warnings_point_at_the_users_line(tmp_path):
    """The warnings name the user's call, not a line of the package (the replay warning
    named _base/regions.py, the collective wrapper)."""

    class It:
        def get_state(self):
            return {"i": 1}

        def set_state(self, state):
            pass

    with fop.CheckpointManager(tmp_path / "a", async_save=False) as m:
        m.save(1, {"params": {"w": np.ones(2)}}, data_iterator=It())
    with fop.CheckpointManager(tmp_path / "a", async_save=False) as m:
        with pytest.warns(UserWarning, match="data_iterator") as seen:
            m.restore(like={"params": {"w": np.ones(2)}})
    assert all(w.filename == __file__ for w in seen), [w.filename for w in seen]
    with fop.CheckpointManager(tmp_path / "b", keep_best=1, best_metric="x") as m:
        with pytest.warns(UserWarning, match="ranks steps by") as seen:
            m.save(1, {"params": {"w": np.ones(2)}})
    assert all(w.filename == __file__ for w in seen), [w.filename for w in seen]


def test_a_metric_is_any_real_scalar_and_nothing_else():
    import jax.numpy as jnp
    import ml_dtypes

    from flax_orbax_plugin._manager.retaining import as_metric

    numbers = [2, 2.0, np.float32(2), np.int64(2), jnp.float32(2), jnp.array(2, jnp.bfloat16)]
    numbers.append(np.array(2, ml_dtypes.bfloat16))  # a bfloat16 loss (its dtype kind is "V")
    assert [as_metric(v) for v in numbers] == [2.0] * len(numbers)
    for other in ["2", b"2", True, np.bool_(True), jnp.array(True), jnp.array([2.0]), None]:
        assert as_metric(other) is None, other
