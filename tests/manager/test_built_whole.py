"""Collaborators built whole (issue 52, item 3): the manager's StepBook gets its tier,
per-host mode, run and writer when it is built, a pytree item's pending its snapshot,
the save schedule its context, the open's collective region its stall timeout, the
persistent tier's state the manager's events, the retention runner what a save is
doing; no module of the package assigns a field into one of them from outside
afterwards."""

import ast
import pathlib

import flax_orbax_plugin

PACKAGE = pathlib.Path(flax_orbax_plugin.__file__).parent
# (the name an object goes by, the field): set from outside, with its reason
ALLOWED = {("region", "agreeing")}  # an agreement's running state (as drawn), not a field
WATCHED = {"book", "_book", "region", "drawn", "_schedule", "done", "snap", "plan"}
# Fields a collaborator is given when built, never by a method later: the events a tier
# tells (its state's), what a save is doing (the retention runner's ``_busy``).
GIVEN_WHEN_BUILT = {"events", "_busy"}


def _assigned(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [node.target]
    return []


def _name(value: ast.expr) -> str | None:
    if isinstance(value, ast.Name):
        return value.id
    return value.attr if isinstance(value, ast.Attribute) else None


def test_no_module_assigns_into_a_collaborator_after_it_is_built():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _assigned(node):
                targets = target.elts if isinstance(target, ast.Tuple) else [target]
                for t in targets:
                    if not isinstance(t, ast.Attribute):
                        continue
                    owner = _name(t.value)
                    if owner in WATCHED and (owner, t.attr) not in ALLOWED:
                        where = path.relative_to(PACKAGE.parent)
                        found.append(f"{where}:{node.lineno}: {ast.unparse(t)}")
    assert found == [], "\n".join(found)


def test_a_tier_and_the_retention_runner_get_events_and_busy_when_built():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
            for method in (m for m in methods if m.name != "__init__"):
                for node in ast.walk(method):
                    for target in _assigned(node):
                        if isinstance(target, ast.Attribute) and target.attr in GIVEN_WHEN_BUILT:
                            where = path.relative_to(PACKAGE.parent)
                            found.append(f"{where}:{node.lineno}: {ast.unparse(target)}")
    assert found == [], "\n".join(found)
