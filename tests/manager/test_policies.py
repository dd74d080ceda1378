"""Composable save and retention policies, and temporary/permanent lanes (issue 37, item 1).

The property runs a real CheckpointManager over random step and time sequences and
compares the steps it saved and kept with a small reference model written here from
the documented rules (its own code: it never calls the policy objects). Time is passed
in (``t=``) and a save's blocking time is made by a fake clock that the extras callable
(called inside the blocking phase) advances: no sleeps.
"""

import dataclasses
import math
import os
import signal

import _docs
import jax
import numpy as np
import pytest
from _mp_workers import replicated_state
from _multiprocess import run_processes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flax_orbax_plugin as fop
from flax_orbax_plugin._manager.housekeeping import shared_view
from flax_orbax_plugin._manager.options import ManagerOptions
from flax_orbax_plugin._manager.retention import StepFacts
from flax_orbax_plugin._manager.save_rules import Moment


def tiny():
    return {"params": {"w": np.zeros((2,), np.float32)}}


class FakeClock:
    """The manager's clock: advanced by the test only (the blocking time of a save)."""

    def __init__(self):
        self.value = 0.0

    def __call__(self):
        return self.value


# -- the reference model ------------------------------------------------------------------


def ref_wants(spec, step, since, has_steps, last_blocking):
    """The documented save rules, for one spec: {"kind": ..., ...} or a combination."""
    kind = spec["kind"]
    if kind == "steps":
        return step % spec["n"] == 0
    if kind == "seconds":
        return since >= spec["t"]
    if kind == "at":
        return step in spec["at"]
    if kind == "initial":
        return not has_steps
    if kind == "continuous":
        return last_blocking is None or last_blocking <= since * spec["p"] / 100.0
    parts = [ref_wants(p, step, since, has_steps, last_blocking) for p in spec["parts"]]
    return any(parts) if kind == "any" else all(parts)


def ref_kept(spec, steps, losses, times, now):
    """The documented retention rules: the set of ``steps`` (ascending) kept."""
    kind = spec["kind"]
    if kind == "last":
        return set(steps[len(steps) - spec["n"] :]) if len(steps) > spec["n"] else set(steps)
    if kind == "every":
        return {s for s in steps if s % spec["k"] == 0}
    if kind == "best":
        good = [s for s in steps if math.isfinite(losses[s])]
        good.sort(key=lambda s: (losses[s], -s))
        return set(good[: spec["n"]])
    if kind == "for":
        return {s for s in steps if now - times[s] < spec["s"]}
    out = set()
    for p in spec["parts"]:
        out |= ref_kept(p, steps, losses, times, now)
    return out


def run_reference(save_spec, keep_spec, events):
    """Saved steps and the steps left: ``events`` are (step, t, blocking, loss)."""
    saved, lanes, times, losses = [], {}, {}, {}
    last_time, last_blocking = None, None
    for step, t, blocking, loss in events:
        if last_time is None:
            last_time = t
        since = t - last_time
        if save_spec["kind"] == "lanes":
            lane = None
            if ref_wants(save_spec["permanent"], step, since, bool(saved), last_blocking):
                lane = "permanent"
            elif ref_wants(save_spec["temporary"], step, since, bool(saved), last_blocking):
                lane = "temporary"
        else:
            wanted = ref_wants(save_spec, step, since, bool(saved), last_blocking)
            lane = "save" if wanted else None
        if lane is None:
            continue
        saved.append(step)
        lanes[step], times[step], losses[step] = lane, t, loss
        last_time, last_blocking = t, blocking
    if not saved:
        return saved, []
    now = times[saved[-1]]
    if save_spec["kind"] == "lanes":
        kept = set()
        for lane in ("temporary", "permanent"):
            own = [s for s in saved if (lanes[s] == "temporary") == (lane == "temporary")]
            rule = save_spec["keep_" + lane]
            kept |= set(own) if rule is None else ref_kept(rule, own, losses, times, now)
    elif keep_spec is None:
        kept = set(saved)
    else:
        kept = ref_kept(keep_spec, saved, losses, times, now)
    kept.add(saved[-1])  # the newest step is always kept
    return saved, sorted(kept)


