"""The public option objects (SavePolicy, Retention, Tier), each option declared once,
shorthands and deprecated flat keywords (issue 33, item 3)."""

from __future__ import annotations

import ast
import inspect
import os
import re
import warnings

import numpy as np
import pytest

import flax_orbax_plugin as fop
from flax_orbax_plugin._base.keywords import doc_table
from flax_orbax_plugin._manager import options as option_table
from flax_orbax_plugin._manager.tiers import tier as tier_option

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "flax_orbax_plugin")
S3 = "s3://bucket/run"


def _zero():
    return 0.0


def tiny(v=0.0):
    return {"params": {"w": np.full((4,), v, np.float32)}}


# -- the objects: checked when made, by their field names ----------------------------------


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: fop.SavePolicy(every_steps=0), fop.OptionError, "every_steps must be a positive"),
        (lambda: fop.SavePolicy(every_seconds="6"), TypeError, "every_seconds must be a number"),
        (lambda: fop.SavePolicy(steps=[-1]), fop.OptionError, "steps must be an int >= 0"),
        (lambda: fop.SavePolicy(clock=_zero), fop.OptionError, "clock=<function _zero at"),
        (lambda: fop.Retention(keep="3"), TypeError, "keep must be a positive int or None"),
        (lambda: fop.Retention(keep_best=1), fop.OptionError, "keep_best= needs best_metric="),
        (lambda: fop.Retention(keep=1, best_mode="mx"), fop.OptionError, "best_mode must be"),
        (lambda: fop.Tier(""), fop.OptionError, "persistent: expected a path or URL"),
        (lambda: fop.Tier(S3, every=0), fop.OptionError, "every must be a positive int"),
        (lambda: fop.Tier(S3, keep_every=5), fop.OptionError, "keep_every=5 does nothing"),
        (lambda: fop.Tier("/tmp/x", lease_seconds=9), fop.OptionError, "lease_seconds=9.0 does"),
        (lambda: fop.Tier(S3, grace_seconds=-1), fop.OptionError, "grace_seconds must"),
    ],
    ids=[f"case{i}" for i in range(12)],
)
def test_an_object_checks_its_fields_when_made(make, error, words):
    with pytest.raises(error, match="^" + re.escape(words)):
        make()


def test_the_objects_are_frozen_and_hold_the_checked_values():
    policy = fop.SavePolicy(every_steps=np.int64(5), steps=iter([3, 3]))
    assert policy.every_steps == 5 and type(policy.every_steps) is int
    assert policy.steps == frozenset({3})
    with pytest.raises(AttributeError):
        policy.every_steps = 6
    tier = fop.Tier("s3://bucket/run", keep=1, grace_seconds=5)
    assert (tier.keep, tier.every, tier.grace_seconds) == (1, 1, 5.0)
    assert fop.Retention(keep=2) == fop.Retention(keep=2)  # a value: shareable


def test_the_manager_takes_the_objects(tmp_path):
    policy, retention = fop.SavePolicy(every_steps=2), fop.Retention(keep=1, keep_every=4)
    with fop.CheckpointManager(tmp_path / "a", policy=policy, retention=retention) as mngr:
        saved = [s for s in range(1, 9) if mngr.save(s, tiny(s))]
        mngr.wait()
        assert saved == [2, 4, 6, 8]
        assert mngr.steps() == [4, 8]
    # One frozen policy shared by two managers: each keeps its own time of the last save.
    clock = fop.SavePolicy(every_seconds=10, clock=lambda: 0.0)
    with (
        fop.CheckpointManager(tmp_path / "b", policy=clock) as b,
        fop.CheckpointManager(tmp_path / "c", policy=clock) as c,
    ):
        assert not b.should_save(1, t=5.0) and not c.should_save(1, t=5.0)  # clocks start
        assert b.save(2, tiny(), t=20.0)
        assert not b.should_save(3, t=25.0) and c.should_save(3, t=25.0)


