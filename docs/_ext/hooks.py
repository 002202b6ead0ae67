"""MkDocs hooks (`hooks:` in mkdocs.yml): what the site needs from outside `docs/`, without copies in the repository.

- The home page is `README.md` itself: `docs/index.md` holds one marker line, replaced by the README, whose links to
  `docs/...` are made relative to the site (they point into `docs/` on the repository's own page).
- The committed plots of `benchmarks/results/` are served at `benchmarks/results/` beside the pages; a page links them
  as `../benchmarks/results/NAME.png`, which is right on the repository's page and is made right for the site here.
"""

from __future__ import annotations

import re
from pathlib import Path

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