# -- the specs as the library's objects --------------------------------------------------


def build_save(spec):
    kind = spec["kind"]
    simple = {
        "steps": lambda: fop.EverySteps(spec["n"]),
        "seconds": lambda: fop.EverySeconds(spec["t"]),
        "at": lambda: fop.AtSteps(spec["at"]),
        "initial": lambda: fop.InitialSave(),
        "continuous": lambda: fop.Continuous(max_overhead_percent=spec["p"]),
    }
    if kind in simple:
        return simple[kind]()
    parts = [build_save(p) for p in spec["parts"]]
    out = parts[0]
    for p in parts[1:]:
        out = (out | p) if kind == "any" else (out & p)
    return out


def build_keep(spec):
    kind = spec["kind"]
    simple = {
        "last": lambda: fop.KeepLast(spec["n"]),
        "every": lambda: fop.KeepEvery(spec["k"]),
        "best": lambda: fop.KeepBest(spec["n"], metric="loss", mode="min"),
        "for": lambda: fop.KeepFor(spec["s"]),
    }
    if kind in simple:
        return simple[kind]()
    return fop.KeepAny(*(build_keep(p) for p in spec["parts"]))


# -- strategies ---------------------------------------------------------------------------

leaf_save = st.one_of(
    st.builds(lambda n: {"kind": "steps", "n": n}, st.integers(1, 4)),
    st.builds(lambda t: {"kind": "seconds", "t": t}, st.integers(1, 30)),
    st.builds(
        lambda a: {"kind": "at", "at": a}, st.frozensets(st.integers(0, 30), min_size=1, max_size=4)
    ),
    st.just({"kind": "initial"}),
    st.builds(lambda p: {"kind": "continuous", "p": p}, st.sampled_from([5, 25, 50, 100])),
)
save_specs = st.one_of(
    leaf_save,
    st.builds(
        lambda k, parts: {"kind": k, "parts": parts},
        st.sampled_from(["any", "all"]),
        st.lists(leaf_save, min_size=2, max_size=3),
    ),
)
deleting_keep = st.one_of(
    st.builds(lambda n: {"kind": "last", "n": n}, st.integers(1, 3)),
    st.builds(lambda n: {"kind": "best", "n": n}, st.integers(1, 2)),
    st.builds(lambda s: {"kind": "for", "s": s}, st.integers(1, 40)),
)
keep_specs = st.one_of(
    st.none(),
    deleting_keep,
    st.builds(
        lambda a, b: {"kind": "any", "parts": [a, b]},
        deleting_keep,
        st.one_of(deleting_keep, st.builds(lambda k: {"kind": "every", "k": k}, st.integers(2, 4))),
    ),
)
lanes_specs = st.builds(
    lambda t, p, kt, kp: {
        "kind": "lanes",
        "temporary": {"kind": "seconds", "t": t},
        "permanent": {"kind": "steps", "n": p},
        "keep_temporary": kt,
        "keep_permanent": kp,
    },
    st.integers(1, 20),
    st.integers(2, 6),
    st.one_of(
        st.builds(lambda n: {"kind": "last", "n": n}, st.integers(1, 2)),
        st.builds(lambda s: {"kind": "for", "s": s}, st.integers(1, 30)),
    ),
    st.one_of(st.none(), st.builds(lambda n: {"kind": "last", "n": n}, st.integers(1, 2))),
)
losses = st.one_of(st.integers(0, 5).map(float), st.sampled_from([math.nan, math.inf, -math.inf]))
events_strategy = st.lists(
    st.tuples(st.integers(1, 3), st.integers(0, 15), st.integers(0, 4), losses),
    min_size=1,
    max_size=10,
)


