"""The engine's imports point one way and form no cycle.

Every import in `engine/src/pagoda_engine` counts, read with `ast` (nothing is imported):
module-level ones and those inside functions (a deferred import is still a dependency, only a
later one), those under `if TYPE_CHECKING:` (annotations need the other module to be read),
`import x.y`, `from x import y` (an edge to the submodule `x.y` when there is one, else to `x`),
relative imports, `importlib.import_module("x.y")` with a literal name, and the module names in
the string tables listed in `STRING_TABLES` (`pagoda`'s verbs, which `cli.py` imports by name).
An `import_module` of a computed name (a worker class or a Triton kernel named in configuration)
cannot be seen. The package's own `_LAZY` table is left out: it re-exports names for the
package's users (`pagoda_engine.LLM`), which none of its modules asks for; counting it would tie
every `from pagoda_engine import __version__` to `api.llm`.

What is an edge, for a package's `__init__`: an import names exactly one module, and no edge
goes to the packages above it. Python runs `pkg/__init__.py` before `pkg.sub`, but it puts `pkg`
in `sys.modules` first, so `pkg.sub` never waits for its `__init__` to finish; an `__init__` that
imports its own submodules (to re-export them) is therefore not a cycle by itself. It is one
when a submodule takes a name back from the package (`from pkg import NAME`, NAME not a
submodule): then each needs the other finished first, which is what a cycle means.

A cycle is a strongly connected set of modules (each reaches every other through imports); the
failure names its modules and every import inside it, the ones to cut from. The directions:
`worker/` is the bottom of the stack (model, kernels, device), `core/` schedules on top of it
through the executor's interface only, `api/` talks to the core and never to a worker, and the
neutral modules (`NEUTRAL_MODULES`: configuration, messages, errors) are read by every layer, so
they import from none.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "pagoda_engine"
SOURCE_ROOT = Path(__file__).resolve().parents[1] / "engine" / "src"

# Modules every layer reads; they import from no layer.
NEUTRAL_MODULES = frozenset(f"pagoda_engine.{name}" for name in (
    "config", "capabilities", "envs", "messages", "sampling_params", "errors",
    # what core/ and worker/ both name: the KV tiers' shared names, the step's plain batch description
    "kv_tiers", "executor_types", "tokenizer_files", "generation_config", "model_path", "profiler", "json_config",
    # the LoRA adapters' names and checks: the API process, the core and the ranks all use them
    "lora"))
# What `core/` may import from `worker/`: the executor's interface, nothing a worker runs; and the
# compile pool's early start, which the core process makes before torch is imported (the executor
# module imports torch).
CORE_MAY_IMPORT_FROM_WORKER = frozenset({"pagoda_engine.worker.executor", "pagoda_engine.worker.compile_ahead"})
# (module, name of a module-level table whose strings name modules the module imports by name).
STRING_TABLES = frozenset({("pagoda_engine.cli", "_VERBS")})


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    imported: str  # module name, within the package
    path: str  # the importer's file, relative to the source root
    line: int
    text: str  # the import as written, on one line
    where: str  # "", "in a function", "type-checking only" or "named in <string table>"

    def __str__(self) -> str:
        where = f"  ({self.where})" if self.where else ""
        return f"{self.path}:{self.line}: {self.text}{where}"


@dataclass(frozen=True)
class Rule:
    """Modules within `importers` import nothing within `forbidden`, except the `allowed` modules."""

    importers: tuple[str, ...]
    forbidden: tuple[str, ...]
    why: str
    allowed: frozenset[str] = frozenset()

    def breaks(self, imp: Import) -> bool:
        return (_within(imp.importer, self.importers) and _within(imp.imported, self.forbidden)
                and imp.imported not in self.allowed)


def _layer(name: str) -> str:
    return f"{PACKAGE}.{name}"


RULES = (
    Rule((_layer("worker"),), (_layer("core"), _layer("api")), "worker/ imports nothing from core/ or api/"),
    Rule((_layer("core"),), (_layer("worker"),), "core/ imports from worker/ only CORE_MAY_IMPORT_FROM_WORKER",
         allowed=CORE_MAY_IMPORT_FROM_WORKER),
    Rule((_layer("api"),), (_layer("worker"),), "api/ never imports worker/"),
    Rule((_layer("core"),), (_layer("api"),), "core/ never imports api/"),
    Rule(tuple(sorted(NEUTRAL_MODULES)),
         tuple(_layer(m) for m in ("api", "core", "worker", "router", "bench")),
         "a neutral module (NEUTRAL_MODULES) imports nothing from api/, core/, worker/, router/ or bench/"),
    Rule(tuple(_layer(m) for m in ("api", "core", "worker", "router")), ("pagoda_engine.serve",),
         "no layer imports the entry module (serve.py sits on top of them all)"),
)


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# --- the walker ---------------------------------------------------------------------------------
def module_files(root: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every module of `package` under `root` (`pkg/__init__.py` is `pkg`)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def package_imports(root: Path, package: str, string_tables=frozenset()) -> list[Import]:
    """Every import of a module of `package` by a module of `package`."""
    modules = module_files(root, package)
    imports = []
    for name, path in modules.items():
        source = path.read_text()
        visitor = _ImportVisitor(name, path.name == "__init__.py", set(modules), package, source,
                                 {table for module, table in string_tables if module == name})
        visitor.visit(ast.parse(source, str(path)))
        rel = path.relative_to(root).as_posix()
        imports += [Import(name, imported, rel, line, text, where) for imported, line, text, where in visitor.found]
    return imports


class _ImportVisitor(ast.NodeVisitor):
    """The imports of one module: `found` holds (imported module, line, text, where) in file order."""

    def __init__(self, module: str, is_package: bool, modules: set[str], package: str, source: str,
                 tables: set[str]):
        self.module, self.modules, self.package, self.source, self.tables = module, modules, package, source, tables
        # The package a relative import starts from: a package's `__init__` is its own.
        self.here = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, int, str, str]] = []
        self.function_depth = 0
        self.type_checking = 0

    # Where an import stands, which the report says.
    def _where(self) -> str:
        if self.type_checking:
            return "type-checking only"
        return "in a function" if self.function_depth else ""

    def _visit_function(self, node) -> None:
        self.function_depth += 1
        self.generic_visit(node)
        self.function_depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            self.type_checking += 1
            for child in node.body:
                self.visit(child)
            self.type_checking -= 1
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _add(self, name: str, node: ast.AST, where: str | None = None) -> None:
        """An edge to `name`, or to the deepest module of the package it lies in."""
        if not _within(name, (self.package,)):
            return
        while name not in self.modules and "." in name:
            name = name.rpartition(".")[0]
        text = " ".join((ast.get_source_segment(self.source, node) or "").split())
        self.found.append((name, node.lineno, text, self._where() if where is None else where))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _resolve(self.here, node.module, node.level) if node.level else node.module
        targets = (f"{base}.{alias.name}" for alias in node.names)
        for target in dict.fromkeys(t if t in self.modules else base for t in targets):  # `from m import a, b`: m once
            self._add(target, node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name == "import_module" and node.args and _is_str(node.args[0]):
            target = node.args[0].value
            package = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "package"), None)
            if target.startswith("."):
                level = len(target) - len(target.lstrip("."))
                if not _is_str(package):
                    raise AssertionError(f"{self.module}:{node.lineno}: a relative import_module without a literal "
                                         "package cannot be resolved; name the module in full")
                self._add(_resolve(package.value, target[level:], level), node)
            else:
                self._add(target, node)
        self.generic_visit(node)

    def _visit_assignment(self, node) -> None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        table = next((t.id for t in targets if isinstance(t, ast.Name) and t.id in self.tables), None)
        if table is not None and node.value is not None and not self.function_depth:
            for const in ast.walk(node.value):
                if _is_str(const) and const.value in self.modules:
                    self._add(const.value, const, where=f"named in {table}")
        self.generic_visit(node)

    visit_Assign = visit_AnnAssign = _visit_assignment


def _is_str(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _resolve(package: str, name: str | None, level: int) -> str:
    """The module a relative import names: `level` dots from `package` (one dot: `package` itself)."""
    base = package
    for _ in range(level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{name}" if name else base


# --- the checks ---------------------------------------------------------------------------------
def import_cycles(imports: list[Import]) -> list[tuple[list[str], list[Import]]]:
    """Each set of modules that import each other (a strongly connected component of two or more),
    sorted, with the imports inside it."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.imported != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.imported)
            graph.setdefault(imp.imported, set())
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) > 1:
            members = set(component)
            inside = [imp for imp in imports if imp.importer in members and imp.imported in members
                      and imp.importer != imp.imported]
            cycles.append((sorted(component), sorted(inside, key=lambda i: (i.path, i.line))))
    return sorted(cycles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (an import chain can be deeper than Python's recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(component)
    return components


def forbidden_imports(imports: list[Import], rules) -> list[tuple[Rule, Import]]:
    return [(rule, imp) for rule in rules for imp in imports if rule.breaks(imp)]


def shortest_cycle(inside: list[Import]) -> list[str]:
    """The shortest closed path through a cycle's imports: [a, b, ..., a]."""
    graph: dict[str, list[str]] = {}
    for imp in inside:
        graph.setdefault(imp.importer, []).append(imp.imported)
    best: list[str] = []
    for start in sorted(graph):
        paths = {start: [start]}
        frontier = [start]
        while frontier and not (best and len(paths[frontier[0]]) >= len(best)):
            node = frontier.pop(0)
            if start in graph[node]:
                if not best or len(paths[node]) + 1 < len(best):
                    best = paths[node] + [start]
                break
            for child in sorted(graph[node]):
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    frontier.append(child)
    return best


def _cycles_report(cycles) -> str:
    return "\n\n".join(f"{len(members)} modules import each other: {', '.join(members)}\n"
                       f"  the shortest circle: {' -> '.join(shortest_cycle(inside))}\n"
                       f"  the imports among them:\n" + "\n".join(f"    {imp}" for imp in inside)
                       for members, inside in cycles)


def _forbidden_report(broken) -> str:
    lines = []
    for rule in dict.fromkeys(rule for rule, _ in broken):
        lines.append(f"{rule.why}:")
        lines += [f"  {imp}" for r, imp in broken if r is rule]
    return "\n".join(lines)


# --- the engine ---------------------------------------------------------------------------------
def _engine_imports() -> list[Import]:
    imports = package_imports(SOURCE_ROOT, PACKAGE, STRING_TABLES)
    assert len(imports) > 100, "the walker found almost no imports in the engine: is SOURCE_ROOT right?"
    return imports


def test_engine_has_no_import_cycles():
    cycles = import_cycles(_engine_imports())
    if cycles:
        pytest.fail(f"import cycles (cut one import of each):\n\n{_cycles_report(cycles)}", pytrace=False)


def test_engine_imports_point_one_way():
    broken = forbidden_imports(_engine_imports(), RULES)
    if broken:
        pytest.fail(f"imports against the engine's layering:\n{_forbidden_report(broken)}", pytrace=False)


def test_the_rules_name_modules_that_exist():
    modules = module_files(SOURCE_ROOT, PACKAGE)
    named = {p for rule in RULES for p in rule.importers + rule.forbidden} | CORE_MAY_IMPORT_FROM_WORKER
    named |= {module for module, _ in STRING_TABLES}
    assert sorted(named - set(modules)) == []


# --- the walker on a package whose answers are known ---------------------------------------------
TOY = {
    # An __init__ importing its own submodule (not a cycle), and one taking a name back (a cycle).
    "__init__.py": "from toy import a\nfrom toy.c import helper\nVERSION = 1\n",
    "a.py": "from toy.b import thing\n",
    "b.py": "thing = 1\n\ndef later():\n    from . import a\n    return a\n",
    "c.py": "from toy import VERSION\n\ndef helper():\n    return VERSION\n",
    "low/__init__.py": "",
    "low/x.py": "import importlib\n\ndef load():\n    return importlib.import_module('toy.high.y')\n",
    "low/z.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from ..high import y\n",
    "high/__init__.py": "",
    "high/y.py": "from toy.low import x\n",
    "cli.py": "VERBS = {'run': ('toy.high.y', 'help')}\n",
}
TOY_RULES = (Rule(("toy.low",), ("toy.high",), "low/ imports nothing from high/"),)


def _toy_imports(tmp_path: Path) -> list[Import]:
    for rel, text in TOY.items():
        (tmp_path / "toy" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "toy" / rel).write_text(textwrap.dedent(text))
    return package_imports(tmp_path, "toy", {("toy.cli", "VERBS")})


def test_walker_reads_every_kind_of_import(tmp_path):
    edges = {(i.importer, i.imported, i.line, i.where) for i in _toy_imports(tmp_path)}
    assert edges == {
        ("toy", "toy.a", 1, ""), ("toy", "toy.c", 2, ""),
        ("toy.a", "toy.b", 1, ""),
        ("toy.b", "toy.a", 4, "in a function"),  # relative, in a function
        ("toy.c", "toy", 1, ""),  # a name from the package, not a submodule
        ("toy.low.x", "toy.high.y", 4, "in a function"),  # import_module with a literal
        ("toy.low.z", "toy.high.y", 4, "type-checking only"),  # relative, two levels
        ("toy.high.y", "toy.low.x", 1, ""),  # a submodule named in `from`
        ("toy.cli", "toy.high.y", 1, "named in VERBS"),  # a string table
    }


def test_checker_reports_a_known_cycle_and_a_known_forbidden_import(tmp_path):
    imports = _toy_imports(tmp_path)
    cycles = import_cycles(imports)
    assert [members for members, _ in cycles] == [["toy", "toy.c"], ["toy.a", "toy.b"], ["toy.high.y", "toy.low.x"]]
    report = _cycles_report(cycles)
    assert "toy/b.py:4: from . import a  (in a function)" in report
    assert "the shortest circle: toy.a -> toy.b -> toy.a" in report
    assert "toy/c.py:1: from toy import VERSION" in report
    broken = forbidden_imports(imports, TOY_RULES)
    assert [str(imp) for _, imp in broken] == [
        "toy/low/x.py:4: importlib.import_module('toy.high.y')  (in a function)",
        "toy/low/z.py:4: from ..high import y  (type-checking only)",
    ]
    assert _forbidden_report(broken).startswith("low/ imports nothing from high/:\n  toy/low/x.py:4:")
