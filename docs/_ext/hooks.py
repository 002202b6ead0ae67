"""MkDocs hooks (`hooks:` in mkdocs.yml): what the site needs from outside `docs/`, without copies in the repository.

- The home page is `README.md` itself: `docs/index.md` holds one marker line, replaced by the README, whose links to
  `docs/...` are made relative to the site (they point into `docs/` on the repository's own page).
- The committed plots of `benchmarks/results/` are served at `benchmarks/results/` beside the pages; a page links them
  as `../benchmarks/results/NAME.png`, which is right on the repository's page and is made right for the site here.
- A config's API page lists, in its parameters table, every field the config adds to TRL's (`LoptiArguments'` among
  them): the build fails where one is missing.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files


ROOT = Path(__file__).resolve().parents[2]
README_MARKER = "<!-- README.md -->"
PLOTS = "benchmarks/results"


def on_files(files: Files, config) -> Files:
    for plot in sorted((ROOT / PLOTS).glob("*.png")):
        files.append(File.generated(config, f"{PLOTS}/{plot.name}", abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    if page.file.src_uri == "index.md" and markdown.strip() == README_MARKER:
        markdown = re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text())
    depth = page.file.src_uri.count("/")  # a page at the root of docs/ links the plots as ../benchmarks/results/
    return markdown.replace(f"]({'../' * (depth + 1)}{PLOTS}/", f"]({'../' * depth}{PLOTS}/")


def on_page_content(html: str, page, config, files: Files) -> str:
    for name in re.findall(r'<h2 id="trl_lopti\.(Lopti\w+Config)"', html):
        import trl_lopti  # (TRL's import: only for a page that documents a config)

        lopti_config = getattr(trl_lopti, name)
        trl_config = next(cls for cls in lopti_config.__mro__ if cls.__module__.split(".")[0] == "trl")
        added = {f.name for f in dataclasses.fields(lopti_config)} - {f.name for f in dataclasses.fields(trl_config)}
        section = html.split(f'<h2 id="trl_lopti.{name}"', 1)[1].split('<h2 id="', 1)[0]
        listed = set(re.findall(r'<tr class="doc-section-item">\s*<td>\s*<code>(\w+)</code>', section))
        if added - listed:
            raise PluginError(f"{page.file.src_uri}: {name}'s parameters table lacks {sorted(added - listed)}")
    return html