def test_a_tier_object_configures_the_persistent_tier(tmp_path):
    tier = fop.Tier(str(tmp_path / "remote"), keep=1, every=2, grace_seconds=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new form warns of nothing
        with fop.CheckpointManager(
            tmp_path / "local", keep=3, persistent=tier, handle_sigterm=True
        ) as mngr:
            for step in (1, 2, 3, 4):
                mngr.save(step, tiny(step))
            mngr.wait()
            mngr.persistent.wait()
            assert mngr.persistent.retention == fop.Retention(keep=1)
            assert mngr.persistent.grace_seconds == 5.0
    assert fop.CheckpointManager(tmp_path / "remote", read_only=True).steps() == [4]


# -- a shorthand with the object that covers it: an error naming both ----------------------

BOTH = [
    ({"keep": 2, "retention": fop.Retention(keep=1)}, "keep=2 and retention=Retention("),
    ({"best_mode": "max", "retention": fop.Retention()}, "best_mode='max' and retention="),
    ({"every_steps": 5, "policy": fop.SavePolicy(steps=[1])}, "every_steps=5 and policy=Save"),
    ({"clock": _zero, "policy": fop.SavePolicy()}, "clock=<function _zero"),
]


@pytest.mark.parametrize("options, words", BOTH, ids=["keep", "best_mode", "every_steps", "clock"])
def test_a_shorthand_and_its_object_together_are_refused(tmp_path, options, words):
    with pytest.raises(fop.OptionError, match="^" + re.escape(words)) as info:
        fop.CheckpointManager(tmp_path / "run", **options)
    group = "retention" if "retention" in options else "policy"
    assert f"both set the {group}" in str(info.value)
    assert not (tmp_path / "run").exists()


def test_a_flat_tier_keyword_with_a_tier_object_is_refused(tmp_path):
    """Refused before the deprecation warning, which advised a Tier inside a Tier."""
    tier = fop.Tier(str(tmp_path / "p"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # none is given
        with pytest.raises(
            fop.OptionError, match=r"^persistent_keep= and persistent=Tier\(.* both configure"
        ):
            fop.CheckpointManager(tmp_path / "run", persistent=tier, persistent_keep=1)


def test_a_bad_path_with_flat_tier_keywords_is_named(tmp_path):
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(
            fop.OptionTypeError, match=r"^persistent: expected a path, an s3:// / gs:// URL"
        ),
    ):
        fop.CheckpointManager(tmp_path / "run", persistent=5, persistent_keep=1)


def test_a_bad_object_in_the_wrong_option_is_named(tmp_path):
    with pytest.raises(TypeError, match=r"^policy: expected a SavePolicy\(\.\.\.\) or None"):
        fop.CheckpointManager(tmp_path / "run", policy=fop.Retention(keep=1))
    with pytest.raises(TypeError, match=r"^retention: expected a Retention\(\.\.\.\) or None"):
        fop.CheckpointManager(tmp_path / "run", retention={"keep": 1})


# -- the flat persistent_* keywords: one release more, with a DeprecationWarning -------------


def test_flat_tier_keywords_warn_naming_the_tier_and_configure_the_same_tier(tmp_path):
    remote = str(tmp_path / "remote")
    with pytest.warns(DeprecationWarning) as caught:
        mngr = fop.CheckpointManager(
            tmp_path / "local", persistent=remote, persistent_keep=2, persistent_every=3
        )
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith("persistent_keep=, persistent_every=: deprecated, and gone in")
    assert f"persistent=fop.Tier({remote!r}, keep=2, every=3)" in message
    assert caught[0].filename == __file__  # the warning names the user's line
    with mngr:
        assert mngr.persistent.retention == fop.Retention(keep=2)
        for step in (1, 2, 3):
            mngr.save(step, tiny(step))
        mngr.wait()
        mngr.persistent.wait()
        assert mngr.persistent.replicated == [3]  # what Tier(remote, every=3) does


def test_the_callback_warns_once_and_hands_its_manager_the_tier(tmp_path):
    options = {"persistent": str(tmp_path / "remote"), "persistent_keep": 1}
    with pytest.warns(DeprecationWarning, match=r"fop.Tier\(.*keep=1\)") as caught:
        cb = fop.CheckpointCallback(tmp_path / "local", manager_options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the manager it makes warns no more
        cb.on_train_start(tiny())
        assert cb.manager.persistent.retention == fop.Retention(keep=1)
        cb.close()
    assert len(caught) == 1


def test_a_flat_tier_keyword_given_to_the_callback_points_to_a_tier(tmp_path):
    with pytest.raises(
        TypeError,
        match=re.escape("did you mean manager_options={'persistent': fop.Tier(<path>, keep=...)}?"),
    ):
        fop.CheckpointCallback(tmp_path / "run", persistent_keep=1)


def test_the_callback_takes_the_objects_through_manager_options(tmp_path):
    cb = fop.CheckpointCallback(
        tmp_path / "run", manager_options={"retention": fop.Retention(keep=1, keep_every=10)}
    )  # its own keep=3 (a default) gives way to the object
    state = cb.on_train_start(tiny())
    for step in range(1, 5):
        cb.on_step_end(step, state)
    cb.on_train_end(state)
    assert fop.CheckpointManager(tmp_path / "run", read_only=True).steps() == [4]
    with pytest.raises(fop.OptionError, match=r"^keep=2 and retention=Retention\("):
        fop.CheckpointCallback(
            tmp_path / "run", keep=2, manager_options={"retention": fop.Retention(keep=1)}
        )
    with pytest.raises(fop.OptionError, match=r"^every_steps=2 and policy=SavePolicy\("):
        fop.CheckpointCallback(
            tmp_path / "run", every_steps=2, manager_options={"policy": fop.SavePolicy()}
        )


# -- save(force=): renamed ignore_policy= ----------------------------------------------------


def test_ignore_policy_saves_whatever_the_policy_says_and_force_warns(tmp_path):
    with fop.CheckpointManager(tmp_path / "run", every_steps=10) as mngr:
        assert not mngr.save(3, tiny())
        assert mngr.save(4, tiny(), ignore_policy=True)
        with pytest.warns(DeprecationWarning, match=r"save\(force=\).*ignore_policy=True") as w:
            assert mngr.save(5, tiny(), force=True)
        assert w[0].filename == __file__
        with pytest.warns(DeprecationWarning):
            assert not mngr.save(6, tiny(), force=False)  # the policy decides again
        with (
            pytest.warns(DeprecationWarning),
            pytest.raises(
                fop.OptionError, match=r"^force=True and ignore_policy=True are one option"
            ),
        ):
            mngr.save(7, tiny(), force=True, ignore_policy=True)
        with pytest.raises(fop.OptionTypeError, match="^ignore_policy must be True or False"):
            mngr.save(8, tiny(), ignore_policy="yes")
        mngr.wait()
        assert mngr.steps() == [4, 5]


# -- each option declared once: signature, docstring, docs table, "did you mean" -------------


@pytest.mark.parametrize(
    "cls, declared",
    [
        (fop.CheckpointManager, option_table.MANAGER),
        (fop.CheckpointCallback, option_table.CALLBACK),
    ],
    ids=["manager", "callback"],
)
def test_signature_and_docstring_come_from_the_declarations(cls, declared):
    params = list(inspect.signature(cls).parameters.values())
    assert params[0].name == "directory"
    assert [(p.name, p.default) for p in params[1:]] == [(o.name, o.default) for o in declared]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:])
    for option in declared:
        assert option.doc, option.name
        assert f"      {option.name}: {option.doc} (default: " in cls.__doc__


def test_docs_manager_md_tables_match_the_declarations():
    text = open(os.path.join(ROOT, "docs", "manager.md")).read()
    for name, declared in [
        ("CheckpointManager", option_table.MANAGER),
        ("Tier", tier_option.FIELDS),
        ("CheckpointCallback", option_table.CALLBACK),
    ]:
        found = re.search(rf"<!-- options: {name} .*?-->\n(.*?)\n<!-- /options -->", text, re.S)
        assert found, name
        assert found.group(1) == doc_table(declared), (
            f"docs/manager.md's {name} table is stale; it should read:\n{doc_table(declared)}"
        )


def test_did_you_mean_comes_from_the_declared_aliases(tmp_path):
    for option in option_table.MANAGER:
        for alias in option.aliases:
            with pytest.raises(TypeError, match=rf"'{alias}': did you mean {option.name}=\?"):
                fop.CheckpointManager(tmp_path / "run", **{alias: 1})
    with pytest.raises(TypeError, match=r"'persistent_keeep': did you mean persistent_keep=\?"):
        fop.CheckpointManager(tmp_path / "run", persistent_keeep=1)


# -- the callback uses the manager's public API; no lint-shaped code -------------------------


def _private_manager_uses(path):
    tree = ast.parse(open(path).read())
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            owner = ast.unparse(node.value)
            if owner in ("mngr", "self.manager", "self._manager", "manager"):
                uses.append(f"{owner}.{node.attr} (line {node.lineno})")
    return uses


@pytest.mark.parametrize("module", ["callback.py", "resuming.py"])
def test_the_callback_uses_only_the_managers_public_api(module):
    assert _private_manager_uses(os.path.join(PACKAGE, "_manager", module)) == []


def test_no_lint_shaped_statements_in_the_package():
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            source = open(path).read()
            where = os.path.relpath(path, ROOT)
            skips = [line for line in source.splitlines() if "fmt: skip" in line]
            found += [f"{where}: # fmt: skip"] * len(skips)
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.BoolOp | ast.IfExp):
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:60]}")
                if (
                    isinstance(node, ast.Call)
                    and ast.unparse(node.func) == "property"
                    and any(isinstance(a, ast.Lambda) for a in node.args)
                ):
                    found.append(f"{where}:{node.lineno}: property(lambda ...)")
    assert found == []


