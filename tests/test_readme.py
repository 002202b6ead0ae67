"""The READMEs' and the documentation pages' commands name files that exist (a user copies them as they are)."""

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
READMES = ["README.md", "configs/README.md", "benchmarks/README.md"]
PAGES = sorted(str(page.relative_to(ROOT)) for page in (ROOT / "docs").rglob("*.md"))  # the documentation site's
DOCS = READMES + PAGES
PATH_PATTERN = re.compile(
    r"(?<![\w/.-])((?:configs|notebooks|benchmarks|tests|trl_lopti|docs)/[\w./-]*\w\.(?:ya?ml|ipynb|py|sh|md|json|png))"
)


def named_paths(doc: str) -> list[str]:
    return sorted(set(PATH_PATTERN.findall((ROOT / doc).read_text())))


@pytest.mark.parametrize("doc", [doc for doc in DOCS if (ROOT / doc).exists()])
def test_every_path_a_readme_names_exists(doc):
    paths = named_paths(doc)
    assert paths or doc in PAGES, f"{doc} names no file: the pattern is broken"  # a page may name none
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_the_pattern_finds_the_paths_in_commands():
    text = "accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m trl_lopti train --config x.yaml"
    assert PATH_PATTERN.findall(text) == ["configs/accelerate/multi_gpu.yaml"]
    assert PATH_PATTERN.findall("see [`notebooks/a_b.ipynb`](notebooks/a_b.ipynb).") == ["notebooks/a_b.ipynb"] * 2
    assert PATH_PATTERN.findall("[Benchmarks](docs/benchmarks.md)") == ["docs/benchmarks.md"]


def test_the_readme_links_the_documentation_pages_and_the_site_has_them():
    """The README's topic sections link the site's pages (which the test above finds), and it names the site's home."""
    linked = {path for path in named_paths("README.md") if path.startswith("docs/")}
    assert {"docs/method.md", "docs/benchmarks.md", "docs/cpu.md"} <= linked
    assert (ROOT / "docs" / "index.md").read_text().strip() == "<!-- README.md -->"  # the home page is the README
