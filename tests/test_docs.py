"""The documents under docs/ cannot drift from the code they describe: docs/serving.md names every
flag of `pagoda serve` and no flag it does not have, and docs/operator.md's field reference is the
one `pagoda-operator docs` renders from the InferenceService schema."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

from pagoda_engine.cli import build_parser
from pagoda_operator import docs as operator_docs

ROOT = Path(__file__).resolve().parents[1]
SERVING = ROOT / "docs" / "serving.md"
OPERATOR = ROOT / "docs" / "operator.md"


def _verb(name: str) -> argparse.ArgumentParser:
    [subparsers] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return subparsers.choices[name]


def _all_flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands."""
    flags = set()
    for action in parser._actions:
        flags |= set(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _all_flags(sub)
    return flags


def _serve_flags() -> set[str]:
    return _all_flags(_verb("serve")) - {"-h", "--help"}


def _flag_table_rows(text: str) -> list[list[str]]:
    """The cells of every table row in docs/serving.md whose first cell names flags."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| `-"):
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return rows


def _flags_in(text: str) -> set[str]:
    return set(re.findall(r"(?<![^\s`(,\[])(--?[a-z][a-z0-9]*(?:-[a-z0-9]+)*)", text))


def test_serving_md_lists_every_serve_flag_in_its_tables():
    documented = {flag for row in _flag_table_rows(SERVING.read_text()) for flag in _flags_in(row[0])}
    missing = sorted(_serve_flags() - documented)
    assert not missing, f"flags of `pagoda serve` missing from the tables of docs/serving.md: {missing}"


def test_serving_md_defaults_are_the_parsers():
    """Where the default cell is a plain value (not prose such as "measured" or "on with CUDA"
    for a default the engine decides), it is the parser's default."""
    actions = {flag: action for action in _verb("serve")._actions for flag in action.option_strings}
    checked = 0
    for row in _flag_table_rows(SERVING.read_text()):
        action = actions[sorted(_flags_in(row[0]))[0]]
        word = re.match(r"`?([\w.]+)`?(?:\s|$)", row[1])
        if action.default is None or word is None:
            continue
        if isinstance(action.default, bool):
            assert word[1] == ("on" if action.default else "off"), (row[0], row[1], action.default)
        elif isinstance(action.default, (int, float)):
            assert float(word[1]) == action.default, (row[0], row[1], action.default)
        else:
            assert word[1] == action.default, (row[0], row[1], action.default)
        checked += 1
    assert checked >= 25


def test_serving_md_names_no_flag_pagoda_serve_lacks():
    """Flags anywhere in the text: `pagoda serve`'s, or those of the router and bench commands it
    shows, or vLLM's in the last column."""
    text = SERVING.read_text()
    rows = _flag_table_rows(text)
    vllm_column = {flag for row in rows for flag in _flags_in(row[-1])}
    prose = "\n".join(line for line in text.splitlines() if not line.startswith("| `-"))
    named = {flag for row in rows for flag in _flags_in(" ".join(row[:-1]))} | _flags_in(prose)
    other_commands = _all_flags(_verb("route")) | _all_flags(_verb("epp")) | _all_flags(_verb("bench"))
    unknown = sorted(named - _serve_flags() - other_commands - vllm_column)
    assert not unknown, f"docs/serving.md names flags `pagoda serve` does not have: {unknown}"
    assert len(rows) >= 50 and all(len(row) == 4 for row in rows), "every flag row: flag | default | what | vLLM"


def test_operator_md_reference_is_the_generated_one():
    assert operator_docs.is_current(OPERATOR), "docs/operator.md is stale: run `pagoda-operator docs docs/operator.md`"


def test_operator_md_reference_covers_every_spec_field():
    text = OPERATOR.read_text()
    for path, field in (("spec.kvCache.tiers[]", "secretRef"), ("spec.engine", "extraArgs"),
                        ("spec.resources", "gpuMemoryGiB"), ("status", "conditions")):
        section = text[text.index(f"### `{path}`"):]
        section = section[:section.index("\n### ", 1)] if "\n### " in section[1:] else section
        assert f"| `{field}` |" in section, (path, field)


def test_operator_docs_check_fails_on_a_stale_file_and_write_repairs_it(tmp_path):
    stale = tmp_path / "operator.md"
    stale.write_text(f"# prose kept\n\n{operator_docs.BEGIN}\n| old | table |\n{operator_docs.END}\n\nmore prose\n")
    cli = [sys.executable, "-m", "pagoda_operator.cli", "docs"]
    check = subprocess.run([*cli, "--check", str(stale)], capture_output=True, text=True)
    assert check.returncode == 1 and "stale" in check.stderr
    assert subprocess.run([*cli, str(stale)], capture_output=True).returncode == 0
    text = stale.read_text()
    assert text.startswith("# prose kept\n") and text.endswith("\nmore prose\n") and "| old |" not in text
    assert "| `maxReplicas` | integer | **required** | ≥ 1 |" in text
    assert subprocess.run([*cli, "--check", str(stale)]).returncode == 0


def test_operator_docs_refuses_a_file_without_markers(tmp_path):
    plain = tmp_path / "plain.md"
    plain.write_text("# no markers\n")
    out = subprocess.run([sys.executable, "-m", "pagoda_operator.cli", "docs", str(plain)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "no generated section" in out.stderr
    assert plain.read_text() == "# no markers\n"


def test_benchmarks_md_defines_the_workloads_bench_runs():
    """docs/benchmarks.md's workload table gives T1, N1 and L1 as `pagoda bench` builds them."""
    from pagoda_engine.bench.workloads import build_workload

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert text.index("## Current figures") < text.index("## Workloads") < text.index("## History")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| T1 |")
            or line.startswith("| N1 |") or line.startswith("| L1 |")}
    t1, l1, n1 = (build_workload(name, 32000) for name in ("T1", "L1", "N1"))
    assert f"{t1.num_requests:,} requests × {len(t1.prompts[0]):,} in × {t1.output_lens[0]} out" in rows["T1"]
    assert f"one request, {len(l1.prompts[0])} in, {l1.output_lens[0]} out" in rows["L1"]
    lengths = [len(p) for p in n1.prompts] + n1.output_lens
    assert f"{n1.num_requests} requests" in rows["N1"] and min(lengths) >= 100 and max(lengths) <= 1024
    assert "uniform in [100, 1,024]" in rows["N1"]


def test_documents_label_history_by_date_not_session_number():
    ordinal = re.compile(r"\b(\w+(st|nd|rd|th)|first|second|third|fifth|eighth|ninth|twelfth)[ -]session", re.I)
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found = ordinal.search(path.read_text())
        assert found is None, f"{path.name}: {found[0]!r}: label it by date or commit"


def test_serving_md_lists_every_pagoda_environment_variable_the_code_reads():
    """Every `PAGODA_*` name the engine and operator spell out is in docs/serving.md, and the
    document names no other."""
    in_code = set()
    for source in [*(ROOT / "engine" / "src").rglob("*.py"), *(ROOT / "operator" / "src").rglob("*.py")]:
        in_code |= set(re.findall(r"""["'](PAGODA_[A-Z0-9_]+)["']""", source.read_text()))
    in_doc = set(re.findall(r"\bPAGODA_[A-Z0-9_]+\b", SERVING.read_text()))
    assert in_code - in_doc == set(), f"PAGODA_* variables missing from docs/serving.md: {sorted(in_code - in_doc)}"
    assert in_doc - in_code == set(), f"docs/serving.md names variables no code reads: {sorted(in_doc - in_code)}"


# --- docs/architecture.md names only what exists ---------------------------------------------------
ARCHITECTURE = ROOT / "docs" / "architecture.md"
ENGINE_SRC = ROOT / "engine" / "src"
PACKAGE_ROOTS = {"pagoda_engine": ENGINE_SRC / "pagoda_engine",
                 "pagoda_operator": ROOT / "operator" / "src" / "pagoda_operator"}


class _Names:
    """What a package's modules define, read with `ast` (nothing is imported): each module's
    top-level names and each class's attributes (its body's defs and assignments, and the
    `self.x = ...` of its methods)."""

    def __init__(self, package: str):
        import ast

        self.modules: dict[str, set[str]] = {}  # module (dotted, below the package) -> top-level names
        self.classes: dict[str, set[str]] = {}  # class name -> attributes, over every class of that name
        root = PACKAGE_ROOTS[package]
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            tree = ast.parse(path.read_text())
            top = set()
            for node in tree.body:
                top |= self._defined(node)
                if isinstance(node, ast.ClassDef):
                    attrs = set()
                    for inner in ast.walk(node):
                        attrs |= self._defined(inner)
                        if (isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store)
                                and isinstance(inner.value, ast.Name) and inner.value.id == "self"):
                            attrs.add(inner.attr)
                    self.classes.setdefault(node.name, set()).update(attrs)
            self.modules[name] = top
        for name in list(self.modules):  # a package's submodules are its names too
            parent, _, leaf = name.rpartition(".")
            if name and parent in self.modules:
                self.modules[parent].add(leaf)
            elif name and "." not in name:
                self.modules.setdefault("", set()).add(name)

    @staticmethod
    def _defined(node) -> set[str]:
        import ast

        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return {node.name}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return {(a.asname or a.name).split(".")[0] for a in node.names}
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}

    def is_module(self, dotted: str) -> bool:
        return dotted in self.modules

    def problem(self, dotted: str) -> str | None:
        """Why `dotted` (`module.name`, `package.module`, `module.Class.attr` or `Class.attr`)
        names nothing, or None when it names something."""
        parts = dotted.split(".")
        cut = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in self.modules), default=0)
        if cut:
            module, rest = ".".join(parts[:cut]), parts[cut:]
            if not rest:
                return None
            if rest[0] not in self.modules[module]:
                return f"{module} defines no {rest[0]}"
            owner, rest = rest[0], rest[1:]
        elif parts[0] in self.classes:
            owner, rest = parts[0], parts[1:]
        else:
            return f"no module or class {parts[0]}"
        if rest and (owner not in self.classes or rest[0] not in self.classes[owner]):
            return f"{owner} has no attribute {rest[0]}"
        return None


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _engine_file_paths() -> list[str]:
    """Every file of the repository's code, relative to the repository and to its package."""
    paths = []
    for package, root in PACKAGE_ROOTS.items():
        for path in root.rglob("*.py"):
            paths += [path.relative_to(ROOT).as_posix(), path.relative_to(root).as_posix()]
    paths += [p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("*.py")]
    return paths