def as_events(raw):
    """(step increment, time increment, blocking, loss) -> (step, t, blocking, loss)."""
    out, step, t = [], 0, 100.0
    for dstep, dt, blocking, loss in raw:
        step, t = step + dstep, t + dt
        out.append((step, t, float(blocking), loss))
    return out


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    plan=st.one_of(st.tuples(save_specs, keep_specs), st.tuples(lanes_specs, st.none())),
    raw=events_strategy,
)
def test_saved_and_kept_steps_match_the_reference_model(tmp_path_factory, plan, raw):
    save_spec, keep_spec = plan
    events = as_events(raw)
    clock = FakeClock()
    if save_spec["kind"] == "lanes":
        lanes = fop.Lanes(
            temporary=fop.Lane(
                build_save(save_spec["temporary"]),
                keep=build_keep(save_spec["keep_temporary"]),
            ),
            permanent=fop.Lane(
                build_save(save_spec["permanent"]),
                keep=None
                if save_spec["keep_permanent"] is None
                else build_keep(save_spec["keep_permanent"]),
            ),
        )
        options = {"policy": lanes}
    else:
        options = {"policy": build_save(save_spec)}
        if keep_spec is not None:
            options["retention"] = build_keep(keep_spec)
    uses_time = options["policy"].uses_time or (
        "retention" in options and options["retention"].uses_time
    )
    if uses_time:
        options["clock"] = clock
    directory = tmp_path_factory.mktemp("run")
    saved = []
    with fop.CheckpointManager(directory, async_save=False, **options) as mngr:
        for step, t, blocking, loss in events:

            def extras(blocking=blocking, loss=loss):  # inside the blocking phase
                clock.value += blocking
                return {"loss": loss}

            if mngr.save(step, tiny(), extras=extras, t=t):
                saved.append(step)
        mngr.wait()
        kept = mngr.steps()
    want_saved, want_kept = run_reference(save_spec, keep_spec, events)
    assert saved == want_saved
    assert kept == want_kept


# -- each object --------------------------------------------------------------------------


def test_save_objects_answer_their_moment():
    m = Moment
    assert fop.EverySteps(3).wants(m(6)) and not fop.EverySteps(3).wants(m(7))
    assert fop.EverySeconds(10).wants(m(1, since_save=10.0))
    assert not fop.EverySeconds(10).wants(m(1, since_save=9.99))
    assert fop.AtSteps([2, 5]).wants(m(5)) and not fop.AtSteps([2, 5]).wants(m(4))
    assert fop.InitialSave().wants(m(9)) and not fop.InitialSave().wants(m(9, has_steps=True))
    assert fop.OnPreemption().wants(m(4, preempted=True)) and not fop.OnPreemption().wants(m(4))
    c = fop.Continuous(max_overhead_percent=10)
    assert c.wants(m(1))  # no save yet: nothing measured
    assert not c.wants(m(1, in_flight=True))  # the previous save is not done
    assert not c.wants(m(1, since_save=9.0, last_blocking=1.0))  # 11% > 10%
    assert c.wants(m(1, since_save=10.0, last_blocking=1.0))  # 10%
    both = fop.EverySteps(2) & fop.EverySeconds(5)
    either = fop.EverySteps(2) | fop.OnPreemption() | fop.EverySeconds(5)
    assert isinstance(both, fop.AllOf) and isinstance(either, fop.AnyOf)
    assert len(either.policies) == 3  # flattened
    assert not both.wants(m(2, since_save=4.0)) and both.wants(m(2, since_save=5.0))
    assert either.wants(m(3, since_save=6.0)) and not either.wants(m(3, since_save=1.0))
    assert either.uses_time and either.watches_preemption
    assert not fop.EverySteps(2).uses_time and not (fop.EverySteps(2) | fop.AtSteps([1])).uses_time
    # SavePolicy (and the manager's shorthands) are the same objects
    assert fop.SavePolicy(every_steps=5, steps=[7]).rule == fop.AtSteps([7]) | fop.EverySteps(5)
    assert fop.SavePolicy().rule == fop.EverySteps(1)
    assert fop.EverySteps(5) == fop.EverySteps(5)  # values: shareable


