"""The READMEs' commands name files that exist (a user copies them as they are)."""

import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "configs/README.md", "benchmarks/README.md"]
PATH_PATTERN = re.compile(
    r"(?<![\w/.-])((?:configs|notebooks|benchmarks|tests|trl_lopti)/[\w./-]*\w\.(?:ya?ml|ipynb|py|sh|md|json))"
)


def named_paths(doc: str) -> list[str]:
    return sorted(set(PATH_PATTERN.findall((ROOT / doc).read_text())))


@pytest.mark.parametrize("doc", [doc for doc in DOCS if (ROOT / doc).exists()])
def test_every_path_a_readme_names_exists(doc):
    paths = named_paths(doc)
    assert paths, f"{doc} names no file: the pattern is broken"
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, f"{doc} names files that do not exist: {missing}"


def test_the_pattern_finds_the_paths_in_commands():
    text = "accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m trl_lopti train --config x.yaml"
    assert PATH_PATTERN.findall(text) == ["configs/accelerate/multi_gpu.yaml"]
    assert PATH_PATTERN.findall("see [`notebooks/a_b.ipynb`](notebooks/a_b.ipynb).") == ["notebooks/a_b.ipynb"] * 2
