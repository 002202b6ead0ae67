"""MkDocs hooks (`hooks:` in mkdocs.yml): what the site needs from outside `docs/`, without copies in the repository.

- The home page is `README.md` itself: `docs/index.md` holds one marker line, replaced by the README, whose links to
  `docs/...` are made relative to the site (they point into `docs/` on the repository's own page). The README's first
  commands need a clone (`make demo`, the tests): on the site they move to the section that installs from a clone, for
  contributors, and a user of the wheel is led to `pip install` and the Quickstart first.
- The committed plots of `benchmarks/results/` are served at `benchmarks/results/` beside the pages; a page links them
  as `../benchmarks/results/NAME.png`, which is right on the repository's page and is made right for the site here.
- A config's API page lists, in its parameters table, every field the config adds to TRL's (`LoptiArguments'` among
  them): the build fails where one is missing.
- Tables read on any screen: code in a table may wrap only after `_`, `/` or a dot before a letter (a `<wbr>` there;
  the stylesheet lets no code break elsewhere, so a name or a default never breaks inside a word), and each cell of an
  API table (mkdocstrings' `doc-section-item` rows) carries its column's name (`data-label`), which the stylesheet shows
  where the rows stack on a narrow screen.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING


# MkDocs is imported where a hook runs: the text transforms below are tested where the docs extra is not installed.
if TYPE_CHECKING:
    from mkdocs.structure.files import Files


ROOT = Path(__file__).resolve().parents[2]
README_MARKER = "<!-- README.md -->"
EXTRAS_MARKER = "<!-- --8<-- [start:extras] -->"
PLOTS = "benchmarks/results"


def on_files(files: Files, config) -> Files:
    from mkdocs.structure.files import File

    for plot in sorted((ROOT / PLOTS).glob("*.png")):
        files.append(File.generated(config, f"{PLOTS}/{plot.name}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    if page.file.src_uri == "index.md" and markdown.strip() == README_MARKER:
        markdown = home_page(re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text()))
    depth = page.file.src_uri.count("/")  # a page at the root of docs/ links the plots as ../benchmarks/results/
    return markdown.replace(f"]({'../' * (depth + 1)}{PLOTS}/", f"]({'../' * depth}{PLOTS}/")


def home_page(readme: str) -> str:
    """The README as the site's home page: in place of its first code block (the commands of a clone), `pip install`
    and the Quickstart; that block, for contributors, at the end of the install section, after its own clone lines."""
    clone_commands = re.search(r"^```bash\n.*?^```\n", readme, re.MULTILINE | re.DOTALL)[0]
    for_users = (
        "```bash\npip install trl_lopti\n```\n\nThen the [Quickstart](quickstart.md): a first run from Python and from "
        "the command line, on one GPU and on several.\n"
    )
    readme = readme.replace(clone_commands, for_users, 1)
    for_contributors = f"The offline demo and the tests, from a clone:\n\n{clone_commands}\n"
    return readme.replace(EXTRAS_MARKER, for_contributors + EXTRAS_MARKER, 1)


def on_page_content(html: str, page, config, files: Files) -> str:
    for name in re.findall(r'<h2 id="trl_lopti\.(Lopti\w+Config)"', html):
        import trl_lopti  # (TRL's import: only for a page that documents a config)

        lopti_config = getattr(trl_lopti, name)
        trl_config = next(cls for cls in lopti_config.__mro__ if cls.__module__.split(".")[0] == "trl")
        added = {f.name for f in dataclasses.fields(lopti_config)} - {f.name for f in dataclasses.fields(trl_config)}
        section = html.split(f'<h2 id="trl_lopti.{name}"', 1)[1].split('<h2 id="', 1)[0]
        listed = set(re.findall(r'<tr class="doc-section-item">\s*<td>\s*<code>(\w+)</code>', section))
        if added - listed:
            from mkdocs.exceptions import PluginError

            raise PluginError(f"{page.file.src_uri}: {name}'s parameters table lacks {sorted(added - listed)}")
    html = re.sub(r"<table>.*?</table>", lambda table: readable_table(table[0]), html, flags=re.DOTALL)
    return unbroken_hyphens(html)


def unbroken_hyphens(html: str) -> str:
    """Inline code in prose (not in a code block or a table) with each word (each part of a path) that holds a hyphen
    kept on one line, in a `nobr` span: a browser breaks after a hyphen, which split `--dry_run` and `trl-lopti` across
    lines on a phone. The text, and so what a reader copies, is unchanged."""
    parts = re.split(r"(<pre\b.*?</pre>|<table\b.*?</table>)", html, flags=re.DOTALL)

    def keep_whole(code: re.Match[str]) -> str:
        # A path may still break after each "/": its parts with a hyphen are kept whole, one by one.
        words = re.sub(r"([^\s/]*-[^\s/]*)", r'<span class="nobr">\1</span>', code[1])
        return f"<code>{words}</code>"

    return "".join(
        part if part.startswith(("<pre", "<table")) else re.sub(r"<code>([^<]*)</code>", keep_whole, part)
        for part in parts
    )


def readable_table(table: str) -> str:
    """A table's code with a break allowed only after `_`, `/` and a dot before a letter, and an API table's cells
    labelled by column (`data-label`)."""
    table = re.sub(
        r"(<code\b[^>]*>)(.*?)(</code>)", lambda code: code[1] + word_breaks(code[2]) + code[3], table, flags=re.DOTALL
    )
    if 'class="doc-section-item"' not in table:
        return table
    labels = [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<th\b[^>]*>(.*?)</th>", table, re.DOTALL)]

    def label_cells(row: re.Match[str]) -> str:
        cells = iter(labels)
        return re.sub(r"<td>", lambda _: f'<td data-label="{next(cells, "")}">', row[0])

    return re.sub(r'<tr class="doc-section-item">.*?</tr>', label_cells, table, flags=re.DOTALL)


def word_breaks(code: str) -> str:
    """`<wbr>` after each `_` and `/`, and after a dot before a letter, in the text of a code span (not in its tags)."""
    parts = re.split(r"(<[^>]+>)", code)
    return "".join(
        part if part.startswith("<") else re.sub(r"([_/]|\.(?=[A-Za-z]))", r"\1<wbr>", part) for part in parts
    )
