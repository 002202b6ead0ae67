"""The layout of tests/: shared helpers come from `testing_utils` only, and `conftest.py` holds only pytest's hooks and
fixtures (read with `ast`, nothing imported); the TRL facts numbered once; the line budgets."""

import ast
import re
from pathlib import Path


TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# the modules of tests/ that others may import: the shared helpers, and the independent GRPO and RLOO losses (oracles)
SHARED = {"testing_utils", "reference_grpo", "reference_rloo"}


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level module name) of every import in the file, in functions too; "." for a relative import."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." if node.level else node.module.split(".")[0]))
    return sorted(found)


def test_no_file_under_tests_imports_conftest_a_test_module_or_a_script():
    files = sorted(TESTS.rglob("*.py"))
    local = {path.stem for path in files}
    assert {"conftest", "testing_utils", "test_layout", "ddp_quantile_script", "launcher_probe"} <= local
    forbidden = local - SHARED  # conftest, every test_* module and every script run in another process
    imports = [
        f"{path.relative_to(TESTS)}:{line} imports {module}"
        for path in files
        for line, module in imported_modules(ast.parse(path.read_text(), filename=str(path)))
        if module in forbidden or module == "."
    ]
    assert imports == [], "import shared helpers from tests/testing_utils.py:\n" + "\n".join(imports)


def test_the_import_check_sees_every_kind_of_import():
    source = "import conftest\nfrom test_schedule import x\ndef f():\n    from ddp_quantile_script import y\nfrom . import z\n"
    assert imported_modules(ast.parse(source)) == [
        (1, "conftest"),
        (2, "test_schedule"),
        (4, "ddp_quantile_script"),
        (5, "."),
    ]


def is_fixture(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) == "pytest.fixture"


def test_conftest_holds_only_hooks_options_environment_and_fixtures():
    tree = ast.parse((TESTS / "conftest.py").read_text())
    misplaced = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            if not (node.name.startswith("pytest_") or any(is_fixture(d) for d in node.decorator_list)):
                misplaced.append(f"function {node.name}")
        elif isinstance(node, ast.ClassDef | ast.AsyncFunctionDef | ast.Assign | ast.AnnAssign):
            misplaced.append(f"{type(node).__name__} at line {node.lineno}")
    assert misplaced == [], f"move these to tests/testing_utils.py: {misplaced}"


# --------------------------------------------------------------------------------------- the TRL facts, numbered once
FACT_RE = re.compile(r"\b([SGR][1-9])\b")


def test_every_trl_fact_is_stated_in_its_module_checked_in_the_contract_tests_and_listed_in_the_docs():
    """`trl_lopti._compat.TRL_FACTS` is the one list of numbers: each fact is stated ("- S1. ...") in the module the
    docs table names, has a section of tests/test_trl_contract.py, and a row of docs/releases.md; and no other number
    appears in any of those places."""
    from trl_lopti._compat import TRL_FACTS

    rows = re.findall(
        r"^\| ([SGR][1-9]) \| [^|]+ \| [^|]+ \| `([a-z_]+\.py)` \|$",
        (ROOT / "docs/releases.md").read_text(),
        re.MULTILINE,
    )
    assert [number for number, _ in rows] == list(TRL_FACTS), "docs/releases.md lists the facts in TRL_FACTS's order"
    for number, module in rows:
        stated = re.findall(r"^- ([SGR][1-9])\. ", (ROOT / "trl_lopti" / module).read_text(), re.MULTILINE)
        assert number in stated, f"fact {number} is not stated in trl_lopti/{module}"
    stated_anywhere = [
        number
        for path in sorted((ROOT / "trl_lopti").glob("*.py"))
        for number in re.findall(r"^- ([SGR][1-9])\. ", path.read_text(), re.MULTILINE)
    ]
    assert sorted(stated_anywhere) == sorted(TRL_FACTS), "each fact is stated once, in one module"
    sections = re.findall(r"^# -+ (.+)$", (TESTS / "test_trl_contract.py").read_text(), re.MULTILINE)
    checked = {number for section in sections for number in FACT_RE.findall(section)}
    assert checked == set(TRL_FACTS), f"facts without a contract-test section: {set(TRL_FACTS) - checked}"


def test_the_readme_is_a_landing_page_and_the_line_budgets_hold():
    """Issue budgets: the README at most 200 lines; the method core (trl_lopti's modules outside cli/, diagnostics/,
    tasks/ and cpu_backends/, less __init__, __main__, _compat and models) <= 1,100; trl_lopti/cli <= 1,000;
    trl_lopti/ <= 6,400; benchmarks/*.py <= 1,200."""

    def lines(paths):
        return sum(len(path.read_text().splitlines()) for path in paths)

    package = ROOT / "trl_lopti"
    core = [p for p in package.glob("*.py") if p.stem not in {"__init__", "__main__", "_compat", "models"}]
    assert {p.stem for p in core} >= {"config", "core_algos", "lopti_mixin", "trainer", "rloo_trainer"}
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert lines(core) <= 1100
    assert lines((package / "cli").rglob("*.py")) <= 1000
    assert lines(package.rglob("*.py")) <= 6400
    assert lines((ROOT / "benchmarks").glob("*.py")) <= 1200
