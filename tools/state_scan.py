"""Hidden modes, read from the AST: context variables, module-level mutable state, version tests.

    python tools/state_scan.py [package_dir]

Reads files only (nothing is imported or run). Three findings, each a list of
``(module, line, name, what)``:

- **context variables**: a ``contextvars.ContextVar`` or a ``threading.local``, anywhere
  in a module (bound at module level, in a class, on an instance, a subclass of it, or
  imported by name): a value that changes with the caller or its thread, not passed in.
  None is ever allowed: the region of a collective operation, the last one the package
  had, is an argument now (``_base/regions.py``);
- **module-level mutable state**: a module-level name bound to a mutable container
  (a list, dict or set display or comprehension; ``list()``, ``dict()``, ``set()``,
  ``collections.Counter/defaultdict/deque/OrderedDict``, ``itertools.count``) that the
  package mutates somewhere (a mutating method, an item or slice assignment or
  deletion, an augmented assignment, ``next()`` on a counter), and a module-level name
  rebound through ``global`` inside a function;
- **format-version tests**: a comparison one of whose sides names ``format_version``
  (a name, an attribute or a string key), or a branch (``if``, conditional
  expression, ``and``/``or``, ``not``) on a ``packed`` name or a chunk reader's
  ``packed`` attribute (``direct.packed``: version 2's reader): the code
  that picks a behaviour by format version (``format_version is None`` is a test of
  presence, not counted).

``tools/import_graph.py --check`` fails on any context variable (:func:`hidden_modes`:
no allow-list applies to them), on module-level state outside :data:`ALLOWED_STATE`
and on a version test outside :data:`SEAM`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MUTATORS = {
    "append", "extend", "insert", "add", "update", "pop", "popitem", "clear", "remove",
    "discard", "setdefault", "appendleft", "extendleft", "popleft", "set", "reset",
}  # fmt: skip
CONTAINER_CALLS = {
    "list", "dict", "set", "Counter", "defaultdict", "deque", "OrderedDict", "count",
}  # fmt: skip
CONTEXT_NAMES = {"ContextVar", "local"}  # contextvars.ContextVar, threading.local
CONTEXT_MODULES = {"ContextVar": "contextvars", "local": "threading"}
READER_NAMES = {"direct", "reader"}  # what the core calls a checkpoint's chunk reader

# Module-level state kept on purpose, each with its reason (docs/architecture.md,
# "Explicit requests"): (module, name) -> why. None of it is a mode: nothing here
# changes what a save writes or a read returns. Never a context variable: those are
# refused whatever their name (hidden_modes).
_P = "flax_orbax_plugin."
_SEQUENCE = "the process's sequence of SPMD operations (the n-th, the same on every process)"
_TEST_COUNTER = "a documented test hook: counts what tests assert (no behaviour reads it)"
ALLOWED_STATE: dict[tuple[str, str], str] = {
    (_P + "_base.distributed", "_COUNTER"): _SEQUENCE,
    (_P + "_base.distributed", "_NAMES"): _SEQUENCE,
    (_P + "_base.distributed", "_REGIONS"): _SEQUENCE,
    (_P + "_base.distributed", "_SESSION"): "the process's session nonce, drawn once",
    (_P + "_base.regions", "CALLS"): _TEST_COUNTER,
    (_P + "_core.handle", "_RUNNING"): "the process's saves still running, finished at exit",
    (_P + "_base.host", "_STEPS"): (
        "the library's steps at interpreter exit (finish saves, leave runs, announce the "
        "end), each registered once at first need"
    ),
    (_P + "_manager.manager", "_OPEN"): (
        "the process's writers of several processes not closed: they leave at exit"
    ),
    (_P + "_zarr.chunk_files", "_read_total"): _TEST_COUNTER,
    (_P + "_base.env", "_HITS"): "FOP_FAIL_AT's N-th hit, counted per process (a test hook)",
    (_P + "_base.tree", "_LEAF_TYPES"): "a cache of the types seen to be plain leaves",
    (_P + "_storage.contexts", "_CONTEXTS"): "the tensorstore contexts every open shares",
    (_P + "_zarr.chunk_files", "_pools"): "the process's shared read threads",
    (_P + "_zarr.chunk_files", "_pools_lock"): "the process's shared read threads (after fork)",
    (_P + "_incremental.reuse", "_LOGGED"): "what was logged once per store and reason",
    (_P + "_base.liveness", "_BEATING"): "the process's heartbeat thread per coordination client",
    (_P + "_base.liveness", "_DEAD"): "the processes this one's waits named dead, per session",
    (_P + "_storage.deleting", "_CONTEXT"): "the tensorstore context removals share (created once)",
    (_P + "_base.host", "_IN_FLIGHT"): (
        "the process's one save_async in flight (a second waits; a restore or verify of "
        "its path waits for it)"
    ),
}

# Modules where a format version may be tested: the format seam (the two formats, the
# records that read the version from the metadata, the formats' own internals).
SEAM = (
    "flax_orbax_plugin._core.formats",
    "flax_orbax_plugin._core.format_v1",  # version 1's Format, at the seam's edge
    "flax_orbax_plugin._format.layout",
    "flax_orbax_plugin._zarr.",
)


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name):
            return f.id
        if isinstance(f, ast.Attribute):
            return f.attr
    return None


def _bound(stmt: ast.stmt) -> list[tuple[str, ast.AST]]:
    """(name, value) for a module-level assignment statement."""
    if isinstance(stmt, ast.Assign):
        return [(t.id, stmt.value) for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
        return [(stmt.target.id, stmt.value)]
    return []


def _is_container(value: ast.AST) -> bool:
    if isinstance(value, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp):
        return True
    return isinstance(value, ast.SetComp) or _call_name(value) in CONTAINER_CALLS


def _last_name(node: ast.AST) -> str | None:
    """``x`` for ``x``, ``mod.x``, ``x[...]`` (the container a mutation reaches)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


