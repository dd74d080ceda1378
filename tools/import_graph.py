"""The package's shape, read from its AST: internal imports, cycles, big modules and functions.

    python tools/import_graph.py [package_dir] [--edges] [--check]

``--check`` (run by ``make lint``, so by CI) exits 1 when a rule of the wings breaks:
an import cycle, an import back up, more than two function-level internal imports,
an import inside a function without a comment saying why, a module over 800 lines,
any context variable (a ``ContextVar`` or ``threading.local``: never allowed),
module-level mutable state outside ``state_scan.ALLOWED_STATE``, a format-version test
outside ``state_scan.SEAM`` (``tools/state_scan.py``).

Reports, for the package under ``package_dir`` (default ``flax_orbax_plugin``):

- internal imports made at module level and inside functions, counted separately
  (an import inside ``if TYPE_CHECKING:`` counts as module level: it is one);
- the strongly connected components of the module graph with more than one
  module, once from module-level imports only and once counting every import;
- with wings (subpackages ranked in ``WINGS`` below), the imports that go from a
  wing to a wing ranked above it ("back up");
- modules over 800 lines, functions over 60 lines, the largest class.

Reads files only: nothing is imported or run.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import state_scan

# Bottom to top: a module may import from its own wing and the wings listed before it.
WINGS = [
    "_errors",
    "_base",
    "_storage",
    "_format",
    "_zarr",
    "_like",
    "_state",
    "_incremental",
    "_core",
    "_manager",
    "_interop",
    "_reading",
    "cli",
]

MODULE_LINES = 800
FUNCTION_LINES = 60


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def _resolve(node: ast.ImportFrom | ast.Import, here: str, modules, top: str) -> list[str]:
    """The package modules an import statement loads (the most specific ones named)."""
    targets = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == top or alias.name.startswith(top + "."):
                targets.append(alias.name)
        return [t for t in targets if t in modules]
    if node.level:
        base = here.split(".")
        if not _is_package(here, modules):
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        base_name = ".".join(base + ([node.module] if node.module else []))
    else:
        if not node.module or not (node.module == top or node.module.startswith(top + ".")):
            return []
        base_name = node.module
    for alias in node.names:
        sub = f"{base_name}.{alias.name}"
        if sub in modules:
            targets.append(sub)
        elif base_name in modules:
            targets.append(base_name)
    return sorted(set(targets))


class _Imports(ast.NodeVisitor):
    def __init__(self):
        self.depth = 0
        self.found: list[tuple[ast.AST, bool]] = []  # (node, inside a function)

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node):
        self.found.append((node, self.depth > 0))

    visit_ImportFrom = visit_Import


def _explained(lines: list[str], lineno: int) -> bool:
    """Whether the import at ``lineno`` (1-based) says why it is inside a function: a
    comment on its line, or in the lines just above it (comments, the imports of its
    group, a ``try:``)."""
    if "#" in lines[lineno - 1]:
        return True
    i = lineno - 2
    while i >= 0:
        text = lines[i].strip()
        if text.startswith("#"):
            return True
        if not (text.startswith(("import ", "from ")) or text == "try:"):
            return False
        if "#" in text:
            return True
        i -= 1
    return False


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one member (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def _defs(tree: ast.AST, prefix: str = ""):
    """(node, qualified name) for every function and class, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            qual = f"{prefix}{node.name}"
            yield node, qual
            yield from _defs(node, qual + ".")
        else:
            yield from _defs(node, prefix)


def _wing(name: str, top: str) -> str | None:
    parts = name.split(".")
    if len(parts) < 2:
        return None
    return parts[1]


