"""Collaborators built whole (issue 52, item 3): the manager's StepBook gets its tier,
per-host mode, run and writer when it is built, a pytree item's pending its snapshot,
the save schedule its context, the open's collective region its stall timeout; no
module of the package assigns a field into one of them from outside afterwards."""

import ast
import pathlib

import flax_orbax_plugin

PACKAGE = pathlib.Path(flax_orbax_plugin.__file__).parent
# (the name an object goes by, the field): set from outside, with its reason
ALLOWED = {("region", "agreeing")}  # an agreement's running state (as drawn), not a field
WATCHED = {"book", "_book", "region", "drawn", "_schedule", "done", "snap", "plan"}


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