_FUNCTIONS = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


def _outermost_functions(tree: ast.AST, kinds=_FUNCTIONS):
    """The functions of ``tree`` that no other function holds (a nested one is inside
    its outer one's walk: walking it again would only repeat its nodes)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, kinds):
            yield node
        else:
            todo.extend(ast.iter_child_nodes(node))


def _in_functions(tree: ast.AST):
    """Every node inside a function body (a container filled at import is a constant),
    each once."""
    for fn in _outermost_functions(tree):
        yield from ast.walk(fn)


def _mutated(tree: ast.AST) -> set[str]:
    """Names (last component) this module's functions mutate in place."""
    out: set[str] = set()
    for node in _in_functions(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATORS:
                out.add(_last_name(node.func.value) or "")
            if node.func.attr == "__setitem__":
                out.add(_last_name(node.func.value) or "")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "next" and node.args:
                out.add(_last_name(node.args[0]) or "")
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.Delete):
            targets = [node.target] if isinstance(node, ast.AugAssign) else node.targets
        for t in targets:
            if isinstance(t, ast.Subscript) or isinstance(node, ast.AugAssign):
                out.add(_last_name(t) or "")
    return out


def _globals_rebound(tree: ast.AST) -> set[str]:
    """Names a function stores to that it (or a function inside it) declares global.
    An outermost function's walk holds every nested one's declarations and stores, so
    the nested ones add nothing: each function is walked once, inside its outermost."""
    out: set[str] = set()
    for fn in _outermost_functions(tree, ast.FunctionDef | ast.AsyncFunctionDef):
        declared, stored = set(), set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                declared.update(node.names)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                stored.add(node.id)
        out |= declared & stored
    return out