def test_architecture_md_names_only_files_that_exist():
    """Every `path/like.py` in docs/architecture.md is a file of the engine, the operator or the
    tests: spelled from the repository's root, from its package's root, or as the tail of one
    (`server/app.py` for `api/server/app.py`)."""
    paths = _engine_file_paths()
    named = set(re.findall(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b", ARCHITECTURE.read_text()))
    missing = sorted(p for p in named if not any(f == p or f.endswith("/" + p) for f in paths))
    assert len(named) > 30, "docs/architecture.md names almost no files: is the pattern right?"
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_architecture_md_names_only_modules_and_names_that_exist():
    """Every backticked dotted name in docs/architecture.md that starts with an engine module
    (`core.warm_up`, `config.resolve_for_device`, `pagoda_engine.serve`), the operator's package,
    or an engine class (`EngineCore.step`) names a module, function, class or attribute that
    exists."""
    engine, operator = _Names("pagoda_engine"), _Names("pagoda_operator")
    checked, problems = 0, []
    for token in _backticked(ARCHITECTURE.read_text()):
        token = re.sub(r"\(.*\)$", "", token)  # `config.option(...)`: the name called
        if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", token) or token.endswith(".py"):
            continue  # not dotted, or a file (the test above checks those)
        names, dotted = engine, token
        for package, table in (("pagoda_engine", engine), ("pagoda_operator", operator)):
            if token.startswith(package + "."):
                names, dotted = table, token[len(package) + 1:]
        first = dotted.split(".")[0]
        if not (first in names.modules.get("", set()) or first in names.classes or names is operator):
            continue  # not an engine name: a spec field (`spec.replicas`), a file (`app.py`), ...
        checked += 1
        problem = names.problem(dotted)
        if problem:
            problems.append(f"`{token}`: {problem}")
    assert checked > 20, "docs/architecture.md names almost no engine modules: is the pattern right?"
    assert not problems, "docs/architecture.md names what does not exist:\n" + "\n".join(problems)


def test_the_name_checker_tells_a_real_name_from_a_stale_one():
    engine = _Names("pagoda_engine")
    for real in ("core.warm_up", "config.resolve_for_device", "worker.executor.Executor.determine_num_kv_pages",
                 "EngineCore.step", "EngineCore.scheduler", "api.server.api_server.serve_one_process", "kv_tiers"):
        assert engine.problem(real) is None, real
    for stale in ("worker.runner", "EngineCore._warm_up_turn", "capabilities.FLAG_BOUNDS", "ModelRunner.execute",
                  "serve.no_such_function"):
        assert engine.problem(stale) is not None, stale


def test_documents_have_no_unchecked_markers():
    """A draft's `<!-- CHECK ... -->` marks a claim nobody has checked against the code yet."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "<!-- CHECK" not in path.read_text(), f"{path.name}: check the marked claim, then drop the marker"


def test_operator_md_names_every_writable_dir_and_the_pods_user():
    """The secure-defaults prose outside the generated table says what the renderer does: every
    place a container may write (`render.WRITABLE_DIRS`) is a row of its table, and the uid/gid
    are the rendered ones."""
    from pagoda_operator import render

    text = OPERATOR.read_text()
    section = text[text.index("### Pods: the \"restricted\" Pod Security Standard"):text.index("### NetworkPolicies")]
    rows = {line.split("|")[1].strip().strip("`") for line in section.splitlines() if line.startswith("| `/")}
    assert rows == set(render.WRITABLE_DIRS)
    assert f"uid {render.RUN_AS_UID} and gid {render.RUN_AS_GID}" in section
    for key, value in render.CONTAINER_SECURITY_CONTEXT.items():
        assert f"`{key}: " in section or key == "capabilities", key
    assert "`capabilities: {drop: [ALL]}`" in section and "`seccompProfile: RuntimeDefault`" in section


def test_architecture_md_names_every_engine_module():
    """A module added to the engine gets its line in the design of record (by its path below the
    package, or by the tail of it that the per-folder tables use)."""
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b", text))
    root = PACKAGE_ROOTS["pagoda_engine"]

    def is_named(rel: str) -> bool:  # a bare file name counts at the top of the package only (`app.py` is two)
        return any(rel == n or ("/" in n and rel.endswith("/" + n)) for n in named)

    modules = (p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    unnamed = sorted(rel for rel in modules if not rel.endswith("__init__.py") and not is_named(rel))
    assert not unnamed, f"engine modules docs/architecture.md does not name: {unnamed}"
