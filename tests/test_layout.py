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


def test_every_trl_fact_is_stated_checked_broken_on_purpose_and_listed_in_the_docs():
    """`trl_lopti.trl_contract.TRL_FACTS` is the one list of numbers: each fact is stated ("- S1. ...") in
    trl_lopti/trl_contract.py and nowhere else, has a section of tests/test_trl_contract.py, a mutation that breaks it
    (`testing_utils.TRL_MUTATIONS`, trained with in tests/test_fact_checks.py) and a row of docs/releases.md; and no
    other number appears in any of those places."""
    from testing_utils import TRL_MUTATIONS

    from trl_lopti.trl_contract import TRL_FACTS

    rows = re.findall(
        r"^\| ([SGR][1-9]) \| (?:both|GRPO|RLOO) \|", (ROOT / "docs/releases.md").read_text(), re.MULTILINE
    )
    assert rows == list(TRL_FACTS), "docs/releases.md lists the facts in TRL_FACTS's order"
    stated = {
        path.name: re.findall(r"^- ([SGR][1-9])\. ", path.read_text(), re.MULTILINE)
        for path in sorted((ROOT / "trl_lopti").rglob("*.py"))
    }
    assert stated.pop("trl_contract.py") == list(TRL_FACTS), "each fact is stated in trl_lopti/trl_contract.py, in order"
    assert not any(stated.values()), f"facts stated elsewhere too: {stated}"
    sections = re.findall(r"^# -+ (.+)$", (TESTS / "test_trl_contract.py").read_text(), re.MULTILINE)
    checked = {number for section in sections for number in FACT_RE.findall(section)}
    assert checked == set(TRL_FACTS), f"facts without a contract-test section: {set(TRL_FACTS) - checked}"
    broken = sorted({fact for fact, _ in TRL_MUTATIONS.values()})
    assert broken == sorted(TRL_FACTS), f"facts no mutation breaks: {set(TRL_FACTS) - set(broken)}"


def test_the_readme_is_a_landing_page_and_the_line_budgets_hold():
    """Issue budgets: the README at most 200 lines; the method core (trl_lopti's modules outside cli/, diagnostics/,
    tasks/ and cpu_backends/, less __init__, __main__, trl_contract, models and check) <= 1,150; trl_lopti/cli <= 1,000;
    trl_lopti/ <= 6,400; benchmarks/*.py <= 1,200."""

    def lines(paths):
        return sum(len(path.read_text().splitlines()) for path in paths)

    package = ROOT / "trl_lopti"
    core = [p for p in package.glob("*.py") if p.stem not in {"__init__", "__main__", "trl_contract", "models", "check"}]
    assert {p.stem for p in core} >= {"config", "core_algos", "lopti_mixin", "grpo_trainer", "rloo_trainer"}
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert lines(core) <= 1150
    assert lines((package / "cli").rglob("*.py")) <= 1000
    assert lines(package.rglob("*.py")) <= 6400
    assert lines((ROOT / "benchmarks").glob("*.py")) <= 1200
