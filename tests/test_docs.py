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
