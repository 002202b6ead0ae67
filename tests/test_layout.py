"""The layout of tests/: shared helpers come from `testing_utils` only, and `conftest.py` holds only pytest's hooks and
fixtures (read with `ast`, nothing imported)."""

import ast
from pathlib import Path


TESTS = Path(__file__).resolve().parent
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
