"""`.ci/run`'s docs stage: checks the types that the built documentation site shows in its API tables, after
`mkdocs build --strict` (tests/test_docs_site.py runs the same checks where MkDocs is installed).

    python .ci/check_site.py SITE_FOLDER

- Every cell of a `Type` column (the tables mkdocstrings makes of the Parameters, Returns, Raises... sections) is a
  Python annotation: no backtick, its brackets balanced, and it parses as an expression (`dict[str, Any]`; not
  `dict[str | Any`, nor a description split into a second row of a Returns table).
- A type that the package's docstrings write with a comma inside brackets (`dict[str, Any]`,
  `Callable[[str, float], None]`) is shown as written, its commas kept, in the row of its parameter, or in a Returns
  table for a return type. Dotted names are compared by their last part (the site shows `list[Tensor]` for
  `list[torch.Tensor]`).

Prints what it checked; exits 1 with every cell that fails. Standard library only.
"""

import ast
import re
import sys
from html.parser import HTMLParser
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_lopti"
TYPE_SPAN = r"\[?`~?[^`]+`\]?"
PARAMETER = re.compile(r"^\s*\**([A-Za-z_]\w*)\s*\(((?:[^()]|\([^()]*\))*)\)\s*[:,]", re.MULTILINE)
RETURNS_ITEM = re.compile(rf"^\s*Returns:\s*\n\s*({TYPE_SPAN}(?:\s*(?:,\s*or|,|or)\s*{TYPE_SPAN})*)\s*:", re.MULTILINE)


class Tables(HTMLParser):
    """The tables of a page: for each, its header's cells and its rows, as text (tags dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[tuple[list[str], list[list[str]]]] = []
        self._cell: list[str] | None = None
        self._row: list[str] | None = None
        self._header = False

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "table":
            self.tables.append(([], []))
        elif tag == "tr" and self.tables:
            self._row = []
            self._header = False
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
            self._header = tag == "th"

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            header, rows = self.tables[-1]
            (header.extend if self._header else rows.append)(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def short(annotation: str) -> str:
    """An annotation with its dotted names by their last part, spaces normalised (`list[torch.Tensor]`:
    `list[Tensor]`)."""
    return " ".join(re.sub(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])", "", annotation).split())


def written_type(text: str) -> str:
    """The type of a docstring's type text, as written: its code spans joined by ` | `."""
    return " | ".join(span.strip() for span in re.findall(r"`~?([^`]+)`", text))


def has_comma_in_brackets(annotation: str) -> bool:
    depth = 0
    for char in annotation:
        depth += (char in "[(") - (char in "])")
        if char == "," and depth > 0:
            return True
    return False


def written_types(package: Path = PACKAGE) -> tuple[dict[str, set[str]], set[str]]:
    """The types the package's docstrings write with a comma inside brackets: {parameter name: its types}, and the
    return types."""
    parameters: dict[str, set[str]] = {}
    returns: set[str] = set()
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        for name, type_text in PARAMETER.findall(text):
            annotation = written_type(type_text.split("*optional*")[0])
            if has_comma_in_brackets(annotation):
                parameters.setdefault(name, set()).add(short(annotation))
        returns |= {short(written_type(item)) for item in RETURNS_ITEM.findall(text)}
    return parameters, {annotation for annotation in returns if has_comma_in_brackets(annotation)}


def type_problem(cell: str) -> str | None:
    """Why a `Type` cell is not a Python annotation, or None."""
    if "`" in cell:
        return "a raw backtick"
    depth = 0
    for char in cell:
        depth += (char in "[(") - (char in "])")
        if depth < 0:
            break
    if depth != 0:
        return "unbalanced brackets"
    try:
        ast.parse(cell, mode="eval")
    except SyntaxError:
        return "not a Python expression"
    return None


def check_page(html: str, parameters: dict[str, set[str]], returns: set[str]) -> tuple[list[str], int, set[str]]:
    """The problems of one page's API tables, the number of `Type` cells checked, and the written types (of
    `parameters` and `returns`) it shows as written."""
    parser = Tables()
    parser.feed(html)
    problems, checked, shown = [], 0, set()
    for header, rows in parser.tables:
        if "Type" not in header:
            continue
        type_column = header.index("Type")
        name_column = header.index("Name") if "Name" in header else None
        for row in rows:
            if len(row) != len(header):
                problems.append(f"a row of {len(row)} cells in a table of {len(header)} columns: {row}")
                continue
            cell = row[type_column]
            checked += 1
            if cell and (problem := type_problem(cell)):
                problems.append(f"type {cell!r}: {problem}")
                continue
            name = row[name_column].lstrip("*") if name_column is not None else None
            expected = parameters.get(name, set()) if name is not None else set()
            if short(cell) in expected or (name is None and short(cell) in returns):
                shown.add(short(cell))
            elif name is not None and expected and ("[" in cell or "," in cell):
                problems.append(f"{name}: type {cell!r}, the docstring writes {' or '.join(sorted(expected))}")
            elif name is None and "[" in cell and short(cell) not in returns:
                problems.append(f"return type {cell!r} is none the docstrings write with its commas")
    return problems, checked, shown


def main(argv: list[str]) -> int:
    site = Path(argv[0])
    pages = sorted(site.rglob("index.html"))
    parameters, returns = written_types()
    problems, checked, shown = [], 0, set()
    for page in pages:
        found, count, seen = check_page(page.read_text(), parameters, returns)
        problems += [f"{page.relative_to(site)}: {problem}" for problem in found]
        checked += count
        shown |= seen
    print(
        f"site: {len(pages)} pages, {checked} type cells of API tables checked; "
        f"shown with their commas: {', '.join(sorted(shown)) or 'none'}"
    )
    if not checked:
        problems.append("no type cell found: is this a built site?")
    for problem in problems:
        print(f"site: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
