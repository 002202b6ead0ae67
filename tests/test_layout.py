"""The layout of tests/: shared helpers come from `testing_utils` only, and `conftest.py` holds only pytest's hooks and
fixtures (read with `ast`, nothing imported); the TRL facts listed once; the README a landing page; the package
written at TRL's density."""

import ast
import importlib
import inspect
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


def test_every_trl_fact_is_checked_where_it_says_broken_on_purpose_and_listed_in_the_docs():
    """`trl_lopti.trl_contract.TRL_FACTS` is the one list of facts: each is checked where its `checked_by` says, has a
    section of tests/test_trl_contract.py, a mutation that breaks it (`testing_utils.TRL_MUTATIONS`, trained with in
    tests/test_fact_checks.py) and a row of docs/releases.md; and no other code appears in any of those places."""
    from testing_utils import TRL_MUTATIONS

    from trl_lopti import trl_contract
    from trl_lopti.trl_contract import TRL_FACTS

    codes = [fact.code for fact in TRL_FACTS]
    assert len(set(codes)) == len(codes) and all(fact.prevents and fact.statement for fact in TRL_FACTS)
    rows = re.findall(
        r"^\| ([SGR][1-9]) \| (?:both|GRPO|RLOO) \|", (ROOT / "docs/releases.md").read_text(), re.MULTILINE
    )
    assert rows == codes, "docs/releases.md lists the facts in TRL_FACTS's order"
    constants = {
        fact.code: name for name, fact in vars(trl_contract).items() if isinstance(fact, trl_contract.TRLFact)
    }

    def called_functions(source: str) -> set[str]:
        """The names of the functions and methods that `source` calls, read with `ast` (a definition, comment or
        string is no call), each but inside its own body (a recursive call is no use)."""
        tree = ast.parse(source)
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
        names = {id(call): ast.unparse(call.func).rpartition(".")[2] for call in calls}
        functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
        recursive = set()
        for function in functions:
            recursive |= {id(node) for node in ast.walk(function) if names.get(id(node)) == function.name}
        return {names[id(call)] for call in calls if id(call) not in recursive}

    # What the rule tells apart: a definition, a comment, a string and a recursive call from a call.
    example = "def check():\n    check()\n# check() here\nsaid = 'check()'\nclass T:\n    def run(self):\n"
    assert called_functions(example + "        pass\n") == set()
    assert called_functions(example + "        self.check()\n") == {"check"}
    called = called_functions(inspect.getsource(importlib.import_module("trl_lopti.lopti_mixin")))
    for fact in TRL_FACTS:
        # Each place it names exists, and one of them raises it, or is it.
        found = []
        for place in re.findall(r"`([\w.]+)`", fact.checked_by):
            module, *names = place.split(".")
            value = importlib.import_module(f"trl_lopti.{module}")
            for name in names:
                value = getattr(value, name)
            found.append(value is fact or (callable(value) and constants[fact.code] in inspect.getsource(value)))
            # A check function is called, not only defined.
            if inspect.isfunction(value) and module == "lopti_mixin" and len(names) == 1:
                assert name in called, f"{place} is never called"
        assert any(found), f"{fact.code} is not checked where it says: {fact.checked_by}"
    sections = re.findall(r"^# -+ (.+)$", (TESTS / "test_trl_contract.py").read_text(), re.MULTILINE)
    checked = {code for section in sections for code in FACT_RE.findall(section)}
    assert checked == set(codes), f"facts without a contract-test section: {set(codes) - checked}"
    broken = sorted({code for code, _ in TRL_MUTATIONS.values()})
    assert broken == sorted(codes), f"facts no mutation breaks: {set(codes) - set(broken)}"


def test_the_readme_is_a_landing_page():
    """The README is the landing page: at most 200 lines (the rest is in docs/)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_the_package_is_written_at_trls_density():
    """No `# fmt: skip`, no assignment of three or more names from a tuple, no `**dict(...)` spread, and lines of 110
    columns or wider no commoner than in TRL 1.16's GRPO, RLOO and GMPO trainers (11.7%): the figures of
    ../shared/tools/density.py, computed here."""
    lines = 0
    long_lines = 0
    for path in sorted((ROOT / "trl_lopti").rglob("*.py")):
        text = path.read_text()
        rows = text.splitlines()
        lines += len(rows)
        long_lines += sum(len(row) >= 110 for row in rows)
        assert "fmt: skip" not in text and "**dict(" not in text, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple):
                packed = len(node.targets[0].elts) >= 3 and isinstance(node.value, ast.Tuple)
                assert not packed, f"{path}:{node.lineno}: one assignment per statement"
    assert long_lines / lines <= 0.117, f"{long_lines} of {lines} lines are 110 columns or wider"
