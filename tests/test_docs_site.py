"""The documentation site as a user reads it: the API tables show types as the source writes them (`.ci/check_site.py`,
which `.ci/run` runs on the site it builds), and no name or default breaks inside a word.

The checks of the built site need MkDocs (the `docs` extra), which the README's test command does not install: there
they skip, and `.ci/run`'s docs stage runs `.ci/check_site.py` on its own build. Everything else here runs anywhere.
"""

import importlib.util
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
CHECK_SITE = runpy.run_path(str(ROOT / ".ci" / "check_site.py"))


def extension(name: str):
    """A module of docs/_ext/, imported from its file."""
    spec = importlib.util.spec_from_file_location(f"docs_ext_{name}", ROOT / "docs" / "_ext" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def api_table(rows: list[tuple[str, str]]) -> str:
    """A parameters table as mkdocstrings writes it (with the hooks' `<wbr>` and labels), for the names and types."""
    body = "".join(
        f'<tr class="doc-section-item"><td data-label="Name"><code>{name}</code></td><td data-label="Type">'
        f'<code><span title="x">{type_}</span></code></td><td><div class="doc-md-description"><p>text, with a comma'
        "</p></div></td><td><code>None</code></td></tr>"
        for name, type_ in rows
    )
    return (
        "<p>Parameters:</p><table><thead><tr><th>Name</th><th>Type</th><th>Description</th><th>Default</th></tr>"
        f"</thead><tbody>{body}</tbody></table>"
    )


# ------------------------------------------------------------------------------------------------- .ci/check_site.py
@pytest.mark.parametrize(
    ("cell", "problem"),
    [
        ("dict[str, Any]", None),
        ("Callable[[str, float], None]", None),
        ("Sequence[str] | Sequence[list[dict]]", None),
        ("float | None", None),
        ("list[torch.Tensor", "unbalanced brackets"),
        ("Callable[[str | float | None", "unbalanced brackets"),
        ("`torch.Tensor` or `None`", "a raw backtick"),
        ("pi_old (B, T), or None where TRL computed none", "not a Python expression"),
    ],
)
def test_a_type_cell_must_be_a_python_annotation(cell, problem):
    assert CHECK_SITE["type_problem"](cell) == problem


def test_the_package_writes_types_with_commas_and_the_check_finds_them():
    parameters, returns = CHECK_SITE["written_types"]()
    assert "Callable[[str, float], None]" in parameters["log_metric"]
    assert "dict[str, Any]" in returns
    assert all(CHECK_SITE["has_comma_in_brackets"](written) for found in parameters.values() for written in found)


def test_a_page_that_drops_a_comma_or_a_bracket_fails_and_one_as_written_passes():
    check_page = CHECK_SITE["check_page"]
    parameters = {"log_metric": {"Callable[[str, float], None]"}, "data_files": {"str | Sequence[str]"}}
    returns = {"dict[str, Any]"}
    good = api_table([("log_<wbr>metric", "Callable[[str, float], None]"), ("data_files", "str | Sequence[str]")])
    problems, checked, shown = check_page(good, parameters, returns)
    assert problems == [] and checked == 2 and shown == {"Callable[[str, float], None]", "str | Sequence[str]"}

    commas_lost = api_table([("log_metric", "Callable[[str | float] | None]")])
    (problem,) = check_page(commas_lost, parameters, returns)[0]
    assert "log_metric" in problem and "Callable[[str, float], None]" in problem

    brackets_lost = api_table([("log_metric", "Callable[[str | float | None")])
    assert check_page(brackets_lost, parameters, returns)[0] == [
        "type 'Callable[[str | float | None': unbalanced brackets"
    ]
    returns_table = (
        "<table><thead><tr><th>Type</th><th>Description</th></tr></thead><tbody>"
        '<tr class="doc-section-item"><td><code>dict[str | Any]</code></td><td>the results</td></tr></tbody></table>'
    )
    (problem,) = check_page(returns_table, parameters, returns)[0]
    assert "dict[str | Any]" in problem


def test_check_site_fails_on_a_folder_without_a_site(tmp_path, capsys):
    assert CHECK_SITE["main"]([str(tmp_path)]) == 1
    assert "no type cell found" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- docs/_ext/ and the CSS
def test_types_are_rendered_as_the_source_writes_them():
    pytest.importorskip("griffe", reason="the docs extra (mkdocstrings) brings griffe")
    docstrings = extension("trl_docstrings")
    python_type = docstrings.python_type
    assert python_type("`dict[str, Any]`") == "dict[str, Any]"
    assert python_type("`Callable[[str, float], None]`") == "Callable[[str, float], None]"
    assert python_type("`list[torch.Tensor]` or `None`") == "list[torch.Tensor] | None"
    assert python_type("`str` or [`~trl_lopti.tasks.MathDatasetSpec`]") == "str | trl_lopti.tasks.MathDatasetSpec"
    assert python_type("`GRPOConfig`, `RLOOConfig` or `None`") == "GRPOConfig | RLOOConfig | None"
    assert python_type("dict[str, Any] or None") == "dict[str, Any] | None"
    returns = ["    `torch.Tensor` or `None`: pi_old (B, T), or `None` where", "    TRL computed none."]
    assert docstrings.rewrite_returns(returns) == [
        "    torch.Tensor | None: pi_old (B, T), or `None` where TRL computed none."
    ]


def test_code_in_tables_breaks_only_after_an_underscore_a_slash_or_a_dot_before_a_letter():
    pytest.importorskip("mkdocs", reason="the docs extra")
    hooks = extension("hooks")
    table = (
        "<table><thead><tr><th>Name</th><th>Type</th><th>Description</th><th>Default</th></tr></thead><tbody>"
        '<tr class="doc-section-item"><td><code>lopti_order</code></td><td><code><span title="str">str</span></code>'
        "</td><td><p>see <code>trl_lopti.core_algos</code></p></td><td><code>0.5</code></td></tr></tbody></table>"
    )
    html = hooks.readable_table(table)
    assert "<code>lopti_<wbr>order</code>" in html and "<code>trl_<wbr>lopti.<wbr>core_<wbr>algos</code>" in html
    assert '<span title="str">str</span>' in html and "<code>0.5</code>" in html  # tags and numbers left whole
    labels = re.findall(r'<td data-label="(\w+)">', html)
    assert labels == ["Name", "Type", "Description", "Default"]
    page_table = "<table><tr><td><code>a_b</code></td></tr></table>"  # a page's own table: breaks, no labels
    assert hooks.readable_table(page_table) == "<table><tr><td><code>a_<wbr>b</code></td></tr></table>"


def test_the_stylesheet_breaks_no_code_inside_a_word():
    """`overflow-wrap: anywhere` broke names and defaults mid-word ("advantage_r / eweighting_"): no rule for a table
    may do so."""
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    rules = re.findall(r"([^{}]+)\{([^{}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.DOTALL))
    assert rules
    for selector, body in rules:
        if "table" in selector:
            assert not re.search(r"overflow-wrap:\s*anywhere|word-break:\s*break-all", body), selector.strip()
    assert re.search(r"table:not\(\[class\]\) code\s*\{[^}]*overflow-wrap:\s*normal", css)


def test_no_rule_lets_a_code_block_wrap():
    """A code block that wraps splits identifiers (`LoptiGRPOTra|iner`) and restarts Python's continuation lines at
    column 0 on a phone: every line stays as written, and a long one scrolls sideways in its box."""
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    rules = re.findall(r"([^{}]+)\{([^{}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.DOTALL))
    code_blocks = [body for selector, body in rules if re.search(r"\bpre\b", selector)]
    assert code_blocks
    for body in code_blocks:
        assert not re.search(r"white-space:\s*pre-(wrap|line)|overflow-wrap:\s*anywhere|word-break:\s*break-all", body)
    assert any(re.search(r"white-space:\s*pre;", body) and "overflow-x: auto" in body for body in code_blocks)


def test_a_table_wider_than_the_screen_shows_that_it_scrolls():
    """On a phone a wide table scrolls in Material's wrapper, whose scrollbar shows only while it scrolls: an edge shadow
    that stays put (`scroll`) on each side, covered by a cover that moves with the table (`local`) where that side is at
    its end, and a table that lets both show through (looked at in headless Chromium at 390 and 1400 px)."""
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    rules = {
        selector.strip(): body
        for selector, body in re.findall(r"([^{}]+)\{([^{}]*)\}", re.sub(r"/\*.*?\*/", "", css, flags=re.DOTALL))
    }
    wrapper = rules[".md-typeset .md-typeset__scrollwrap"]
    layers = re.findall(
        r"(linear|radial)-gradient\(.*?\)\s+(left|right)\s*/[^,;]*?\b(local|scroll)\b", wrapper, re.DOTALL
    )
    assert sorted(layers) == [
        ("linear", "left", "local"),
        ("linear", "right", "local"),
        ("radial", "left", "scroll"),
        ("radial", "right", "scroll"),
    ]
    assert "background-color: transparent" in rules[".md-typeset .md-typeset__scrollwrap table:not([class])"]


def test_the_home_page_leads_to_pip_install_and_the_quickstart_and_keeps_the_clone_commands_for_contributors():
    """The README's first lines are the commands of a clone (CI runs them as written); the site's home page opens
    with `pip install` and the Quickstart instead, and gives the clone's commands in the install section."""
    hooks = extension("hooks")
    readme = (ROOT / "README.md").read_text()
    clone_commands = re.search(r"^```bash\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)[1]
    assert clone_commands.startswith("make demo")
    home = hooks.home_page(readme)
    first_block = re.search(r"^```bash\n(.*?)^```", home, re.MULTILINE | re.DOTALL)[1]
    assert first_block == "pip install trl_lopti\n"
    assert home.index("[Quickstart](quickstart.md)") < home.index("## Install it in your own environment")
    assert home.count(clone_commands) == 1
    assert home.index("## Install it in your own environment") < home.index(clone_commands) < home.index("| extra |")


def test_the_quickstarts_runnable_example_comes_before_any_table():
    """The Quickstart's script is on its first screen at 1400 x 900: only the install lines come before it, the
    extras table at the end of the page."""
    quickstart = (ROOT / "docs" / "quickstart.md").read_text()
    before_script = quickstart.split("```python\n", 1)[0]
    assert "--8<--" not in before_script and "\n|" not in before_script
    assert len(before_script.splitlines()) < 25
    assert quickstart.rstrip().endswith('--8<-- "README.md:extras"')


def test_every_python_snippet_of_the_docs_defines_or_imports_every_name_it_uses():
    """A snippet a user copies runs as written: no `my_reward`, `dataset` or `config` left for the reader to guess."""
    import ast
    import builtins

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    undefined = {}
    for page in pages:
        text = page.read_text()
        for block in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
            tree = ast.parse(block[1])
            defined = set(dir(builtins))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
                elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                    defined.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    defined.add(node.id)
                elif isinstance(node, ast.arg):
                    defined.add(node.arg)
            used = {
                node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
            }
            if used - defined:
                line = text[: block.start()].count("\n") + 1
                undefined[f"{page.relative_to(ROOT)}:{line}"] = sorted(used - defined)
    assert len(pages) > 10 and undefined == {}


def test_no_docstring_names_a_page_by_its_path_instead_of_linking_it():
    """The API pages render docstrings: a page named as `(docs/trainers/own.md)` reads as a literal path there; a
    docstring links a page by its heading (`[Your own trainer][your-own-trainer]`), which `mkdocs build --strict`
    resolves."""
    import ast

    literal = re.compile(r"docs/[\w/]+\.md")
    found = []
    for module in sorted((ROOT / "trl_lopti").rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                docstring = ast.get_docstring(node) or ""
                found += [f"{module.relative_to(ROOT)}: {match}" for match in literal.findall(docstring)]
    assert found == []


def test_inline_code_keeps_a_hyphenated_word_on_one_line_and_its_text():
    """`--dry_run` broke after its first hyphen on a phone: each word of inline prose code that holds a hyphen is kept
    whole (a path still breaks after each "/"), and code blocks and tables are left as they are."""
    hooks = extension("hooks")
    html = (
        "<p>Run <code>trl-lopti grpo --dry_run</code> or <code>configs/kk/qwen2.5-3b_ar.yaml</code>.</p>"
        "<pre><code>trl-lopti --help</code></pre><table><tr><td><code>--flag</code></td></tr></table>"
    )
    kept = hooks.unbroken_hyphens(html)
    assert kept == (
        '<p>Run <code><span class="nobr">trl-lopti</span> grpo <span class="nobr">--dry_run</span></code> or '
        '<code>configs/kk/<span class="nobr">qwen2.5-3b_ar.yaml</span></code>.</p>'
        "<pre><code>trl-lopti --help</code></pre><table><tr><td><code>--flag</code></td></tr></table>"
    )
    assert re.sub(r"<[^>]+>", "", kept) == re.sub(r"<[^>]+>", "", html)
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    assert re.search(r"code \.nobr\s*\{\s*white-space:\s*nowrap;", css)


# ------------------------------------------------------------------------------------------------- the built site
@pytest.mark.slow
def test_the_built_site_shows_every_api_type_as_the_source_writes_it(tmp_path):
    """`mkdocs build --strict`, then `.ci/check_site.py` on the site, as `.ci/run`'s docs stage does."""
    pytest.importorskip("mkdocs", reason="the docs extra (.ci/run's docs stage checks the site it builds)")
    site = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    checked = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "check_site.py"), str(site)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout
    assert "dict[str, Any]" in checked.stdout and "Callable[[str, float], None]" in checked.stdout
    quickstart = re.sub(r"<[^>]+>", "", (site / "quickstart" / "index.html").read_text())  # in the nav, built
    assert "pip install trl_lopti" in quickstart and '"Qwen/Qwen2.5-0.5B-Instruct"' in quickstart


# ----------------------------------------------------------------------------------- .ci/docs_launch_commands.py
def test_a_deepspeed_launch_command_is_skipped_only_where_deepspeed_is_not_installed(monkeypatch):
    """`accelerate launch` refuses a ZeRO launcher before any process starts where DeepSpeed is missing (the wheel's
    environment has no `deepspeed` extra): the command is skipped there, with the reason, and dry-run elsewhere."""
    commands = runpy.run_path(str(ROOT / ".ci" / "docs_launch_commands.py"))
    zero2 = 'accelerate launch --config_file "$(trl-lopti presets --path accelerate/zero2)" -m trl_lopti grpo'
    fsdp2 = zero2.replace("zero2", "fsdp2")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a)
    )
    skipped = commands["plan"]("docs/scale.md:1", zero2)
    assert skipped.run is None and "DeepSpeed is not installed" in skipped.how
    assert commands["plan"]("docs/scale.md:1", fsdp2).run == f"{fsdp2} --dry_run"
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "deepspeed" else find_spec(name, *a)
    )
    assert commands["plan"]("docs/scale.md:1", zero2).run == f"{zero2} --dry_run"
