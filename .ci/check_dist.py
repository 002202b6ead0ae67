"""`.ci/run`'s wheel stage: checks what `python -m build` made against the checkout, before the wheel is installed.

    python .ci/check_dist.py DIST_FOLDER

- the wheel holds every file of the package folder (every subpackage, py.typed) and the presets of configs/ under
  trl_lopti/presets, nothing else but its .dist-info, and no tests or caches;
- the sdist holds the same package files and what the wheel is built from (setup.cfg, pyproject.toml, README.md);
- the wheel's metadata: Requires-Python as setup.cfg says, a `Programming Language :: Python :: 3.X` classifier for
  each tested version and `Typing :: Typed`, the `trl-lopti` console script.

Prints the wheel's file list and counts; exits 1 with the differences otherwise. Standard library only.
"""

import configparser
import re
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "trl_lopti"


def package_files() -> set[str]:
    """The package's files in the checkout (what a user's import may need), as paths relative to the checkout: its
    modules and the presets, which `trl_lopti/presets` (a link to `configs/`) makes package data."""
    presets = [ROOT / "configs" / "README.md", *(ROOT / "configs").glob("*/*.yaml")]
    return {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / PACKAGE).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in {".pyc", ".pyo"}
    } | {f"{PACKAGE}/presets/{path.relative_to(ROOT / 'configs').as_posix()}" for path in presets}


def specifiers(text: str) -> list[str]:
    """A version specifier's clauses in a fixed order (the metadata orders them otherwise than setup.cfg)."""
    return sorted(part.strip() for part in text.split(","))


def main(dist: Path) -> int:
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    problems = []
    expected = package_files()

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata_name,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
        (entry_points_name,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        entry_points = archive.read(entry_points_name).decode()
    in_package = {name for name in names if name.startswith(f"{PACKAGE}/")}
    others = [name for name in names if name not in in_package and ".dist-info/" not in name]
    if in_package != expected:
        problems.append(f"wheel lacks {sorted(expected - in_package)}, has extra {sorted(in_package - expected)}")
    if others:
        problems.append(f"wheel has files outside {PACKAGE}/ and its .dist-info: {others}")
    if any("__pycache__" in name or name.endswith(".pyc") for name in names):
        problems.append("wheel has compiled caches")

    with tarfile.open(sdist) as archive:
        members = {member.name.split("/", 1)[1] for member in archive.getmembers() if member.isfile()}
    for needed in sorted(expected | {"setup.cfg", "pyproject.toml", "README.md"}):
        if needed not in members:
            problems.append(f"sdist lacks {needed}")

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    if specifiers(metadata["Requires-Python"]) != specifiers(config["options"]["python_requires"]):
        problems.append(f"Requires-Python {metadata['Requires-Python']!r}, setup.cfg says otherwise")
    classifiers = metadata.get_all("Classifier") or []
    tested = sorted(re.findall(r"^py(3\.\d+)-", path.name)[0] for path in (ROOT / ".ci" / "stacks").glob("py3.*.txt"))
    for classifier in ["Typing :: Typed", *(f"Programming Language :: Python :: {version}" for version in tested)]:
        if classifier not in classifiers:
            problems.append(f"metadata lacks the classifier {classifier!r}")
    if not re.search(r"^trl-lopti\s*=\s*trl_lopti\.__main__:run$", entry_points, re.MULTILINE):
        problems.append(f"no trl-lopti console script in {entry_points!r}")

    print(
        f"ci: {wheel.name}: {len(names)} files ({len(in_package)} in {PACKAGE}/, {len(names) - len(in_package)} "
        f"in its .dist-info); {sdist.name}: {len(members)} files"
    )
    print("ci: the wheel's files: " + " ".join(sorted(names)))
    print(f"ci: Requires-Python {metadata['Requires-Python']}; classifiers: {'; '.join(classifiers)}")
    for problem in problems:
        print(f"ci: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