def test_no_import_alias_names_another_module():
    """An alias of a module is ``_<name>``, a part of its name (``json_docs as _docs``) or
    its wing and name (``restore as _core_restore``): never an old or other module's
    name (``orbax_reader as _orbax_import``, ``reuse as _incremental``)."""
    wrong = []
    for folder, _, files in os.walk(PACKAGE):
        for name in [f for f in files if f.endswith(".py")]:
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                for alias in node.names:
                    if not (alias.asname or "").startswith("_") or not alias.name.islower():
                        continue
                    words = set(alias.name.split("_")) | set((node.module or "").split("."))
                    words |= {w for part in (node.module or "").split(".") for w in part.split("_")}
                    if not set(alias.asname.strip("_").split("_")) <= words - {""}:
                        wrong.append(
                            f"{os.path.relpath(path, ROOT)}: {alias.name} as {alias.asname}"
                        )
    assert wrong == []


def test_the_public_methods_the_callback_uses(tmp_path):
    with fop.CheckpointManager(tmp_path / "run") as mngr:
        assert mngr.pending_save is None and not mngr.preempted_at(1)
        mngr.save(1, tiny(1))
        handle = mngr.pending_save
        assert handle is not None  # the save in flight, until waited for
        mngr.wait_for_save()
        assert handle.done() and mngr.pending_save is None
        mngr.save(2, tiny(2), data_iterator=fop.StepIndexedIterator(lambda i: i))
        mngr.delete(1)  # waits for step 2 first, then removes step 1 through the owner
        assert mngr.steps() == [2]
        with pytest.raises(fop.CheckpointNotFoundError, match=r"^7: no committed step of"):
            mngr.delete(2, 7)  # nothing removed
        assert mngr.steps() == [2]
    reader = fop.CheckpointManager(tmp_path / "run", read_only=True)
    with pytest.raises(fop.CheckpointError, match="is read-only"):
        reader.delete(2)
    writer = fop.CheckpointManager(tmp_path / "run")
    with writer:
        writer.restore(items=("params",))
        with pytest.warns(UserWarning, match="holds a 'data_iterator' item"):
            writer.warn_data_replay()  # a resume of named items that left the data out


@pytest.mark.distributed
def test_the_callbacks_overwrite_clears_the_steps_once_with_two_processes(tmp_path):
    """overwrite=True goes through the manager's collective delete: the primary removes
    each step, every process meets it, none of them fails on a step already gone."""
    from _multiprocess import run_processes

    run = run_processes(
        "_mp_workers:callback_overwrite",
        2,
        devices_per_process=1,
        args={"directory": str(tmp_path / "ckpt")},
        env={"FOP_COORDINATION_TIMEOUT_S": "20"},
        timeout_s=60,
    ).check()
    for p in run.procs:
        assert p.result == {"after_clear": [], "at_end": [3]}