def test_keep_objects_keep_their_steps():
    steps = [1, 2, 3, 4, 5, 6]
    facts = StepFacts(
        metrics={"loss": {1: 0.5, 2: math.nan, 3: -math.inf, 4: 0.1, 5: math.inf, 6: 0.3}},
        times={1: 0.0, 2: 10.0, 3: 20.0, 4: 30.0, 5: 40.0},  # 6: not dated (earlier run)
        now=40.0,
    )
    assert fop.KeepLast(2).kept(steps, facts) == {5, 6}
    assert fop.KeepEvery(3).kept(steps, facts) == {3, 6}
    assert fop.KeepBest(2, metric="loss").kept(steps, facts) == {4, 6}  # finite only
    assert fop.KeepBest(1, metric="loss", mode="max").kept(steps, facts) == {1}
    assert fop.KeepFor(15).kept(steps, facts) == {4, 5, 6}  # 6: undated, never aged out
    union = fop.KeepLast(1) | fop.KeepEvery(2)
    assert union.kept(steps, facts) == {2, 4, 6} and union.deletes_anything
    assert not fop.KeepEvery(2).deletes_anything
    assert (fop.KeepLast(1) | fop.KeepBest(1, metric="acc")).metric_names == {"acc"}
    assert fop.Retention(keep=2, keep_every=3).rule == fop.KeepLast(2) | fop.KeepEvery(3)
    lanes = fop.Lanes(
        temporary=fop.Lane(fop.EverySeconds(60), keep=fop.KeepLast(1)),
        permanent=fop.Lane(fop.EverySteps(4)),
    )
    lane_facts = StepFacts(lanes={1: "temporary", 2: "temporary", 3: "temporary", 4: "permanent"})
    # an unknown lane (an earlier run's step) follows the number: 5 is temporary, 8 not
    assert lanes.kept([1, 2, 3, 4, 5], lane_facts) == {4, 5}
    assert lanes.kept([1, 2, 3, 4, 8], lane_facts) == {3, 4, 8}
    by_time = fop.Lanes(
        temporary=fop.Lane(fop.EverySteps(1), keep=fop.KeepLast(1)),
        permanent=fop.Lane(fop.EverySeconds(60)),
    )
    assert by_time.kept([1, 2, 3, 4, 5], lane_facts) == {3, 4, 5}  # 5: unknown: permanent
    combined = fop.Lanes(  # numbers only, combined: 5 is permanent by AtSteps, 6 is not
        temporary=fop.Lane(fop.EverySeconds(60), keep=fop.KeepLast(1)),
        permanent=fop.Lane(fop.EverySteps(4) | fop.AtSteps([5])),
    )
    assert combined.kept([1, 2, 3, 4, 5, 6], lane_facts) == {4, 5, 6}
    assert lanes.label(Moment(8, since_save=99.0)) == "permanent"
    assert lanes.label(Moment(7, since_save=99.0)) == "temporary"
    assert lanes.label(Moment(7, since_save=1.0)) is None