def _names_version(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "format_version":
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "format_version":
            return True
        if isinstance(sub, ast.Constant) and sub.value == "format_version":
            return True
    return False


def _is_none(node: ast.Compare) -> bool:
    """``x is None`` / ``x is not None``: a test of presence, not of a version."""
    return all(isinstance(op, ast.Is | ast.IsNot) for op in node.ops) and any(
        isinstance(c, ast.Constant) and c.value is None for c in [node.left, *node.comparators]
    )


def _is_packed(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return _is_packed(node.operand)
    if isinstance(node, ast.BoolOp):
        return any(_is_packed(v) for v in node.values)
    if isinstance(node, ast.Name):
        return node.id == "packed"
    # a chunk reader's ``packed`` (version 2's reader); a storage record's ``packed`` is
    # a sub-byte leaf's bit packing, no format version
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "packed"
        and isinstance(node.value, ast.Name)
        and node.value.id in READER_NAMES
    )


def _context_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` for each context variable in a module: a ``ContextVar`` or a
    ``threading.local`` named anywhere (called, subclassed, or imported by name)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("contextvars", "threading"):
            for alias in node.names:
                if CONTEXT_MODULES.get(alias.name) == node.module:
                    found.append((node.lineno, f"{node.module}.{alias.name} imported"))
        elif isinstance(node, ast.Attribute) and node.attr in CONTEXT_NAMES:
            if isinstance(node.value, ast.Name) and node.value.id == CONTEXT_MODULES[node.attr]:
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return found


def scan(root: Path, trees: dict[str, ast.AST] | None = None):
    """(context variables, module-level mutable state, version tests) of the package;
    ``trees``: its modules already parsed (dotted name -> tree, as :func:`modules`
    names them), so that a caller that parsed them need not have them parsed again."""
    if trees is None:
        trees = {name: ast.parse(path.read_text()) for name, path in modules(root).items()}
    mutated = {name: _mutated(tree) for name, tree in trees.items()}
    mutated_anywhere: set[str] = set().union(*mutated.values())
    contexts, state, tests = [], [], []
    for name, tree in trees.items():
        mutated_here = mutated[name]
        bound_at = {s.lineno: b for s in tree.body for b, _ in _bound(s)}
        for line, what in _context_uses(tree):
            contexts.append((name, line, bound_at.get(line, what), "context variable"))
        for stmt in tree.body:
            for bound, value in _bound(stmt):
                if _is_container(value) and (
                    bound in mutated_here or (bound.isupper() and bound in mutated_anywhere)
                ):
                    state.append((name, stmt.lineno, bound, "mutated container"))
        for bound in sorted(_globals_rebound(tree)):
            state.append((name, 0, bound, "rebound through global"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and _names_version(node) and not _is_none(node):
                tests.append((name, node.lineno, "format_version", "comparison"))
            test = getattr(node, "test", None)
            if isinstance(node, ast.If | ast.IfExp | ast.While) and _is_packed(test):
                tests.append((name, node.lineno, "packed", "branch"))
    return contexts, state, tests


def outside_seam(tests):
    return [t for t in tests if not any(t[0] == s or t[0].startswith(s) for s in SEAM)]


def not_allowed(found):
    return [f for f in found if (f[0], f[2]) not in ALLOWED_STATE]


def hidden_modes(contexts, state):
    """What ``import_graph --check`` refuses: every context variable (no allow-list),
    and the module-level state that :data:`ALLOWED_STATE` does not list."""
    return list(contexts) + not_allowed(state)


def report(root: Path, out=sys.stdout) -> tuple[int, int, int]:
    """Prints the three findings; returns their counts (tests: outside the seam)."""
    contexts, state, tests = scan(root)
    outside = outside_seam(tests)
    for title, found in (
        ("context variables", contexts),
        ("module-level mutable state", state),
        ("format-version tests outside the seam", outside),
    ):
        print(f"{title}: {len(found)}", file=out)
        for module, line, name, what in found:
            why = ALLOWED_STATE.get((module, name))
            note = f"  (allowed: {why})" if why else ""
            print(f"  {module}:{line} {name} ({what}){note}", file=out)
    per_module: dict[str, int] = {}
    for module, *_ in outside:
        per_module[module] = per_module.get(module, 0) + 1
    if per_module:
        print("  by module: " + ", ".join(f"{m} {n}" for m, n in sorted(per_module.items())))
    return len(contexts), len(state), len(outside)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    report(Path(args[0] if args else "flax_orbax_plugin").resolve())