def main(argv: list[str]) -> int:
    show_edges = "--edges" in argv  # --check: exit 1 when a rule of the wings is broken
    check = "--check" in argv
    args = [a for a in argv if not a.startswith("--")]
    root = Path(args[0] if args else "flax_orbax_plugin").resolve()
    top = root.name
    modules = state_scan.modules(root)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    module_level: dict[str, set[str]] = {m: set() for m in modules}
    function_level: list[tuple[str, int, str]] = []
    n_module_imports = 0
    big_modules = []
    big_functions = []
    classes = []
    unexplained: list[tuple[str, int]] = []  # function-level imports without a why
    trees: dict[str, ast.AST] = {}  # parsed once, for state_scan too
    for name, path in modules.items():
        text = path.read_text()
        tree = trees[name] = ast.parse(text)
        lines = len(text.splitlines())
        source = text.splitlines()
        if lines > MODULE_LINES:
            big_modules.append((lines, name))
        visitor = _Imports()
        visitor.visit(tree)
        for node, inside in visitor.found:
            if inside and not _explained(source, node.lineno):
                unexplained.append((name, node.lineno))
            for target in _resolve(node, name, modules, top):
                if target == name:
                    continue
                edges[name].add(target)
                if inside:
                    function_level.append((name, node.lineno, target))
                else:
                    module_level[name].add(target)
                    n_module_imports += 1
        for node, qual in _defs(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > FUNCTION_LINES:
                    big_functions.append((n, f"{name}:{qual}"))
            elif isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                methods = sum(
                    isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body
                )
                classes.append((n, methods, f"{name}:{node.name}"))

    print(
        f"package {top}: {len(modules)} modules, {sum(len(v) for v in edges.values())} "
        "internal import edges"
    )
    n_fn_edges = len({(a, t) for a, _, t in function_level})
    print(
        f"module-level internal imports: {n_module_imports} statements-targets, "
        f"{sum(len(v) for v in module_level.values())} edges"
    )
    print(f"function-level internal imports: {len(function_level)} (edges {n_fn_edges})")
    for a, line, t in sorted(function_level):
        print(f"  {a}:{line} -> {t}")
    n_cycles = 0
    for label, graph in (("module-level only", module_level), ("counting function-level", edges)):
        comps = _sccs(graph)
        n_cycles += len(comps)
        print(f"cycles ({label}): {len(comps)}")
        for comp in comps:
            print(f"  {len(comp)} modules: {', '.join(comp)}")
    ranked = {w: i for i, w in enumerate(WINGS)}
    back_up = []
    for a, targets in edges.items():
        wa = _wing(a, top)
        for t in targets:
            wt = _wing(t, top)
            if wa in ranked and wt in ranked and ranked[wt] > ranked[wa]:
                back_up.append((a, t))
    if any(_is_package(m, modules) and m != top for m in modules):  # wings exist
        print(f"imports back up the wings: {len(back_up)}")
        for a, t in sorted(back_up):
            print(f"  {a} -> {t}")
    print(f"modules over {MODULE_LINES} lines: {len(big_modules)}")
    for n, name in sorted(big_modules, reverse=True):
        print(f"  {n:5d} {name}")
    print(f"functions over {FUNCTION_LINES} lines: {len(big_functions)}")
    for n, name in sorted(big_functions, reverse=True):
        print(f"  {n:5d} {name}")
    classes.sort(reverse=True)
    print("largest classes (lines, methods):")
    for n, methods, name in classes[:3]:
        print(f"  {n:5d} {methods:3d} {name}")
    if show_edges:
        print("edges:")
        for a in sorted(edges):
            for t in sorted(edges[a]):
                print(f"  {a} -> {t}")
    if check:  # the rules of docs/architecture.md, as CI runs them (make lint)
        broken = [
            f"{what}: {n} (at most {most})"
            for what, n, most in (
                ("import cycles", n_cycles, 0),
                ("imports back up the wings", len(back_up), 0),
                ("function-level internal imports", len(function_level), 2),
                (f"modules over {MODULE_LINES} lines", len(big_modules), 0),
                ("imports inside a function without a comment saying why", len(unexplained), 0),
            )
            if n > most
        ]
        contexts, state, tests = state_scan.scan(root, trees)
        for module, line, name, what in state_scan.hidden_modes(contexts, state):
            broken.append(f"hidden mode {name} ({what}) at {module}:{line}: pass it explicitly")
        for module, line, name, what in state_scan.outside_seam(tests):
            broken.append(
                f"format-version test ({name} {what}) at {module}:{line}: outside the format "
                "seam (_core/formats.py); ask the format"
            )
        broken += [
            f"import inside a function at {m}:{n} says no why (a comment)" for m, n in unexplained
        ]
        for line in broken:
            print(f"import_graph --check: {line}", file=sys.stderr)
        return 1 if broken else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