@pytest.mark.parametrize(
    "make, error, words",
    [
        (
            lambda: fop.EverySteps(0),
            fop.OptionError,
            r"^EverySteps\(n\) must be an int >= 1, found int 0",
        ),
        (lambda: fop.EverySteps("2"), fop.OptionTypeError, r"^EverySteps\(n\) must be an int"),
        (lambda: fop.EverySeconds(-1), fop.OptionError, r"^EverySeconds\(seconds\) must be .* > 0"),
        (lambda: fop.EverySeconds(math.nan), fop.OptionError, r"found float nan"),
        (lambda: fop.AtSteps([1, -2]), fop.OptionError, r"^AtSteps\(steps\) must be an int >= 0"),
        # An empty list of steps saves none (AtSteps) or, as "no rule", every step
        # (SavePolicy, the manager's steps=): refused either way.
        (lambda: fop.AtSteps([]), fop.OptionError, r"^AtSteps\(steps\) must name at least one"),
        (lambda: fop.SavePolicy(steps=()), fop.OptionError, r"steps must name at least one st"),
        (lambda: fop.Continuous(max_overhead_percent=0), fop.OptionError, r"Continuous\(max_ov"),
        (lambda: fop.Continuous(max_overhead_percent=101), fop.OptionError, r"<= 100, found int"),
        (lambda: fop.KeepLast(0), fop.OptionError, r"^KeepLast\(n\) must be an int >= 1, found"),
        (lambda: fop.KeepEvery(-3), fop.OptionError, r"^KeepEvery\(k\) must be an int >= 1"),
        (lambda: fop.KeepFor(-5), fop.OptionError, r"^KeepFor\(seconds\) must be a finite numb"),
        (lambda: fop.KeepBest(1), fop.OptionError, r"^KeepBest\(metric\) must be a key"),
        (lambda: fop.KeepBest(1, metric="l", mode="lo"), fop.OptionError, r"KeepBest\(mode\)"),
        (lambda: fop.AnyOf(), fop.OptionTypeError, r"^AnyOf\(\) needs at least one"),
        (lambda: fop.EverySteps(2) | 3, fop.OptionTypeError, r"argument 1 must be a save pol"),
        (lambda: fop.KeepLast(2) | "x", fop.OptionTypeError, r"argument 1 must be a retention"),
        (lambda: fop.Lane(fop.EverySteps(2), keep=fop.KeepEvery(2)), fop.OptionError, "nothing"),
    ],
)
def test_bad_values_name_the_option_expected_and_found(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_manager_refuses_misplaced_objects(tmp_path):
    lanes = fop.Lanes(
        temporary=fop.Lane(fop.EverySeconds(60), keep=fop.KeepLast(1)),
        permanent=fop.Lane(fop.EverySteps(4)),
    )
    with pytest.raises(
        fop.OptionError,
        match=r"^keep=2 and policy=Lanes\(.*inside each Lane\(policy, keep=\.\.\.\)",
    ):
        fop.CheckpointManager(tmp_path / "a", policy=lanes, keep=2)
    with pytest.raises(fop.OptionError, match=r"a Lanes is a save policy and its retention"):
        fop.CheckpointManager(tmp_path / "b", retention=lanes)
    with pytest.raises(fop.OptionError, match=r"^retention=KeepEvery\(k=2\) deletes nothing"):
        fop.CheckpointManager(tmp_path / "c", retention=fop.KeepEvery(2))
    with pytest.raises(TypeError, match=r"^policy: expected a SavePolicy\(\.\.\.\).*found int 5"):
        fop.CheckpointManager(tmp_path / "d", policy=5)
    with pytest.raises(fop.OptionError, match=r"^clock=.* does nothing without a policy or"):
        fop.CheckpointManager(tmp_path / "e", policy=fop.EverySteps(2), clock=FakeClock())
    with pytest.raises(fop.OptionError, match=r"^steps must name at least one step, found list"):
        fop.CheckpointManager(tmp_path / "f", steps=[])  # not "no rule": every step
    assert not (tmp_path / "f").exists()


def _spellings(value):
    """The SavePolicy and Retention objects anywhere inside ``value``."""
    if isinstance(value, fop.SavePolicy | fop.Retention):
        return [value]
    if isinstance(value, tuple):
        return [x for v in value for x in _spellings(v)]
    if dataclasses.is_dataclass(value):
        return [x for f in dataclasses.fields(value) for x in _spellings(getattr(value, f.name))]
    return []


def test_every_spelling_leaves_the_options_front_as_rule_objects(tmp_path):
    """The flat keywords, SavePolicy and Retention (also inside AnyOf, KeepAny or a Lane)
    are aliases: past the front the manager holds the rule objects alone, and two
    spellings of one policy are one value (what processes compare at the open)."""
    lanes = fop.Lanes(
        temporary=fop.Lane(fop.SavePolicy(every_seconds=60), keep=fop.Retention(keep=2)),
        permanent=fop.Lane(fop.SavePolicy(every_steps=10) | fop.OnPreemption()),
    )
    cases = [
        ({"every_steps": 5, "keep": 2}, fop.EverySteps(5), fop.KeepAny(fop.KeepLast(2))),
        (
            dict(
                policy=fop.SavePolicy(every_steps=5, steps=[7]),
                retention=fop.Retention(keep=2, keep_every=4),
            ),
            fop.AtSteps([7]) | fop.EverySteps(5),
            fop.KeepLast(2) | fop.KeepEvery(4),
        ),
        (
            dict(
                policy=fop.SavePolicy(every_steps=5) | fop.OnPreemption(),
                retention=fop.Retention(keep=1) | fop.KeepFor(60),
            ),
            fop.EverySteps(5) | fop.OnPreemption(),
            fop.KeepLast(1) | fop.KeepFor(60),
        ),
        ({}, fop.EverySteps(1), fop.KeepAny(fop.KeepEvery(1))),  # every step, none deleted
    ]
    for options, policy, retention in cases:
        opts = ManagerOptions.build(str(tmp_path), options)
        assert (opts.policy, opts.retention) == (policy, retention), options
    opts = ManagerOptions.build(str(tmp_path), {"policy": lanes})
    assert _spellings(opts.policy) == [] and _spellings(opts.retention) == []
    kept = fop.KeepAny(fop.KeepLast(2))
    assert opts.policy.temporary == fop.Lane(fop.EverySeconds(60), keep=kept)
    flat = ManagerOptions.build(str(tmp_path), {"every_steps": 5})
    objects = ManagerOptions.build(str(tmp_path), {"policy": fop.EverySteps(5)})
    assert shared_view(flat) == shared_view(objects)


def test_on_preemption_saves_the_notified_step_once_and_the_loop_goes_on(tmp_path):
    """OnPreemption() uses the manager's preemption notice (``_manager/preemption.py``);
    without handle_sigterm it saves the step and the loop decides when to stop."""
    previous = signal.getsignal(signal.SIGTERM)
    with fop.CheckpointManager(
        tmp_path / "run", policy=fop.EverySteps(100) | fop.OnPreemption(), async_save=False
    ) as mngr:
        assert not mngr.save(1, tiny()) and not mngr.preempted
        os.kill(os.getpid(), signal.SIGTERM)  # the manager's handler: a flag, no exit
        assert mngr.save(2, tiny()) and mngr.preempted
        assert not mngr.save(3, tiny())  # once
        assert mngr.save(100, tiny())
        assert mngr.steps() == [2, 100]
    assert signal.getsignal(signal.SIGTERM) is previous  # put back on close


def test_keep_for_never_ages_out_undated_steps_and_lanes_judge_each_lane_apart(tmp_path):
    """Steps of an earlier run (no save time, no lane known) are never aged out by
    KeepFor; in lanes they are in the lane their number says (the permanent policy goes
    by numbers here: 1, 2 and 5 are temporary, judged with 11 and 13)."""
    with fop.CheckpointManager(tmp_path, async_save=False) as mngr:
        for step in (1, 2):
            mngr.save(step, tiny())
    clock = FakeClock()
    # the shorthand every_steps= with a dating retention: the manager's clock dates steps
    with fop.CheckpointManager(
        tmp_path, every_steps=1, retention=fop.KeepFor(5), clock=clock
    ) as mngr:
        for step, t in ((3, 0.0), (4, 4.0), (5, 10.0)):
            clock.value = t
            mngr.save(step, tiny())
        mngr.wait()
        assert mngr.steps() == [1, 2, 5]  # 3 and 4: older than 5 s; 1, 2: undated
    lanes = fop.Lanes(
        temporary=fop.Lane(fop.EverySeconds(10), keep=fop.KeepLast(1)),
        permanent=fop.Lane(fop.EverySteps(10), keep=fop.KeepLast(1)),
    )
    with fop.CheckpointManager(tmp_path, policy=lanes, clock=clock) as mngr:
        for step, t in ((6, 0.0), (10, 5.0), (11, 20.0), (12, 25.0), (13, 40.0)):
            mngr.save(step, tiny(), t=t)
        mngr.wait()
        # permanent lane: 10 and the undated 1, 2, 5, of which KeepLast(1) keeps 10;
        # temporary lane: 11, 13 -> 13 (6 and 12 not saved: too soon)
        assert mngr.steps() == [10, 13]


def test_a_restarted_jobs_temporary_steps_are_still_removed(tmp_path):
    """The lane of an earlier run's step follows from its number when the permanent
    policy goes by numbers: its temporary steps leaked forever, one run at a time."""

    def lanes():
        temporary = fop.Lane(fop.EverySteps(2), keep=fop.KeepLast(2))
        return fop.Lanes(temporary=temporary, permanent=fop.Lane(fop.EverySteps(10)))

    for steps in (range(0, 25), range(25, 40)):
        with fop.CheckpointManager(tmp_path, policy=lanes(), async_save=False) as mngr:
            for step in steps:
                mngr.save(step, tiny())
            mngr.wait()
            kept = mngr.steps()
    assert kept == [0, 10, 20, 30, 36, 38]


def test_readme_policies_snippet(tmp_path):
    """docs/policies.md's policy snippet runs as written (a fresh directory: InitialSave and
    the permanent lane save step 0; nothing else is due within the test's seconds)."""

    code = _docs.run_by("tests/manager/test_policies.py::test_readme_policies_snippet")
    names = dict(fop=fop, directory=str(tmp_path), num_steps=3, state=tiny())
    names["losses"] = [0.5, math.nan, 0.25]
    exec(compile(code, "docs/policies.md", "exec"), names)
    assert names["lanes"].temporary.keep == fop.KeepLast(2)
    for name in ("run", "lanes"):
        with fop.CheckpointManager(tmp_path / name, read_only=True) as reader:
            assert reader.steps() == [0]


def two_clocks(ctx, directory, n=24):
    """Worker (several processes): lanes with time rules, each process's clock at its
    own speed; the primary's decisions and times are shared, so every process saves
    the same steps, in the same lanes, and drops the same ones."""
    speed = 1.0 + 0.7 * jax.process_index()
    lanes = fop.Lanes(
        temporary=fop.Lane(
            fop.EverySeconds(3) | fop.Continuous(max_overhead_percent=50),
            keep=fop.KeepFor(8) | fop.KeepLast(1),
        ),
        permanent=fop.Lane(fop.EverySteps(10), keep=fop.KeepLast(1)),
    )
    saved = []
    with fop.CheckpointManager(directory, policy=lanes) as mngr:
        for step in range(1, n + 1):
            if mngr.save(step, replicated_state(ctx, step, rows=8), t=step * speed):
                saved.append(step)
        mngr.wait()
        known = mngr._book.known()  # what this process believes is there
        lanes_known = mngr._book.dated()[1]
    listed = fop.CheckpointManager(directory, read_only=True).steps()
    return {"saved": saved, "known": known, "listed": listed, "lanes": sorted(lanes_known.items())}


def test_time_based_lanes_decide_alike_on_every_process(tmp_path):
    run = run_processes(
        "test_policies:two_clocks", 2, args={"directory": str(tmp_path / "run")}, timeout_s=150
    )
    a, b = run.check().results
    assert a == b  # saved steps, their lanes, the steps each one believes are there
    assert a["known"] == a["listed"] and 20 in a["listed"] and 10 not in a["listed"]
    assert len(a["saved"]) > len(a["listed"])  # retention ran, the same on both


def test_every_seconds_counts_from_the_latest_steps_save_after_a_restart(tmp_path):
    """A job restarted more often than ``every_seconds`` never saved again: each new
    manager started its clock at its first decision. The default clock now counts
    from the latest step's save; a young step still waits its interval."""
    import time

    with fop.CheckpointManager(tmp_path, every_seconds=1.0) as mngr:
        assert mngr.save(1, tiny(), ignore_policy=True)
    with fop.CheckpointManager(tmp_path, every_seconds=3600.0) as mngr:
        assert not mngr.save(2, tiny())  # step 1 is younger than an hour
    time.sleep(1.2)
    with fop.CheckpointManager(tmp_path, every_seconds=1.0) as mngr:
        assert mngr.save(3, tiny())  # step 1 is older than a second: saved at once
        assert not mngr.save(4, tiny())  # then the interval counts from step 3
    assert fop.CheckpointManager(tmp_path, read_only=True).steps() == [1, 3]


def test_an_earlier_runs_permanent_steps_survive_a_change_of_lanes(tmp_path):
    """A step's lane was known only to the manager that saved it: a later run whose
    permanent policy said otherwise of their numbers judged the earlier run's permanent
    steps temporary and removed them, silently. Each step's manifest records its lane."""
    lanes = fop.Lanes(
        temporary=fop.Lane(fop.EverySteps(1), keep=fop.KeepLast(2)),
        permanent=fop.Lane(fop.EverySteps(10)),
    )
    with fop.CheckpointManager(tmp_path, policy=lanes, async_save=False) as mngr:
        for step in range(1, 26):
            mngr.save(step, {"params": {"w": np.full(2, step, np.float32)}})
    assert fop.CheckpointManager(tmp_path, read_only=True).steps() == [10, 20, 24, 25]
    changed = fop.Lanes(
        temporary=fop.Lane(fop.EverySteps(1), keep=fop.KeepLast(2)),
        permanent=fop.Lane(fop.EverySteps(7)),
    )
    with fop.CheckpointManager(tmp_path, policy=changed, async_save=False) as mngr:
        for step in (26, 27, 28, 29):
            mngr.save(step, {"params": {"w": np.full(2, step, np.float32)}})
    # 10 and 20 stay permanent (their manifests say so), 28 is this run's permanent
    # step (7 divides it), 27 and 29 the temporary lane's last two
    assert fop.CheckpointManager(tmp_path, read_only=True).steps() == [10, 20, 27, 28, 29]


def test_a_savepolicy_clock_inside_another_rule_is_refused_not_dropped(tmp_path):
    """A SavePolicy's own clock counts at the top only (the manager has one clock): inside
    AnyOf, AllOf or a Lane it was dropped without a word; now the open refuses it."""
    timed = fop.SavePolicy(every_seconds=60, clock=FakeClock())
    for n, policy in enumerate(
        [
            fop.AnyOf(fop.EverySteps(5), timed),
            fop.AllOf(timed, fop.EverySteps(2)),
            fop.Lanes(
                temporary=fop.Lane(timed, keep=fop.KeepLast(1)),
                permanent=fop.Lane(fop.EverySteps(4)),
            ),
        ]
    ):
        with pytest.raises(fop.OptionError, match=r"clock= of a SavePolicy inside another"):
            fop.CheckpointManager(tmp_path / str(n), policy=policy)
    clock = FakeClock()  # at the top it is the manager's clock, as before
    with fop.CheckpointManager(
        tmp_path / "top", policy=fop.SavePolicy(every_seconds=60, clock=clock)
    ):
        pass
